"""The GPU checks as recorded: what experiments/gpu_check.sh wrote into results/gpu/ on a CUDA
machine, summarised into results/gpu/REPORT.md and headline rows for results/REPORT.md.

This study runs nothing on a GPU. It reads the recorded files (the GPU, the software and the
revision they ran at are in gpu.txt), recomputes the performance model's predictions of the
recorded timed runs from the recorded calibration (gpu_calibrate.compare), and says what passed,
what did not, and what the numbers show. Where no GPU run is recorded it says that.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import pandas as pd

from experiments.markdown import table
from experiments.provenance import ROOT
from experiments.paper_values import NOT_AN_ERROR

MODEL_GOAL = 0.15      # issue 10: each model term within 15% of the timed runs


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def recorded(out: Path) -> dict | None:
    """gpu.txt: the GPU line (name, memory, driver), the software, the revision and the date."""
    path = out / "gpu.txt"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    gpu = lines[0].split(",")[0].strip() if lines else "?"
    revision = next((line.split()[1] for line in lines if line.startswith("zero-ref ")), "?")
    software = next((line for line in lines if line.startswith("torch ")), "?")
    date = next((line for line in lines if re.match(r"\d{4}-\d\d-\d\dT", line)), "?")
    return {"gpu": gpu, "line": lines[0] if lines else "?", "software": software, "revision": revision, "date": date}


def kernel_tests(out: Path) -> str:
    """pytest's last summary line of the compiled kernel tests."""
    path = out / "test_kernels.log"
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", path.read_text(), re.M) if path.exists() else []
    return found[-1] if found else "not run"


def engine_checks(out: Path) -> list[dict]:
    return _read_csv(out / "engine_check.csv")


def kernel_rows(out: Path) -> dict:
    """At the largest size benchmarked: the fused AdamW step against torch, unflatten against
    torch._foreach_copy_."""
    rows = _read_csv(out / "bench.csv")
    if not rows:
        return {}
    largest = max(int(r["size"]) for r in rows)
    at = {(r["op"], r["backend"]): r for r in rows if int(r["size"]) == largest}
    return {"size": largest, "adamw": at.get(("adamw_step", "triton")),
            "adamw_torch": at.get(("adamw_step", "torch-AdamW-fused+cast")),
            "unflatten": at.get(("unflatten", "triton")), "foreach": at.get(("unflatten", "torch-foreach_copy"))}


def budget_outcome(out: Path) -> str:
    """What the budget run did: the batch it timed, or how it failed."""
    path = out / "budget.log"
    if not path.exists():
        return "not run"
    text = path.read_text()
    result = re.findall(r'^\{"world_size".*\}$', text, re.M)
    if result:
        row = json.loads(result[-1])
        return f"batch {row['batch']} ran held to the budget: peak {row['peak_gb']:.2f} GB"
    oom = re.search(r"OutOfMemoryError: CUDA out of memory\. Tried to allocate ([\d.]+ [MG]iB).*?"
                    r"([\d.]+ [MG]iB) allowed; Of the allocated memory ([\d.]+ [MG]iB) is allocated by PyTorch, "
                    r"and ([\d.]+ [MG]iB) is reserved", text)
    where = re.findall(r'File "[^"]*/(zero_ref/\w+\.py)", line \d+, in (\w+)', text)
    if oom:
        site = f" in {where[-1][0]} {where[-1][1]}" if where else ""
        return (f"out of memory{site}: asked for {oom.group(1)} with {oom.group(3)} allocated and {oom.group(4)} "
                f"reserved beside it, {oom.group(2)} allowed")
    return "failed (see budget.log)"


def host_evidence(runs: list[dict], calibration: dict) -> list[str]:
    """What says the timed steps are bound by the host issuing work, read from the recorded files."""
    notes = []
    stage2 = {int(r["batch"]): r for r in runs if r["stage"] == "2"}
    if len(stage2) >= 2:
        small, large = min(stage2), max(stage2)
        b_small, b_large = float(stage2[small]["backward_s"]), float(stage2[large]["backward_s"])
        notes.append(f"backward (recomputation included) takes {1e3 * b_small:.1f} ms at batch {small} and "
                     f"{1e3 * b_large:.1f} ms at batch {large}: {large // small}x the tokens in "
                     f"{b_large / b_small:.2f}x the time, so at batch {small} the GPU waits for the host")
    issue = calibration.get("block_issue", {})
    for tokens, parts in sorted(issue.items(), key=lambda kv: int(kv[0])):
        bare, checkpointed = parts.get("block, bare"), parts.get("block, checkpointed")
        if bare and checkpointed:
            notes.append(f"one block's forward at {int(tokens):,} tokens, measured alone: its kernels take "
                         f"{1e3 * bare['wall_s']:.2f} ms bare; under torch.utils.checkpoint the host needs "
                         f"{1e3 * checkpointed['issue_s']:.2f} ms just to issue it (done at "
                         f"{1e3 * checkpointed['wall_s']:.2f} ms)")
        timed = [r for r in runs if int(r["batch"]) * int(r["seq"]) == int(tokens) and r["stage"] == "2"]
        if checkpointed and parts.get("head") and timed:
            run = timed[0]
            per_block = (float(run["forward_s"]) - parts["head"]["wall_s"]) / int(run["layers"])
            notes.append(f"but in the timed run at {int(tokens):,} tokens a block's whole forward took at most "
                         f"{1e3 * per_block:.2f} ms (the forward less the head's {1e3 * parts['head']['wall_s']:.1f} ms, "
                         f"over {run['layers']} blocks): measured alone, after a synchronize, the issue time "
                         "comes out higher than in a run, so these single-call timings on the lent machine "
                         "locate the cost but do not calibrate it")
    return notes


def changed_since(revision: str) -> list[str] | None:
    """The code files (zero_ref/, experiments/, triton_kernels/) that differ between ``revision``
    and the working tree; None when git cannot say (not a checkout, revision unknown)."""
    try:
        done = subprocess.run(["git", "diff", "--name-only", revision.split("+")[0], "--", "zero_ref", "experiments",
                               "triton_kernels"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [line for line in done.stdout.splitlines() if line]


def _since(revision: str) -> str:
    """A sentence on the code changed since the recorded run: its rows describe that revision."""
    changed = changed_since(revision)
    if not changed:
        return ""
    return (f" **Stale**: {len(changed)} code file(s) differ from this run's revision (`git diff --stat "
            f"{revision[:7]} -- zero_ref experiments triton_kernels`): a failing row describes the recorded revision "
            "until the next GPU run.")


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """Summarise results/gpu (``out``): REPORT.md there and the headline rows."""
    out = Path(out)
    record = recorded(out)
    if record is None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "REPORT.md").write_text("# GPU checks\n\nNo GPU run is recorded: run `bash experiments/gpu_check.sh` on a "
                                       "CUDA machine.\n")
        return {"headline": [{"item": "GPU checks (experiments/gpu_check.sh)", "paper": "V100 32 GB, NCCL",
                              "ours": "no GPU run recorded", "error": NOT_AN_ERROR, "how": "-"}], "meta": {}}
    how = f"real run, {record['gpu']} (gpu_check.sh at `{record['revision'][:7]}`)"
    changed = changed_since(record["revision"])
    stale = f" at `{record['revision'][:7]}`, {len(changed)} code file(s) changed since" if changed else ""
    headline, lines = [], [f"# GPU checks on {record['gpu']}", "",
                           f"Recorded by `bash experiments/gpu_check.sh` at git `{record['revision']}` on {record['date']}: "
                           f"{record['line']}; {record['software']}. Summarised by `experiments/gpu_report.py`; every "
                           "file beside this one is the script's own output (gpu_check.log is the whole run)."
                           + _since(record["revision"]), ""]

    tests = kernel_tests(out)
    headline.append({"item": "the kernel tests, Triton compiled", "paper": "(the project's kernels)", "ours": tests,
                     "error": f"all pass: {'failed' not in tests and 'passed' in tests}", "how": how})
    lines += ["## Kernel tests, Triton compiled", "", f"`tests/test_kernels.py` with TRITON_INTERPRET=0: {tests}.", ""]

    checks = engine_checks(out)
    failing = [c for c in checks if c["pass"] != "True"]
    headline.append({"item": "engine checks on CUDA (NCCL, world 1)", "paper": "(the engine's contract)",
                     "ours": f"{len(checks) - len(failing)} of {len(checks)} pass",
                     "error": "failing: " + "; ".join(f"{c['check']} (stage {c['stage']})" for c in failing)
                     if failing else "none failing", "how": how})
    for c in failing:
        headline.append({"item": f"engine check failing: {c['check']}", "paper": f"expected {c['expected']}",
                         "ours": c["value"], "error": f"fails{stale}", "how": how})
    if checks:
        frame = pd.DataFrame(checks)[["check", "stage", "value", "expected", "pass"]]
        lines += ["## Engine checks (experiments/gpu_engine_check.py)", "", table(frame), ""]

    kernels = kernel_rows(out)
    if kernels.get("adamw") and kernels.get("adamw_torch"):
        adamw, torch_adamw = kernels["adamw"], kernels["adamw_torch"]
        headline.append({"item": f"fused AdamW step (bf16 copy out), {kernels['size']:,} elements",
                         "paper": "memory-bound: time set by bytes moved (Sec 3)",
                         "ours": f"{float(adamw['gbps']):.0f} GB/s = {float(adamw['frac_copy_bw']):.2f} of copy "
                                 f"bandwidth; {float(torch_adamw['median_s']) / float(adamw['median_s']):.2f}x "
                                 "torch's fused AdamW + cast",
                         "error": NOT_AN_ERROR, "how": how})
    if kernels.get("unflatten") and kernels.get("foreach"):
        ratio = float(kernels["foreach"]["median_s"]) / float(kernels["unflatten"]["median_s"])
        headline.append({"item": f"fused unflatten, {kernels['size']:,} elements into 200 tensors",
                         "paper": "(the project's kernel)",
                         "ours": f"{ratio:.2f}x the speed of torch._foreach_copy_ "
                                 f"({float(kernels['unflatten']['median_s']) * 1e3:.2f} vs "
                                 f"{float(kernels['foreach']['median_s']) * 1e3:.2f} ms)",
                         "error": NOT_AN_ERROR, "how": how})
    lines += ["## Kernel benchmark", "", "The table with every size is in [README.md](README.md) (bench_kernels.py).", ""]

    runs = _read_csv(out / "throughput" / "throughput.csv")
    for r in runs:
        headline.append({"item": f"GPT-2 {r['layers']} x {r['hidden']} ({int(r['local_params']) / 1e6:.0f}M), stage "
                                 f"{r['stage']}, batch {r['batch']} x {r['seq']}, bf16, one GPU",
                         "paper": "V100s: over 38 TFLOPS per GPU at 100B (Fig 2; another GPU and model size)",
                         "ours": f"{float(r['tflops_per_rank']):.0f} TFLOPS ({float(r['median_step_s']) * 1e3:.0f} ms "
                                 f"a step, peak {float(r['peak_gb']):.1f} GB)",
                         "error": NOT_AN_ERROR, "how": how})
    if runs:
        frame = pd.DataFrame(runs)[["stage", "batch", "median_step_s", "forward_s", "backward_s", "step_s",
                                    "tflops_per_rank", "peak_gb"]]
        lines += ["## Timed runs (experiments/throughput.py under torchrun)", "",
                  "TFLOPS count recomputation (Megatron's formula, perf_model.training_flops).", "",
                  table(frame, lambda v: f"{float(v):.4g}" if re.fullmatch(r"[\d.e+-]+", str(v)) else str(v)), ""]

    if (out / "calibration.json").exists() and runs:
        from experiments.gpu_calibrate import compare

        model = pd.DataFrame(compare(out, show=not quiet))
        within = (model.error.abs() <= MODEL_GOAL)
        whole = model[model.phase == "whole step"]
        headline.append({"item": "performance model against the timed GPU runs (whole step)",
                         "paper": f"(issue 10: every term within {MODEL_GOAL:.0%})",
                         "ours": ", ".join(f"batch {r.batch} stage {r.stage}: {r.error:+.0%}" for r in whole.itertuples()),
                         "error": f"{int(within.sum())} of {len(model)} phase predictions within {MODEL_GOAL:.0%}",
                         "how": "performance model calibrated on the GPU"})
        cal = json.loads((out / "calibration.json").read_text())   # as recorded: block_issue, adamw_by_width
        notes = host_evidence(runs, cal)
        lines += ["## The performance model on this GPU", "",
                  "calibration.json: bf16 block and head rates over (tokens, hidden) measured on the GPU (the head "
                  "with the model's own loss), the optimizer step's rate, and the host's time to issue one block. "
                  f"model_vs_measured.csv: {int(within.sum())} of {len(model)} phase predictions within "
                  f"{MODEL_GOAL:.0%}.", "",
                  table(model[["stage", "batch", "phase", "measured_s", "predicted_s", "error"]].assign(
                      error=model.error.map("{:+.1%}".format)), lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)),
                  "",
                  "What the recorded numbers say about the misses:", ""]
        lines += [f"- {note}" for note in notes]
        lines += [f"- optimizer step: {', '.join(f'{w} x {w} layers {r / 1e9:.1f} G elements/s' for w, r in cal.get('adamw_by_width', {}).items())} "
                  "(the model uses the larger)" if cal.get("adamw_by_width") else "", ""]
        lines += ["The model adds up GPU time (FLOPs at the measured rates, the optimizer at its measured rate). "
                  "Where the host cannot issue kernels as fast as the GPU runs them, as above, that sum "
                  "underestimates the step.", ""]
        checked = model.dropna(subset=["error_with_host"])
        checked = checked.assign(floor_binds=checked.predicted_with_host_s > checked.predicted_s)
        if len(checked):
            host_within = checked.error_with_host.abs() <= MODEL_GOAL
            out_of_sample = ~checked.floor_binds
            headline.append({"item": "performance model with the host term against the timed GPU runs",
                             "paper": f"(issue 10: every term within {MODEL_GOAL:.0%})",
                             "ours": ", ".join(f"batch {r.batch} stage {r.stage} {r.phase}: {r.error_with_host:+.0%}"
                                               + (" (in-sample)" if r.floor_binds else "") for r in checked.itertuples()),
                             "error": f"{int(host_within.sum())} of {len(checked)} within {MODEL_GOAL:.0%}; out of sample "
                                      f"{int((host_within & out_of_sample).sum())} of {int(out_of_sample.sum())}",
                             "how": "performance model, host floor from the smallest batch timed"})
        lines += ["The host term (`gpu_calibrate.host_floors`): no phase faster than the same model's phase timed "
                  "at the smallest batch (the host issues the same kernels at any batch). gpu_check.sh times "
                  "batch 1 for it; the floor's own run is its fit and is not counted. Where the floor binds "
                  "(`floor_binds`), the prediction *is* the smaller batch's measured time: an **in-sample** number, "
                  "which says the phase did not speed up with the batch, not that the model predicts it. "
                  + (f"With it, {int(host_within.sum())} of {len(checked)} phase predictions of the other runs "
                     f"are within {MODEL_GOAL:.0%}; of the {int(out_of_sample.sum())} where the floor does not bind "
                     f"(out of sample), {int((host_within & out_of_sample).sum())}:" if len(checked) else
                     "No run of a smaller batch of the same model was timed, so it is not checked here."), ""]
        if len(checked):
            lines += [table(checked[["stage", "batch", "host_floor_batch", "phase", "measured_s",
                                     "predicted_with_host_s", "error_with_host", "floor_binds"]].assign(
                error_with_host=checked.error_with_host.map("{:+.1%}".format)),
                lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)), ""]

    outcome = budget_outcome(out)
    headline.append({"item": "largest batch in 10 GB, then run held to 10 GB", "paper": "(the max-batch search, Fig 3)",
                     "ours": outcome, "error": "fits: " + str(outcome.startswith("batch"))
                     + ("" if outcome.startswith("batch") else stale), "how": how})
    lines += ["## Largest batch in a budget, held to it", "", outcome, ""]

    smoke = _read_csv(out / "engine_smoke.csv")
    if smoke:
        headline.append({"item": "engine smoke runs, NCCL, world 1, bf16: elements moved / Psi by stage",
                         "paper": "2, 2, 2, 3 Psi (Sec 7)",
                         "ours": ", ".join(f"stage {r['stage']}: {float(r['elements_moved_over_psi']):.3f}" for r in smoke),
                         "error": f"exact: {[float(r['elements_moved_over_psi']) for r in smoke] == [2.0, 2.0, 2.0, 3.0]}",
                         "how": how})
        frame = pd.DataFrame(smoke)[["stage", "first_loss", "last_loss", "median_step_s", "total",
                                     "peak_device_bytes", "elements_moved_over_psi"]]
        lines += ["## Engine smoke runs (zero-ref train --device cuda)", "", table(frame), ""]
    (out / "REPORT.md").write_text("\n".join(lines))
    return {"headline": headline, "meta": {"recorded": record}}
