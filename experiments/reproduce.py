"""`zero-ref reproduce`: run every study of the paper that exists, write results/ and REPORT.md.

Each study is a function ``run(out, quick, quiet) -> {"headline": rows, "meta": {...}}``
that writes its CSVs, plots and own REPORT.md under ``results/<study>/`` and returns one row per
paper claim it checks: ``item``, ``paper`` (the paper's value), ``ours``, ``error`` and ``how``
(analysis / engine at scale / search / real run / performance model). This module runs them in
turn and writes ``results/REPORT.md``: a single page that says what is reproduced and what is not.
Its parts: what the paper did that this project has not (``GAPS``, "Not reproduced yet"); every
number the studies chose or fitted rather than took from the paper, with how much the results
move when it changes ("Chosen and fitted numbers"); then one table per study, every paper table
and figure with the paper's value, ours and how ours was obtained, and for a study not rerun the
revision it was made at and how many commits have changed the code since. Later studies plug in
by adding an entry to ``STUDIES``.

    python -m experiments.reproduce            # the default: about 100 minutes on 2 CPU cores
    python -m experiments.reproduce --quick    # about 5 minutes: fewer cases, traces and real runs, no benchmarks, no peers
                                               # and no throughput study
    python -m experiments.reproduce --only throughput    # one study (about 12 minutes)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments import paper_values
from experiments.provenance import ROOT, provenance


def _memory(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.memory_study import run_study

    return run_study(out, quick, quiet)


def _step_time(out: Path, quick: bool, quiet: bool) -> dict:
    """bench_step.py in fp32 and bf16: every stage's step time against DDP on this machine."""
    from experiments.bench_step import main as bench

    headline = []
    # bf16 also times stages 2 and 3 with reduce_dtype="fp32" (the cost of fp32 reductions); fewer
    # steps, since bf16 matmuls are slow on CPUs without native bf16 (about 11 s a step without AVX-512)
    runs = (("fp32", out, []), ("bf16", out / "bf16", ["--steps", "12", "--warmup", "2", "--fp32-reduce-stages", "2", "3"]))
    for dtype, folder, extra in runs:
        rows = bench(["--dtype", dtype, "--out", str(folder), *extra])
        ddp = next(r for r in rows if r["system"] == "ddp")
        for r in rows:
            if r["system"] == "ddp":
                continue
            if r["system"].endswith("-r32"):
                headline.append({
                    "item": f"step time, stage {int(r['stage'])} with reduce_dtype='fp32', bf16, world 2",
                    "paper": "(not in the paper)", "ours": f"{r['ratio_to_same_stage']:.3f}x the bf16 reduction",
                    "error": "cost measured, no goal", "how": "real run"})
                continue
            headline.append({
                "item": f"step time, stage {int(r['stage'])} vs DDP + AdamW(foreach), {dtype}, world 2",
                "paper": "2Ψ comm. for stages 0-2, 3Ψ for stage 3 (no step time given)",
                "ours": f"{r['ratio_to_ddp']:.3f}x DDP ({r['median_s'] * 1e3:.0f} vs {ddp['median_s'] * 1e3:.0f} ms)",
                "error": f"project goal <= {r['goal']:.2f}x: {r['pass']}", "how": "real run"})
    return {"headline": headline, "meta": {}}


_NOT_AN_ERROR = "none: the paper gives no number (a measurement, not an error)"


def _kernels(out: Path, quick: bool, quiet: bool) -> dict:
    """bench_kernels.py: the optimizer-step kernels against torch's AdamW and the copy bandwidth."""
    import csv

    from experiments.bench_kernels import main as bench

    bench(["--out", str(out), "--threads", "1"])
    with open(out / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    headline = [{"item": f"{r['op']} {r['backend']}, {int(r['size']):,} elements ({r['device']})",
                 "paper": "memory-bound: time set by bytes moved (Sec 3)",
                 "ours": f"{float(r['gbps']):.1f} GB/s = {float(r['frac_copy_bw']):.2f} of copy bandwidth",
                 "error": _NOT_AN_ERROR, "how": "real run"} for r in rows if r["op"] == "adamw_step"]
    return {"headline": headline, "meta": {}}


def _activations(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.activation_study import run_study

    return run_study(out, quick, quiet)


def _comm_volume(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.comm_volume_study import run_study

    return run_study(out, quick, quiet)


def _walkthrough(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.timeline import run

    return run(out, quick, quiet)


def _convergence(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.convergence import run_study

    return run_study(out, quick, quiet)


def _zero_r(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.zero_r_study import run_study

    return run_study(out, quick, quiet)


def _fragmentation(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.fragmentation_study import run_study

    return run_study(out, quick, quiet)


def _throughput(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.throughput_report import run_study

    return run_study(out, quick, quiet)


def _benchmarks(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.bench import run_study

    return run_study(out, quick, quiet)


def _peers(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.peers import run_study

    return run_study(out, quick, quiet)


def _scaling_curves(out: Path, quick: bool, quiet: bool) -> dict:
    from experiments.scaling_curves import NDS, run

    if quick:   # GPT-2 S only, four Nd: seconds
        return run(out, None, quiet, models=("S",), nds=(1, 4, 64, 1024))
    return run(out, None, quiet, nds=NDS)


STUDIES = {
    "memory": ("Memory and model size: Table 1, Figure 1, Table 2, Sec 10.4 (Fig 4's sizes)", _memory),
    "activations": ("Activation memory: Sec 3.2, 4.2.1 and 6.1's numbers beside the analysis, every mismatch",
                    _activations),
    "comm_volume": ("Elements moved per step by stage and world size (Sec 7), counted by wrapping "
                    "torch.distributed's collectives in real gloo runs", _comm_volume),
    "walkthrough": ("The walkthrough's timelines: one traced step per stage (gathers, reductions, frees, bytes "
                    "alive) beside the formulas; docs/", _walkthrough),
    "convergence": ("Convergence on real text: stages 0-3 against DDP on the Python standard library's source, "
                    "fp32 and bf16, with parameter groups and a warmup + cosine schedule", _convergence),
    "zero_r": ("ZeRO-R: partitioned activation checkpoints (Pa, Pa+cpu), Sec 6.1 and Sec 8", _zero_r),
    "fragmentation": ("Fragmentation measured (MD): Table 2, Fig 4 and Fig 6 searched again, Fig 7", _fragmentation),
    "throughput": ("Throughput: the performance model checked on timed runs, superlinear scaling at our scale, "
                   "Figs 2, 3, 4, 8 projected to the paper's V100s", _throughput),
    "bench_step": ("Step time of every stage against DDP (project targets; the elements each stage moves are "
                   "counted in comm_volume)", _step_time),
    "kernels": ("Fused optimizer-step kernels (Triton rows need CUDA)", _kernels),
    "benchmarks": ("The scaling regression suite: every stage against DDP at Nd 1, 2, 4 for three GPT-2 sizes, "
                   "gated against the committed baseline", _benchmarks),
    "scaling_curves": ("Scaling curves: bytes and elements per rank against Nd (1-1024) and Ψ beside the paper's "
                       "formulas, step time against Nd", _scaling_curves),
    "peers": ("Peers side by side: DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed ZeRO 1-3 and zero-ref 0-3 on one "
              "model, seed and data stream", _peers),
}
"""study folder -> (what it reproduces, its runner)."""
FULL_ONLY = {"bench_step", "kernels", "throughput", "benchmarks", "peers"}
"""Benchmarks that take minutes: skipped by --quick."""


def _cell(value) -> str:
    return str(value).replace("|", "/")


def _rows(sections, folder: str) -> list[dict]:
    return next((result["headline"] for name, _, result in sections if name == folder), [])


def _find(rows: list[dict], start: str) -> dict | None:
    return next((r for r in rows if r["item"].startswith(start)), None)


def _percent(text: str) -> float | None:
    """The leading signed percentage of a headline ``error`` cell ("+15.6% (at ...)" -> 15.6)."""
    match = re.match(r"\s*([+-]?\d+(?:\.\d+)?)%", str(text))
    return float(match.group(1)) if match else None


def _paper(quantity: str) -> str:
    """A number the paper states, with its unit, from experiments/paper_data/headline_numbers.csv."""
    row = paper_values.headline(quantity)
    unit = row["unit"]
    qualifier = re.fullmatch(r"(.*) \((over|up to|approx|less than|at least|near|about)\)", unit)
    if qualifier:   # "38 TFLOPS per GPU (over)" -> "over 38 TFLOPS per GPU"
        return f"{qualifier.group(2)} {row['value']} {qualifier.group(1)}"
    return f"{row['value']} {unit}"


def _chosen_fragmentation() -> float:
    from experiments.max_model_size import Assumptions

    return Assumptions().fragmentation


def _gpu_studies(out: Path) -> list[str]:
    """Studies whose recorded hardware includes a GPU (meta.json or headline.json), and "gpu" when
    experiments/gpu_check.sh has written results/gpu/*.csv."""
    found = ["gpu"] if any((out / "gpu").glob("*.csv")) else []
    for folder in STUDIES:
        for name in ("meta.json", "headline.json"):
            path = out / folder / name
            if path.exists() and "gpu" in json.loads(path.read_text()).get("hardware", {}):
                found.append(folder)
                break
    return found


def not_reproduced(out: Path, sections) -> list[dict]:
    """What the paper shows that results/ does not, each with what stands in for it and why: one
    row per missing artifact, its "instead" read from the studies' headline rows where one exists."""
    throughput = _rows(sections, "throughput")
    goals = [r for r in throughput if "goal" in str(r["error"]) and "TFLOPS" in r["item"]]
    within = sum("True" in str(r["error"]) for r in goals)
    ours_scale = _find(throughput, "superlinear at our scale")
    fig3 = _find(throughput, "Fig 3 superlinearity")
    fig7 = _find(_rows(sections, "fragmentation"), "Fig 7")
    measured = [_percent(r["error"]) for r in _rows(sections, "fragmentation") if "fragmentation measured" in r["item"]]
    measured = [m for m in measured if m is not None]
    activations = _rows(sections, "activations")
    missed = [r["item"] for r in activations if "not reproduced" in str(r["error"])]
    gpu = _gpu_studies(out)
    frag = _chosen_fragmentation()
    t2 = paper_values.TABLE2_MEASURED_B
    fig6 = paper_values.FIG6_B
    triton = (out / "kernels" / "bench.csv").exists() and "triton" in (out / "kernels" / "bench.csv").read_text()
    rows = [
        {"artifact": "Figs 2, 3, 4: throughput in TFLOPS per GPU",
         "paper": f"400 V100s: {_paper('ZeRO-100B throughput for 100B model')} at 100B, "
                  f"{_paper('speedup over Megatron baseline')} Megatron's; without MP "
                  f"{_paper('max model without MP on 128 GPUs')} at {_paper('throughput without MP (average)')}",
         "instead": (f"a performance model calibrated on CPU runs, projected with published V100 numbers: {within} of "
                     f"{len(goals)} projected points within their goal" if goals else "nothing in results/")
         + "; CPU step times (bench_step, benchmarks, peers)",
         "why": "no V100 cluster, and no GPU measurement yet: a projection is not a measurement"},
        {"artifact": f"Fig 3: superlinear scaling (60B, {_paper('superlinear scaling range (60B model)')})",
         "paper": "doubling the GPUs more than doubles throughput",
         "instead": "; ".join(x for x in (
             f"the model projects {fig3['ours']} at 128 vs 64 GPUs (paper {fig3['paper']})" if fig3 else "",
             f"our scale: {ours_scale['ours']} ({ours_scale['error']})" if ours_scale else "") if x) or "nothing",
         "why": "the effect needs memory-bound batches on a cluster; at world 1-4 on CPU it does not appear"},
        {"artifact": "Fig 5 / Sec 10.6: Turing-NLG",
         "paper": f"{_paper('Turing-NLG size')}, perplexity {paper_values.headline('Turing-NLG perplexity (paper says Webtext-103)')['value']} "
                  f"after {_paper('Turing-NLG training length shown')}, {_paper('Turing-NLG sustained throughput')}",
         "instead": "nothing",
         "why": "training a 17B model for 300K iterations needs a GPU cluster for weeks, and its data"},
        {"artifact": "Table 2's measured columns, Fig 4's and Fig 6's model sizes",
         "paper": f"the largest models that trained: baseline {t2[1][0]}B-{t2[16][0]}B, Pos {t2[1][1]}B-{t2[16][1]}B "
                  f"(Table 2); {paper_values.NO_MP_B[2]}B without MP (Fig 4); C1-C5 {min(fig6.values())}B-"
                  f"{max(fig6.values())}B (Fig 6)",
         "instead": "a search of the largest model under a per-GPU accounting; no model of those sizes was built "
                    "with real memory" + (f"; at the measured fragmentation the search is {min(measured):+.0f}% to "
                                          f"{max(measured):+.0f}% off the paper" if measured else ""),
         "why": f"needs 32 GB GPUs by the hundred; the close match at {frag:.0%} fragmentation is a fit (next section)"},
        {"artifact": "Fig 7: cached memory per configuration (40B, 100B)",
         "paper": "an ordering (no numbers printed)",
         "instead": f"a CPU trace replayed through an allocator model: {fig7['ours']} ({fig7['error']})" if fig7
         else "nothing",
         "why": "the paper's numbers are only in the plot; measuring them needs the CUDA allocator at 40B-100B"},
        {"artifact": "Fig 8: throughput per configuration C1-C5",
         "paper": "no numbers printed", "instead": "performance-model projections (throughput)",
         "why": "as Figs 2-4"},
        {"artifact": "Sec 3.2 / 6.1: activation sizes",
         "paper": ", ".join(_paper(q) for q in ("GPT-2 1.5B activations at seq 1K batch 32 (no checkpointing)",
                                                "GPT-2 1.5B activations with activation checkpointing",
                                                "GPT-like 100B activations at batch 32 with checkpointing"))
         + f"; {_paper('100B model activation checkpoints per GPU at batch 32 seq 1024 MP 16 (one per layer)')} -> "
           f"{_paper('same with Pa')} with Pa",
         "instead": f"analysis: {len(activations) - len(missed)} of {len(activations)} numbers reproduced"
         if activations else "nothing",
         "why": ("not reproduced: " + "; ".join(missed) + " (the paper does not show its accounting)") if missed
         else "-"},
    ]
    if not triton:
        rows.append({"artifact": "Triton kernels timed", "paper": "(the project's fused optimizer step, not the paper's)",
                     "instead": "the torch twins only (kernels)", "why": "Triton needs CUDA"})
    if not gpu:
        rows.append({"artifact": "any GPU number (NCCL engine runs, CUDA memory, kernel timings)",
                     "paper": "V100 32 GB, NCCL", "instead": "none yet: every recorded run has no GPU",
                     "why": "no GPU was lent to the sessions that made these results "
                            "(experiments/gpu_check.sh is ready for one)"})
    return rows


def chosen_numbers(out: Path, sections) -> list[str]:
    """Markdown: every number a study chose or fitted instead of reading it from the paper, with
    its sensitivity where results/ holds one (read from the studies' files)."""
    lines = ["## Chosen and fitted numbers", "",
             "Numbers the paper does not give, which a study had to choose. The memory search's match with "
             f"Table 2's and Fig 4's measured sizes rests on them: the {_chosen_fragmentation():.0%} fragmentation "
             "share was chosen in the "
             "same change that made the comparison, so with twelve measured sizes it is in effect **one parameter "
             "fitted to twelve points** until fragmentation is measured on the GPUs the paper used. Each row: "
             "the search redone with that number changed and the others kept (memory/table2_sensitivity.csv).", ""]
    path = out / "memory" / "table2_sensitivity.csv"
    frame = pd.read_csv(path, keep_default_na=False) if path.exists() else None
    if frame is not None and "assumption" in frame:
        from experiments.memory_report import sensitivity_summary

        summary = sensitivity_summary(frame)
        lines += ["| chosen number | chosen value | mean / max abs error of the 12 measured sizes, by value "
                  "(chosen in bold) |", "|---|---|---|"]
        for name, at in summary.groupby("assumption", sort=False):
            chosen = at[at.chosen].value.iloc[0] if at.chosen.any() else "-"
            cells = ", ".join((f"**{r.value}: {r['mean abs error %']:.1f}% / {r['max abs error %']:.1f}%**" if r.chosen
                               else f"{r.value}: {r['mean abs error %']:.1f}% / {r['max abs error %']:.1f}%")
                              for _, r in at.iterrows())
            lines.append(f"| `{name}`: {at.what.iloc[0]} | {chosen} | {cells} |")
        lines.append("")
    else:
        lines += ["(No sensitivity table in results/memory: run the memory study.)", ""]
    searches = out / "fragmentation" / "searches.csv"
    if searches.exists():
        frag = pd.read_csv(searches)
        lines += [f"Fragmentation measured (fragmentation study: a CPU trace of our engine replayed through an "
                  f"allocator model, not a GPU): {frag.fragmentation.min():.1%} to {frag.fragmentation.max():.1%}; "
                  f"the search at the measured share errs {frag.error_pct.min():+.0f}% to {frag.error_pct.max():+.0f}% "
                  "against the paper ([fragmentation/REPORT.md](fragmentation/REPORT.md)).", ""]
    acts = out / "activations" / "activations.csv"
    if acts.exists():
        act = pd.read_csv(acts)
        act = act[act.kind == "model"]
        relative = act[~act.paper_unit.str.contains("at least")]
        counts = ", ".join(f"{int((relative.mismatch_pct.abs() <= t).sum() + len(act) - len(relative))} at {t:.0f}%"
                           for t in (5.0, 10.0, 15.0, 20.0))
        lines += [f"- activations: a paper number counts as reproduced within 10% (chosen: the paper prints one or two "
                  f"digits); reproduced of {len(act)} at each tolerance: {counts}.", ""]
    lines += ["Chosen but not varied in results/: the search's sequence length 1024 and vocabulary 50257 (the paper "
              "states seq 1024 only for Sec 6.1); the performance model's `dp_overlap` = 0 (reductions never hidden "
              "behind compute; the paper does not say) and its goals of 15% and 30% (the project's, not the "
              "paper's); the memory study's real-run allowances (gloo's in-flight copy, the optimizer's "
              "temporaries: properties of this implementation on CPU, listed in memory/REPORT.md).", ""]
    return lines


def _details(out: Path, folder: str) -> str:
    """The study's own report: REPORT.md, or README.md where a study writes that instead."""
    for name in ("REPORT.md", "README.md"):
        if (out / folder / name).exists():
            return f"{folder}/{name}"
    return f"{folder}/REPORT.md"


def _commits_since(revision: str) -> int | None:
    """Commits to the code (zero_ref/, experiments/, triton_kernels/) after ``revision`` up to HEAD."""
    revision = revision.split("+")[0]
    try:
        done = subprocess.run(["git", "rev-list", "--count", f"{revision}..HEAD", "--", "zero_ref", "experiments",
                               "triton_kernels"], cwd=ROOT, capture_output=True, text=True, check=True)
        return int(done.stdout.strip())
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None


def _present(folder: str, row: dict) -> dict:
    """Rows saved before the kernels' "error" column stopped holding a fraction of copy bandwidth
    (a measurement, not an error) are shown as the new rows are."""
    if folder == "kernels" and str(row["error"]).endswith("of copy bandwidth"):
        return row | {"ours": f"{row['ours']} = {row['error']}", "error": _NOT_AN_ERROR}
    return row


def write_report(out: Path, sections: list[tuple[str, str, dict]], meta: dict) -> Path:
    """results/REPORT.md: what is and is not reproduced, the chosen numbers, then one table per
    study with one row per paper claim."""
    hw = meta["hardware"]
    lines = ["# zero-ref against the ZeRO paper: model-state memory and communication volume reproduced at paper "
             "scale, throughput modelled" + ("" if _gpu_studies(out) else ", no GPU runs yet"), "",
             f"Generated by `{meta['command']}` (quick={meta['quick']}) at git `{meta['git_revision']}` on "
             f"{meta['date_utc']}, in {meta['seconds']:.0f} s on {hw['cores']} cores ({hw['cpu']}), "
             f"{hw.get('memory_gb')} GB, torch {hw['torch']}{', GPU ' + hw['gpu'] if 'gpu' in hw else ', no GPU'}.", "",
             "The paper (Rajbhandari et al., ZeRO, SC20) ran on up to 400 V100s; this machine has none. Every "
             "number below is obtained one of these ways: **analysis** (the paper's formulas, "
             "`zero_ref.memory_model`), **engine at scale** (our real `initialize()` for the paper's shapes on "
             "meta tensors as one rank of a fake process group of Nd ranks, bytes read from the engine and from "
             "torch's MemTracker), **search** (the largest model that fits, from the per-GPU accounting with "
             "the chosen allowances below), **real run** (gloo ranks on this CPU), **performance model** (a step's "
             "time by term, calibrated on real runs here and projected with the V100's published numbers). "
             "Each study's own report gives every cell. The paper's numbers, each with its source, are in "
             "[experiments/paper_data/](../experiments/paper_data/README.md).", "",
             "## Not reproduced yet", "",
             "| artifact | the paper | what results/ has instead | why |", "|---|---|---|---|"]
    for row in not_reproduced(out, sections):
        lines.append("| " + " | ".join(_cell(row[k]) for k in ("artifact", "paper", "instead", "why")) + " |")
    lines += [""] + chosen_numbers(out, sections)
    for folder, title, result in sections:
        earlier = result.get("earlier")
        note = ""
        if earlier:
            since = _commits_since(earlier["git_revision"])
            note = (f" From an earlier run (`{earlier['command']}` at git `{earlier['git_revision']}` on "
                    f"{earlier['date_utc']}), not rerun this time"
                    + (f"; the code has changed in {since} commit(s) since, so these rows may not describe this "
                       "revision." if since else "."))
        link = _details(out, folder)
        lines += [f"## {title}", "", f"Details: [{link}]({link}).{note}", "",
                  "| paper table / figure | paper | ours | error | how ours was obtained |", "|---|---|---|---|---|"]
        for row in result["headline"]:
            row = _present(folder, row)
            lines.append("| " + " | ".join(_cell(row[k]) for k in ("item", "paper", "ours", "error", "how")) + " |")
        lines.append("")
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> dict:
    """Run every study (``--quick``: the short version) and write ``--out``/REPORT.md."""
    parser = argparse.ArgumentParser(prog="zero-ref reproduce", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short version (about 5 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="results folder (default: results/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--only", choices=sorted(STUDIES), nargs="+", help="run only these studies (the others keep their last headline rows in REPORT.md, marked as such)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    sections = []
    names = args.only or [name for name in STUDIES if not (args.quick and name in FULL_ONLY)]
    ran = {}
    for folder in tqdm(names, desc="studies", disable=args.quiet, file=sys.stderr):
        title, runner = STUDIES[folder]
        ran[folder] = runner(args.out / folder, args.quick, args.quiet)
        record = {"headline": ran[folder]["headline"], **provenance()}
        (args.out / folder / "headline.json").write_text(json.dumps(record, indent=1) + "\n")
    for folder, (title, _) in STUDIES.items():   # studies not run now keep their last headline rows
        saved = args.out / folder / "headline.json"
        if folder in ran:
            sections.append((folder, title, ran[folder]))
        elif saved.exists():
            record = json.loads(saved.read_text())
            sections.append((folder, title, {"headline": record["headline"], "earlier": record}))
    meta = provenance() | {"quick": args.quick, "seconds": round(time.perf_counter() - start, 1), "studies": names}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    path = write_report(args.out, sections, meta)
    print(f"wrote {path} ({meta['seconds']:.0f} s)")
    return {"report": path, "sections": sections, "meta": meta}


if __name__ == "__main__":
    main()
