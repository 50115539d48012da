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
elements exactly). The run's JSON is ``run.json``; experiments/bench_report.py draws REPORT.md
from it, beside the baseline and every earlier run (history/bench.csv).
The exit status is pytest's: non-zero when a gate failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.bench_report import render
from experiments.bench_scaling import THRESHOLD
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


def run_study(out: Path, quick: bool, quiet: bool) -> dict:
    """`zero-ref reproduce`'s entry: the full suite (``quick``: the smoke run) gated against the
    committed baseline; bench_report.render gives the headline rows."""
    code = main(["--out", str(out)] + (["--smoke"] if quick else []))
    return {"meta": {"exit_status": code}}


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
    parser.epilog = "zero-ref bench --peers [-- OPTIONS]: the peers side by side instead (zero-ref bench --peers -- --help)"
    args = parser.parse_args(argv)
    if args.worlds and min(args.worlds) < 1:
        parser.error(f"--worlds must be positive, got {args.worlds}")
    import pytest

    args.out.mkdir(parents=True, exist_ok=True)
    baseline = None if args.save_baseline else baseline_file(args.out)
    code = int(pytest.main(pytest_args(args, args.out)))
    run = args.out / "run.json"
    if run.exists():
        saved_as = baseline_file(args.out) if args.save_baseline else None
        shown = lambda path: str(path.relative_to(args.out)) if path else None  # noqa: E731
        (args.out / "meta.json").write_text(json.dumps(provenance() | {
            "exit_status": code, "threshold": args.threshold, "baseline": shown(baseline),
            "saved_as": shown(saved_as)}, indent=2) + "\n")
        render(args.out)
        print(f"wrote {args.out / 'REPORT.md'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
