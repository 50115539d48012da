"""Every timed run kept: a timed study's tables gain one row set per run, never a replacement.

A timed study (``experiments.studies.TIMED``) writes its tables for the run just made, as before;
its report step then calls ``keep``, which appends those rows to ``<out>/history/<table>`` under
the run's id (``run_id``: the run's date and revision, from its meta.json), once per run. So a
better run never hides a worse one: the report shows this run's numbers beside ``spread``, the
median and range of every run kept, and how many there are.
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
    this = pd.read_csv(out / table).assign(run_id=run_id(meta))
    path = out / "history" / table
    if path.exists():
        history = pd.read_csv(path)
        if this.run_id.iloc[0] in set(history.run_id):
            return history
        history = pd.concat([history, this], ignore_index=True)
    else:
        history = this
    path.parent.mkdir(parents=True, exist_ok=True)
    history.to_csv(path, index=False)
    return history


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
