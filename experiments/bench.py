"""`zero-ref bench`: the scaling regression suite (benchmarks/) in one command, and the peers.

    zero-ref bench                      # S, M, L x Nd 1, 2, 4 x stages 0-3, gated against the baseline
    zero-ref bench --smoke              # seconds: one model, Nd 2, 3 rounds
    zero-ref bench --models M --worlds 2 4 --rounds 20
    zero-ref bench --save-baseline      # measure and store a new baseline (commit it)
    zero-ref bench --peers              # DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed, zero-ref side by side

It runs ``pytest benchmarks/ --benchmark-only`` with the storage in ``--out`` (default
results/benchmarks): the baseline is pytest-benchmark's saved run named "baseline" there, so
``--benchmark-compare`` prints the two runs side by side, and every benchmark is gated against it
(``experiments.bench_scaling.gate``: the time ratio to DDP beyond both runs' noise, bytes and
elements exactly). The run's JSON is ``run.json``; ``REPORT.md`` puts it beside the baseline.
The exit status is pytest's: non-zero when a gate failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from experiments.bench_scaling import THRESHOLD
from experiments.markdown import table
from experiments.provenance import ROOT, provenance


def baseline_file(out: Path) -> Path | None:
    """The newest saved baseline under `out` (any machine's folder), or None."""
    found = sorted(out.glob("*/*_baseline.json"), key=lambda p: p.name)
    return found[-1] if found else None


def pytest_args(args, out: Path) -> list[str]:
    """The pytest command line for these options."""
    cmd = [str(ROOT / "benchmarks"), "--benchmark-only", "-q", "-p", "no:cacheprovider",
           f"--benchmark-storage=file://{out}", f"--benchmark-json={out / 'run.json'}",
           f"--gate-threshold={args.threshold}", "--benchmark-columns=min,median,max,rounds"]
    for flag in ("models", "worlds", "stages", "checks"):
        if getattr(args, flag):
            cmd += [f"--bench-{flag}", *map(str, getattr(args, flag))]
    for flag in ("rounds", "warmup"):
        if getattr(args, flag) is not None:
            cmd.append(f"--bench-{flag}={getattr(args, flag)}")
    if args.smoke:
        cmd.append("--bench-smoke")
    baseline = baseline_file(out)
    if args.save_baseline:
        cmd += ["--benchmark-save=baseline", "--gate-baseline=none"]
    elif baseline is not None:
        cmd += [f"--gate-baseline={baseline}", f"--benchmark-compare={baseline.name.split('_')[0]}"]
    return cmd


def report(out: Path, run: Path, baseline: Path | None, threshold: float, saved_as: Path | None = None) -> Path:
    """REPORT.md: each benchmark's ratio to DDP, bytes and elements beside the baseline's, with the
    gate's verdict recomputed from the two JSON files (`saved_as`: this run is the new baseline)."""
    from experiments.bench_scaling import gate

    current = json.loads(run.read_text())
    base = {b["name"]: b["extra_info"] for b in json.loads(baseline.read_text())["benchmarks"]} if baseline else {}
    rows = []
    for b in current["benchmarks"]:
        info, ref = b["extra_info"], base.get(b["name"])
        ratio = info["ratio_to_ddp"]
        failures = gate(ref, info, threshold) if ref else None
        rows.append({
            "model": info["model"], "Ψ": f"{info['psi']:,}", "Nd": info["world_size"], "stage": info["stage"],
            "checks": info.get("checks", "strict"),
            "step (ms)": f"{info['step_s']['median'] * 1e3:.0f}", "DDP (ms)": f"{info['ddp_step_s']['median'] * 1e3:.0f}",
            "ratio to DDP [95% CI]": f"{ratio['median']:.3f} [{ratio['ci_low']:.3f}, {ratio['ci_high']:.3f}]",
            "baseline ratio [95% CI]": (f"{ref['ratio_to_ddp']['median']:.3f} [{ref['ratio_to_ddp']['ci_low']:.3f}, "
                                        f"{ref['ratio_to_ddp']['ci_high']:.3f}]") if ref else "-",
            "bytes/rank": f"{info['bytes_per_rank']['total']:,}",
            "formula bytes": f"{info['formula_bytes_per_rank']['total']:,.0f}",
            "elements/Ψ": f"{info['elements_over_psi']:.4f}", "formula": f"{info['formula_elements_over_psi']:.0f}",
            "gate": "saved as the baseline" if saved_as else "no baseline" if failures is None else ("pass" if not failures else "FAIL: " + "; ".join(failures)),
        })
    meta = current.get("commit_info", {})
    lines = ["# The scaling regression suite", "",
             f"`{provenance()['command']}` at git `{meta.get('id', '?')}` ({meta.get('time', '?')}), "
             f"machine {current['machine_info'].get('node', '?')}, {current['machine_info'].get('cpu', {}).get('brand_raw', '?')}; "
             + (f"this run is the new baseline: `{_shown(saved_as)}`." if saved_as else f"baseline: `{_shown(baseline)}`."), "",
             "Each row: a stage's training step against DDP + AdamW(foreach) in the same ranks, in paired rounds "
             "(alternating order); the ratio is the median over rounds of the per-round ratio, with a "
             "distribution-free 95% interval of that median. fp32 throughout; bytes per rank are params + grads + "
             "optimizer states + buffers + the constant-size buckets (CB), the formula counts the first three "
             "(16 B/Ψ at stage 0: 4 + 4 + 8). Elements are counted below the engine (CountCollectives), per rank "
             "per step, the paper's way (the formula is 2Ψ for stages 0-2, 3Ψ for stage 3; at Nd = 1 nothing is issued: over one rank the engine's collectives are local copies, so 0 is counted).", "",
             f"Gate: fails when the interval's lower end lies above the baseline's upper end x {1 + threshold:.2f}, "
             "or when bytes or elements changed at all; stage 3's buckets on gloo (CB and so the total) are the "
             "exception: its reducer never blocks during backward and reuses a bucket once its reduction is done, "
             "so how many exist at once depends on timing; they are reported, not gated.", "",
             table(pd.DataFrame(rows)), ""]
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def _shown(path: Path | None) -> str:
    return str(path.relative_to(ROOT) if path and path.is_relative_to(ROOT) else path)


def run_study(out: Path, quick: bool, quiet: bool) -> dict:
    """`zero-ref reproduce`'s entry: the full suite gated against the committed baseline; one
    headline row per stage (ratios to DDP at each Nd for GPT-2 M) and one for the gate."""
    code = main(["--out", str(out)] + (["--smoke"] if quick else []))
    runs = [b["extra_info"] for b in json.loads((out / "run.json").read_text())["benchmarks"]]
    headline = []
    for stage, checks in sorted({(r["stage"], r.get("checks", "strict")) for r in runs}):
        same = [r for r in runs if r["stage"] == stage and r.get("checks", "strict") == checks]
        mine = sorted((r for r in same if r["model"] == "M"), key=lambda r: r["world_size"])
        if not mine:
            continue
        multi = [r for r in same if r["world_size"] > 1]
        headline.append({
            "item": f"stage {stage}, checks={checks}: step time vs DDP (GPT-2 M, fp32), "
                    f"Nd = {', '.join(str(r['world_size']) for r in mine)}",
            "paper": f"{'3' if stage == 3 else '2'}Ψ moved per step (Sec 7); no step time given",
            "ours": ", ".join(f"{r['ratio_to_ddp']['median']:.2f}x" for r in mine)
                    + (f"; elements/Ψ {min(r['elements_over_psi'] for r in multi):.4f}-"
                       f"{max(r['elements_over_psi'] for r in multi):.4f} at Nd > 1" if multi else ""),
            "error": "elements: the formula plus padding and the step statistics (grad norm, non-finite flag, which parameters got gradients)",
            "how": "real run (pytest-benchmark, paired rounds)"})
    gates = [r.get("gate") for r in runs]
    headline.append({"item": "regression gate against the committed baseline",
                     "paper": "(not in the paper)",
                     "ours": f"{len(runs)} benchmarks, pytest exit status {code}" + (" (all pass)" if code == 0 else " (a gate failed)"),
                     "error": f"{gates.count('checked')} gated, {gates.count('no baseline')} without a baseline entry",
                     "how": "real run"})
    return {"headline": headline, "meta": {"exit_status": code}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zero-ref bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=["S", "M", "L"], help="GPT-2 sizes (default: S M L)")
    parser.add_argument("--worlds", nargs="+", type=int, help="world sizes (default: 1 2 4)")
    parser.add_argument("--stages", nargs="+", type=int, choices=[0, 1, 2, 3], help="stages (default: 0-3)")
    parser.add_argument("--checks", nargs="+", choices=["strict", "off"],
                        help="ZeroConfig.checks settings per stage (default: strict and off)")
    parser.add_argument("--rounds", type=int, help="timed rounds per benchmark (default 12)")
    parser.add_argument("--warmup", type=int, help="untimed rounds first (default 2)")
    parser.add_argument("--smoke", action="store_true", help="a check in seconds: S, Nd 2, 3 rounds")
    parser.add_argument("--threshold", type=float, default=THRESHOLD,
                        help=f"allowed regression of the time ratio beyond the noise (default {THRESHOLD})")
    parser.add_argument("--save-baseline", action="store_true", help="store this run as the new baseline")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks",
                        help="where the run (run.json), its REPORT.md and the saved baselines live "
                             "(default: results/benchmarks/)")
    parser.add_argument("--peers", action="store_true",
                        help="run the peers side by side instead (options after `--` go to experiments.peers)")
    args, rest = parser.parse_known_args(argv)
    if args.peers:
        from experiments.peers import main as peers

        peers([a for a in rest if a != "--"])
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.worlds and min(args.worlds) < 1:
        parser.error(f"--worlds must be positive, got {args.worlds}")
    import pytest

    args.out.mkdir(parents=True, exist_ok=True)
    baseline = None if args.save_baseline else baseline_file(args.out)
    code = int(pytest.main(pytest_args(args, args.out)))
    run = args.out / "run.json"
    if run.exists():
        (args.out / "meta.json").write_text(json.dumps(provenance() | {"exit_status": code}, indent=2) + "\n")
        saved_as = baseline_file(args.out) if args.save_baseline else None
        print(f"wrote {report(args.out, run, baseline, args.threshold, saved_as)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
