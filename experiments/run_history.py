"""Every timed run kept: a timed study's tables gain one row set per run, never a replacement.

A timed study (``experiments.studies.TIMED``) writes its tables for the run just made, as before;
its report step then calls ``keep``, which appends those rows to ``<out>/history/<table>`` under
the run's id (``run_id``: the run's date and revision, from its meta.json), once per run. So a
better run never hides a worse one: the report shows this run's numbers beside ``spread``, the
median and range of every run kept, and how many there are. ``python -m experiments.run_history``
adds the runs committed to git before history was kept (``from_git``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def run_id(meta: dict) -> str:
    """``<date>@<revision>``: the run's UTC date (from meta.json's ``date_utc`` or ``date``) and the
    first 10 characters of its revision (``+dirty`` kept)."""
    date = meta.get("date_utc") or meta.get("date")
    revision = meta.get("git_revision", "unknown")
    if date is None:
        raise ValueError("meta.json has no 'date_utc' or 'date': the run cannot be told apart from others")
    short = revision[:10] + ("+dirty" if revision.endswith("+dirty") else "")
    return f"{date}@{short}"


def keep(out: Path, table: str, meta: dict | None = None) -> pd.DataFrame:
    """Add ``out/table``'s rows (the run ``out/meta.json`` or ``meta`` describes) to
    ``out/history/table`` with its run id, unless that run is there already; return every run kept."""
    meta = meta if meta is not None else json.loads((out / "meta.json").read_text())
    keep_frame(out, table, pd.read_csv(out / table), meta)
    return pd.read_csv(out / "history" / table)


def spread(history: pd.DataFrame, by: list[str], value: str) -> pd.DataFrame:
    """Per group of ``by``: ``runs`` (how many runs measured it), and the ``median``, ``low`` and
    ``high`` of ``value`` across those runs (a run that measured a group twice counts its median)."""
    per_run = history.groupby([*by, "run_id"], dropna=False)[value].median().reset_index()
    grouped = per_run.groupby(by, dropna=False, sort=False)[value]
    return pd.DataFrame({"runs": grouped.count(), "median": grouped.median(), "low": grouped.min(),
                         "high": grouped.max()}).reset_index()


def described(row, spec: str = ".3f") -> str:
    """A spread row as text, its numbers in format ``spec``: "1.031 (1.010-1.052, 3 runs)", or
    "1.031 (1 run)"."""
    if row["runs"] <= 1:
        return f"{row['median']:{spec}} (1 run)"
    return f"{row['median']:{spec}} ({row['low']:{spec}}-{row['high']:{spec}}, {int(row['runs'])} runs)"


def keep_frame(out: Path, table: str, frame: pd.DataFrame, meta: dict) -> bool:
    """Add ``frame`` (one run's rows of ``table``, the run ``meta`` describes) to
    ``out/history/table`` unless that run is there already; True when it was added."""
    path = out / "history" / table
    history = pd.read_csv(path) if path.exists() else None
    run = run_id(meta)
    if history is not None and run in set(history.run_id):
        return False
    rows = frame.assign(run_id=run)
    path.parent.mkdir(parents=True, exist_ok=True)
    (rows if history is None else pd.concat([history, rows], ignore_index=True)).to_csv(path, index=False)
    return True


def from_git(out: Path, table: str, root: Path) -> list[str]:
    """Every version of ``out/table`` committed to git in ``root`` (with the meta.json committed
    beside it), added to history/ as the run it was: the runs made before history was kept, which
    later runs replaced in the tables. Returns the run ids added."""
    import io
    import subprocess

    folder = out.resolve().relative_to(root.resolve()).as_posix()
    git = lambda *args: subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)  # noqa: E731
    added = []
    for revision in git("log", "--format=%H", "--", f"{folder}/{table}").stdout.split():
        text, meta = git("show", f"{revision}:{folder}/{table}"), git("show", f"{revision}:{folder}/meta.json")
        if text.returncode or meta.returncode:
            continue
        meta = json.loads(meta.stdout)
        if keep_frame(out, table, pd.read_csv(io.StringIO(text.stdout)), meta):
            added.append(run_id(meta))
    return added


TABLES = {"throughput": ("validation.csv", "superlinear.csv"), "peers": ("peers.csv",), "kernels": ("bench.csv",),
          "bench_step": ("bench_step.csv",), "bench_step/bf16": ("bench_step.csv",)}
"""The timed tables whose earlier versions in git ``main`` adds to history/ (benchmarks keeps its
earlier runs as pytest-benchmark's saved runs, results/benchmarks/*/NNNN_*.json)."""


def main(argv: list[str] | None = None) -> None:
    """``python -m experiments.run_history``: add the runs committed before history was kept."""
    import argparse

    from experiments.provenance import ROOT

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    args = parser.parse_args(argv)
    for folder, tables in TABLES.items():
        for table in tables:
            if (args.results / folder / table).exists():
                added = from_git(args.results / folder, table, ROOT)
                print(f"{folder}/{table}: {len(added)} earlier run(s) added" + (f": {', '.join(added)}" if added else ""))


if __name__ == "__main__":
    main()
