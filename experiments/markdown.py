"""Markdown tables for the studies' REPORT.md files, without extra dependencies (pandas'
``to_markdown`` needs tabulate)."""

from __future__ import annotations

import pandas as pd


def table(frame: pd.DataFrame, cell=str, index: bool = False) -> str:
    """``frame`` as a markdown table, each value written by ``cell``; ``index``: the index first,
    headed by its name."""
    header = ([frame.index.name or ""] if index else []) + [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, row in zip(frame.index, frame.itertuples(index=False)):
        cells = ([str(label)] if index else []) + [cell(v) for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
