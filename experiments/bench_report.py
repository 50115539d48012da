"""The scaling regression suite's report step (experiments/bench.py runs it): REPORT.md, the run's
table bench.csv and every run kept in history/bench.csv, drawn from the run's JSON (``run.json``)
and the baseline it was gated against; the headline rows of `zero-ref reproduce`.

    zero-ref reproduce --redraw benchmarks   # draw again from the tables, measuring nothing
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from experiments.markdown import table
from experiments.run_history import described, keep, spread

KEYS = ["model", "world_size", "stage", "checks"]
"""What names one benchmark of the suite across runs."""


def flat(run: dict) -> pd.DataFrame:
    """One row per benchmark of a pytest-benchmark JSON: its names (``KEYS``), step times, ratio to
    DDP with its interval, bytes and elements beside the formulas."""
    rows = []
    for b in run["benchmarks"]:
        info = b["extra_info"]
        ratio = info["ratio_to_ddp"]
        rows.append({"name": b["name"], "model": info["model"], "psi": info["psi"], "world_size": info["world_size"],
                     "stage": info["stage"], "checks": info.get("checks", "strict"),
                     "step_ms": info["step_s"]["median"] * 1e3, "ddp_ms": info["ddp_step_s"]["median"] * 1e3,
                     "ratio_to_ddp": ratio["median"], "ci_low": ratio["ci_low"], "ci_high": ratio["ci_high"],
                     "bytes_per_rank": info["bytes_per_rank"]["total"],
                     "formula_bytes_per_rank": info["formula_bytes_per_rank"]["total"],
                     "elements_over_psi": info["elements_over_psi"],
                     "formula_elements_over_psi": info["formula_elements_over_psi"]})
    return pd.DataFrame(rows)


def report(out: Path, run: dict, meta: dict, history: pd.DataFrame) -> str:
    """REPORT.md: each benchmark's ratio to DDP, bytes and elements beside the baseline's, with the
    gate's verdict recomputed from the two JSON files, and its ratio across every run kept."""
    from experiments.bench_scaling import gate

    baseline, saved_as = meta.get("baseline"), meta.get("saved_as")
    base = ({b["name"]: b["extra_info"] for b in json.loads((out / baseline).read_text())["benchmarks"]}
            if baseline and not saved_as else {})
    across = {tuple(r[k] for k in KEYS): described(r) for _, r in history.iterrows()}
    rows = []
    for b in run["benchmarks"]:
        info, ref = b["extra_info"], base.get(b["name"])
        ratio = info["ratio_to_ddp"]
        failures = gate(ref, info, meta["threshold"]) if ref else None
        rows.append({
            "model": info["model"], "Ψ": f"{info['psi']:,}", "Nd": info["world_size"], "stage": info["stage"],
            "checks": info.get("checks", "strict"),
            "step (ms)": f"{info['step_s']['median'] * 1e3:.0f}", "DDP (ms)": f"{info['ddp_step_s']['median'] * 1e3:.0f}",
            "ratio to DDP [95% CI]": f"{ratio['median']:.3f} [{ratio['ci_low']:.3f}, {ratio['ci_high']:.3f}]",
            "baseline ratio [95% CI]": (f"{ref['ratio_to_ddp']['median']:.3f} [{ref['ratio_to_ddp']['ci_low']:.3f}, "
                                        f"{ref['ratio_to_ddp']['ci_high']:.3f}]") if ref else "-",
            "ratio across runs": across[(info["model"], info["world_size"], info["stage"], info.get("checks", "strict"))],
            "bytes/rank": f"{info['bytes_per_rank']['total']:,}",
            "formula bytes": f"{info['formula_bytes_per_rank']['total']:,.0f}",
            "elements/Ψ": f"{info['elements_over_psi']:.4f}", "formula": f"{info['formula_elements_over_psi']:.0f}",
            "gate": "saved as the baseline" if saved_as else "no baseline" if failures is None else (
                "pass" if not failures else "FAIL: " + "; ".join(failures)),
        })
    commit = run.get("commit_info", {})
    lines = ["# The scaling regression suite", "",
             f"`{meta['command']}` at git `{commit.get('id', '?')}` ({commit.get('time', '?')}), "
             f"machine {run['machine_info'].get('node', '?')}, {run['machine_info'].get('cpu', {}).get('brand_raw', '?')}; "
             + (f"this run is the new baseline: `{saved_as}`." if saved_as else f"baseline: `{baseline}`." if baseline else "no baseline: nothing gated."), "",
             "Each row: a stage's training step against DDP + AdamW(foreach) in the same ranks, in paired rounds "
             "(alternating order); the ratio is the median over rounds of the per-round ratio, with a "
             "distribution-free 95% interval of that median. fp32 throughout; bytes per rank are params + grads + "
             "optimizer states + buffers + the constant-size buckets (CB), the formula counts the first three "
             "(16 B/Ψ at stage 0: 4 + 4 + 8). Elements are counted below the engine (CountCollectives), per rank "
             "per step, the paper's way (the formula is 2Ψ for stages 0-2, 3Ψ for stage 3; at Nd = 1 nothing is "
             "issued: over one rank the engine's collectives are local copies, so 0 is counted). Ratio across "
             "runs: the median over every run kept in `history/bench.csv` (by `run_id`), lowest-highest, how many "
             "runs; no run replaces another.", "",
             f"Gate: fails when the interval's lower end lies above the baseline's upper end x {1 + meta['threshold']:.2f}, "
             "or when bytes or elements changed at all; stage 3's buckets on gloo (CB and so the total) are the "
             "exception: its reducer never blocks during backward and reuses a bucket once its reduction is done, "
             "so how many exist at once depends on timing; they are reported, not gated.", "",
             table(pd.DataFrame(rows)), ""]
    return "\n".join(lines)


def headline(runs: list[dict], code: int) -> list[dict]:
    """One row per (stage, checks) with GPT-2 M's ratios to DDP at each Nd, and one for the gate."""
    rows = []
    for stage, checks in sorted({(r["stage"], r.get("checks", "strict")) for r in runs}):
        same = [r for r in runs if r["stage"] == stage and r.get("checks", "strict") == checks]
        mine = sorted((r for r in same if r["model"] == "M"), key=lambda r: r["world_size"])
        if not mine:
            continue
        multi = [r for r in same if r["world_size"] > 1]
        rows.append({
            "item": f"stage {stage}, checks={checks}: step time vs DDP (GPT-2 M, fp32), "
                    f"Nd = {', '.join(str(r['world_size']) for r in mine)}",
            "paper": f"{'3' if stage == 3 else '2'}Ψ moved per step (Sec 7); no step time given",
            "ours": ", ".join(f"{r['ratio_to_ddp']['median']:.2f}x" for r in mine)
                    + (f"; elements/Ψ {min(r['elements_over_psi'] for r in multi):.4f}-"
                       f"{max(r['elements_over_psi'] for r in multi):.4f} at Nd > 1" if multi else ""),
            "error": "elements: the formula plus padding and the step statistics (grad norm, non-finite flag, which "
                     "parameters got gradients)",
            "how": "real run (pytest-benchmark, paired rounds)"})
    gates = [r.get("gate") for r in runs]
    rows.append({"item": "regression gate against the committed baseline", "paper": "(not in the paper)",
                 "ours": f"{len(runs)} benchmarks, pytest exit status {code}" + (" (all pass)" if code == 0 else " (a gate failed)"),
                 "error": f"{gates.count('checked')} gated, {gates.count('no baseline')} without a baseline entry",
                 "how": "real run"})
    return rows


def render(out: Path) -> list[dict]:
    """The report step: bench.csv and history/bench.csv from ``out``/run.json, REPORT.md; the headline rows."""
    meta = json.loads((out / "meta.json").read_text())
    run = json.loads((out / "run.json").read_text())
    flat(run).to_csv(out / "bench.csv", index=False)
    history = spread(keep(out, "bench.csv", meta), KEYS, "ratio_to_ddp")
    (out / "REPORT.md").write_text(report(out, run, meta, history))
    return headline([b["extra_info"] for b in run["benchmarks"]], meta["exit_status"])
