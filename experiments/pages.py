"""The pages that quote measured numbers, rendered from results/ so that none is ever typed.

Each such page (README.md, docs/*.md) has a template in ``experiments/pages/`` at the page's own
path (``experiments/pages/docs/stage3.md`` renders ``docs/stage3.md``): Jinja2, where a number is a
name filled by ``values(results)`` from the results files, e.g. ``{{ wt.stage[3].model_states | n }}``
(``n``: thousands separators). results/REPORT.md is written by `experiments.reproduce_report` from
the studies' headline rows and keys. `zero-ref reproduce` renders them all when it ends; after an
edit of a template, or of code a study imports (REPORT.md then marks the study stale), run

    python -m experiments.pages            # render every page
    python -m experiments.pages --check    # list the committed pages that differ from their render

tests/test_pages.py runs the check: a committed page that is not its render fails the suite.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jinja2
import pandas as pd

from experiments.provenance import ROOT
from experiments.reproduce_report import report_text, write_report
from experiments.studies import STUDIES, current_keys, report_sections

TEMPLATES = ROOT / "experiments" / "pages"
"""The templates, one per rendered page, at the page's path relative to the project root."""

BANNER = "<!-- rendered from experiments/pages/{path} by `python -m experiments.pages`: edit that template -->\n"


def _walkthrough(results: Path) -> dict:
    """The traced step (results/walkthrough): Ψ, and per stage rank 0's bytes and elements after it."""
    summary = pd.read_csv(results / "walkthrough" / "summary.csv")
    meta = json.loads((results / "walkthrough" / "meta.json").read_text())
    psi, stages = int(meta["psi"]), {}
    for stage, rows in summary[summary["rank"] == 0].groupby("stage"):
        last = rows.iloc[-1]
        extra = int(last.elements_moved - last.paper_elements)
        stages[int(stage)] = {"model_states": int(last.model_states), "comm_buffers": int(last.comm_buffers),
                              "cb_elements": int(last.comm_buffers) // 2 // 2,   # two bf16 buffers
                              "elements": int(last.elements_moved), "extra": extra, "statistics": extra // 2,
                              "per_psi": f"{last.elements_moved / psi:.4f}"}
    unit = pd.read_csv(results / "walkthrough" / "timeline_stage3.csv")
    gathers = unit[(unit["rank"] == 0) & (unit.what == "gather unit")]
    return {"psi": psi, "world": meta["world"], "dtype": meta["dtype"], "stage": stages,
            "unit_bytes": int(gathers.bytes.max()), "unit_elements": int(gathers.elements.max())}


def _zero_r(results: Path) -> dict:
    """ZeRO-R's real runs (results/zero_r): checkpoint bytes by mode and MP, Pa's traffic, CB."""
    checkpoints = pd.read_csv(results / "zero_r" / "checkpoint_bytes.csv")
    rank0 = checkpoints[checkpoints["rank"] == 0]
    device = {(int(r.mp), r["mode"]): int(r.device_bytes) for _, r in rank0.iterrows()}
    host = {(int(r.mp), r["mode"]): int(r.host_bytes) for _, r in rank0.iterrows()}
    traffic = pd.read_csv(results / "zero_r" / "comm_per_block.csv")
    pa = traffic[traffic["mode"] == "pa"].set_index("early_stop")
    cb = pd.read_csv(results / "zero_r" / "cb.csv")
    by_scheme = {scheme: rows.sort_values("psi") for scheme, rows in cb.groupby("scheme")}
    return {"plain": device[(2, "plain")], "pa": {mp: device[(mp, "pa")] for mp in (2, 4)},
            "pa_cpu_device": device[(2, "pa_cpu")], "pa_cpu_host": host[(2, "pa_cpu")],
            "ratio": int(round(pa.loc[False, "all_reduce"] / pa.loc[False, "all_gather"])),
            "ratio_early_stop": int(round(pa.loc[True, "all_reduce"] / pa.loc[True, "all_gather"])),
            "psi": [int(p) for p in by_scheme["CB"].psi], "cb_bytes": [int(b) for b in by_scheme["CB"].comm_buffer_bytes],
            "cb_elements": int(by_scheme["CB"].bucket_numel.iloc[0]),
            "flat_bytes": [int(b) for b in by_scheme["flatten everything"].comm_buffer_bytes]}


def _times(results: Path) -> dict:
    """How long the two README commands take: a first run of every study (the sum of each study's
    last time, from its headline.json), the reproduce run that ran the most studies
    (results/runs.jsonl, every run of reproduce) and the suite (results/suite, written by
    experiments/suite_time.py)."""
    log = results / "runs.jsonl"
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    full = [run for run in runs if not run.get("quick", True)]
    largest = max(full, key=lambda run: (len(run["studies"]), run["date_utc"])) if full else None
    suite = results / "suite" / "suite_time.csv"
    tiers = pd.read_csv(suite).set_index("tier").seconds.to_dict() if suite.exists() else {}
    def minutes(seconds: float | None) -> str:
        if seconds is None:
            return "time not yet measured"
        whole = max(1, round(seconds / 60))
        return f"about {whole} minute{'s' if whole != 1 else ''}"

    reproduce = minutes(None)
    if largest:
        count = len(largest["studies"])
        reproduce = (minutes(largest["seconds"]) + f" for {count} studies"
                     + (f" (of the {len(STUDIES)} there are now)" if count < len(STUDIES) else "")
                     + f" as `{largest['command']}`")
    seconds = {name: json.loads((results / name / "headline.json").read_text()).get("seconds")
               for name in STUDIES if (results / name / "headline.json").exists()}
    timed = [s for s in seconds.values() if s is not None]
    first_run = (minutes(sum(timed)) + ", the sum of each study's last time"
                 + ("" if len(timed) == len(STUDIES) else f" ({len(timed)} of {len(STUDIES)} studies timed so far)"))
    return {"reproduce": reproduce, "suite": minutes(tiers.get("all")), "fast": minutes(tiers.get("fast")),
            "first_run": first_run}


def values(results: Path) -> dict:
    """Every name a template may use, read from ``results``."""
    return {"wt": _walkthrough(results), "zr": _zero_r(results), "times": _times(results)}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["n"] = lambda value: f"{value:,}"
    return env


def templates() -> list[str]:
    """Every template, as the path of the page it renders."""
    return sorted(p.relative_to(TEMPLATES).as_posix() for p in TEMPLATES.rglob("*.md"))


def rendered(results: Path) -> dict[str, str]:
    """``{page path: text}`` of every templated page, rendered from ``results``."""
    env, names = _environment(), values(results)
    return {path: BANNER.format(path=path) + env.get_template(path).render(**names) for path in templates()}


def render_pages(results: Path, root: Path = ROOT) -> Path:
    """Write ``results``/REPORT.md and, when ``results`` is ``root``/results, every templated page
    under ``root``; return REPORT.md's path."""
    meta = json.loads((results / "meta.json").read_text())
    report = write_report(results, report_sections(results, current_keys(results)), meta)
    if results.resolve() == (root / "results").resolve():   # a results folder elsewhere renders no pages
        for path, text in rendered(results).items():
            (root / path).write_text(text)
    return report


def differing(results: Path = ROOT / "results", root: Path = ROOT, keys: dict[str, dict] | None = None) -> list[str]:
    """The committed pages (REPORT.md included) that differ from their render from ``results``
    (``keys``: the studies' keys now, when the caller has them)."""
    pages = rendered(results)
    meta = json.loads((results / "meta.json").read_text())
    keys = keys or current_keys(results)
    pages["results/REPORT.md"] = report_text(results, report_sections(results, keys), meta)
    return [path for path, text in pages.items() if not (root / path).exists() or (root / path).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed page differs")
    args = parser.parse_args(argv)
    results = ROOT / "results"
    if args.check:
        stale = differing(results)
        for path in stale:
            print(f"{path} differs from its render: run `python -m experiments.pages`", file=sys.stderr)
        return 1 if stale else 0
    print(render_pages(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
