"""Where a result came from: the command, the git revision, the machine and the date.

Every study writes ``meta.json`` beside its CSVs with ``provenance(argv)``, so a number under
``results/`` can always be traced to the code and the hardware that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_revision() -> str:
    """HEAD's commit, with "+dirty" when the working tree has changes outside results/ (which the
    studies are writing as they run); $ZERO_REF_REVISION where set (a copied tree whose .git is
    not the one the code came from, as on a lent GPU machine: experiments/gpu_check.sh)."""
    if os.environ.get("ZERO_REF_REVISION"):
        return os.environ["ZERO_REF_REVISION"]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ".", ":(exclude)results"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def hardware() -> dict:
    """CPU, core count, memory, and the GPU if there is one."""
    import torch

    info = {"machine": platform.machine(), "cpu": _cpu_name(), "cores": os.cpu_count(),
            "memory_gb": _memory_gb(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def command_line() -> str:
    """The command this process was started with, as a user would type it."""
    original = getattr(sys, "orig_argv", [])
    if "-m" in original[1:-1]:   # python -m package.module args: sys.argv[0] is the module's file
        at = original.index("-m", 1)
        return " ".join(["python -m", *original[at + 1:]])
    program = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("python")
    if program.suffix == ".py":
        try:
            shown = f"python {program.resolve().relative_to(ROOT)}"
        except ValueError:
            shown = f"python {program}"
    else:
        shown = program.name
    return " ".join([shown, *sys.argv[1:]])


def provenance() -> dict:
    """The record written to meta.json: command, git revision, hardware, date."""
    return {"command": command_line(), "git_revision": git_revision(), "hardware": hardware(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    return None


def study_main(run_study, folder: str, description: str, quick_help: str, argv: list[str] | None = None) -> dict:
    """The command line every study shares: ``--quick`` (``quick_help`` says what it drops),
    ``--out`` (default ``results/<folder>``) and ``--quiet``; runs ``run_study(out, quick, quiet)``."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / folder)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    result = run_study(args.out, args.quick, args.quiet)
    print(f"wrote {args.out}/REPORT.md")
    return result
