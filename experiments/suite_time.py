"""How long the test suite takes here: the README quotes it from the file this script writes.

Runs the README's test command (``python -m pytest -q -n 2``) and the fast tier (``-m "not slow"``) one
after the other in fresh processes, and writes ``results/suite/suite_time.csv`` (tier, seconds,
outcome line, exit status, failed tests) with ``meta.json`` (command, revision, machine and its CPU's
instruction sets, date). Run it on a quiet machine, alone; it takes as long as the two runs.

    python -m experiments.suite_time              # both tiers
    python -m experiments.suite_time --tiers fast # the fast tier only (the other row is kept)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from experiments.provenance import ROOT, provenance
from experiments.study_key import cpu_speed

TIERS = {"all": ["-n", "2"], "fast": ["-m", "not slow", "-n", "2"]}
"""tier -> pytest arguments beyond ``-q``."""


def time_tier(tier: str) -> dict:
    """Run one tier of the suite in ``ROOT``; its wall time, the summary line, the exit status and
    the tests that failed, if any (their ids, as pytest's short summary names them)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TIERS[tier]], cwd=ROOT,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if " in " in line and ("passed" in line or "failed" in line)]
    failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in done.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    return {"tier": tier, "seconds": round(seconds, 1), "outcome": lines[-1].strip("= ") if lines else "no summary",
            "exit_status": done.returncode, "failed": "; ".join(failed)}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiers", nargs="+", choices=sorted(TIERS), default=list(TIERS))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "suite")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "suite_time.csv"
    kept = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=["tier"])
    # the revision the suite ran at, taken before it runs, and the CPU's instruction sets (its time
    # depends on them as much as on the core count: torch's CPU kernels use AVX-512 where it exists)
    made = provenance() | cpu_speed()
    rows = [time_tier(tier) for tier in args.tiers]
    table = pd.concat([kept[~kept.tier.isin(args.tiers)], pd.DataFrame(rows)], ignore_index=True)
    table.to_csv(path, index=False)
    (args.out / "meta.json").write_text(json.dumps(made | {"tiers": args.tiers}, indent=2) + "\n")
    print(table.to_string(index=False))
    if any(row["exit_status"] for row in rows):
        sys.exit("the suite failed: " + "; ".join(f"{row['tier']}: {row['outcome']} ({row['failed']})"
                                                  for row in rows if row["exit_status"]))
    return table


if __name__ == "__main__":
    main()
