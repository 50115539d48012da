"""The paper's memory and model-size studies (Table 1, Figure 1, Table 2, Sec 10.4), three ways.

1. **Analysis**: ``zero_ref.analysis.memory_model``, the paper's formulas computed exactly.
2. **The engine at paper scale** (``zero_ref.analysis.at_scale``): the real ``initialize()`` for each
   stage on meta tensors, as rank 0 of a fake process group of Nd ranks (Nd up to 1024), read by
   the engine's ``memory_report()`` and independently by torch's ``MemTracker``.
3. **Real runs** (``memory_real_runs``): gloo ranks on this CPU (world 2 and 4) train a small
   GPT-2-like model; measured per-rank peak memory against the prediction.
The max-model-size search (``max_model_size``) turns the per-GPU accounting into Table 2's
"measured" columns, and the engine at scale confirms the model-state bytes of every shape found.

Outputs in ``--out`` (default ``results/memory``): table1.csv, memory_vs_nd.csv, figure1.csv,
bench_1t.json, table2.csv, table2_sensitivity.csv (the search redone with each chosen number
changed in turn), assumptions.json, max_model_vs_nd.csv, real_runs.csv, memory_vs_nd.png,
figure1.png, max_model_vs_nd.png, real_runs.png, REPORT.md and meta.json.

    python experiments/memory_study.py            # everything (a few minutes on 2 cores)
    python experiments/memory_study.py --quick    # the same tables, fewer extra cases and runs
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments import max_model_size as mms
from experiments import memory_real_runs as real
from experiments.paper_values import FIGURE1_GB, TABLE1_GB
from experiments.provenance import ROOT, provenance, study_main
from zero_ref.analysis import memory_model as mm
from zero_ref.analysis.at_scale import ModelShape, exact_shape, measure_at_scale

TABLE1_SHAPES = {"7.5B": (7_500_000_000, 8000, 64), "128B": (128_000_000_000, 25600, 200),
                 "1T": (10**12, 50000, 400)}
"""Table 1 names only Ψ. We build GPT-2-like models of exactly that many parameters (the
vocabulary absorbs the rounding, see at_scale.exact_shape) at these (hidden, heads): wide and
shallow, so that the 54 cells take seconds (the engine's time grows with the tensor count)."""

BENCH_1T = (10**12, 25600, 200)
"""The 1T benchmark uses a Megatron-like shape instead: 127 layers × 25600, 1.5k tensors (the
quick mode uses Table 1's 1T shape, 33 × 50000)."""


def _bar(items, desc: str, quiet: bool):
    return tqdm(items, desc=desc, disable=quiet, file=sys.stderr, leave=False)


def engine_at_scale(quick: bool, quiet: bool = False) -> pd.DataFrame:
    """Every Table 1 cell (stages 1-3) plus the baseline, from the engine at scale, each checked
    against torch's MemTracker (``quick``: only the Nd = 64 column, Fig 1's, which is a quarter of
    the time; ``tracker_gb`` is empty elsewhere)."""
    cases = []
    for model, (psi, hidden, heads) in TABLE1_SHAPES.items():
        shape = exact_shape(psi, hidden, heads)
        for nd in mm.TABLE1_ND:
            stages = (0, 1, 2, 3) if (model == "7.5B" or not quick) else (1, 2, 3)
            cases += [(model, shape, nd, stage) for stage in stages]
    rows = []
    for model, shape, nd, stage in _bar(cases, "engine at scale (Table 1)", quiet):
        r = measure_at_scale(shape, stage, nd, track=not quick or nd == 64)
        paper = TABLE1_GB[(model, nd)][stage - 1] if stage else None
        rows.append({
            "model": model, "shape": r.label, "psi": r.psi, "nd": nd, "stage": stage,
            "scheme": mm.PAPER_NAMES[stage], "paper_gb": paper, "analysis_gb": r.analysis / mm.GB,
            "engine_gb": r.engine_total / mm.GB,
            "tracker_gb": None if r.tracker_total is None else r.tracker_total / mm.GB,
            "engine_params": r.engine["params"], "engine_grads": r.engine["grads"],
            "engine_optimizer_states": r.engine["optimizer_states"], "padding_bytes": r.padding,
            "padding_bound_bytes": r.padding_bound, "within_padding": r.within_padding,
            "tracker_equals_engine": r.tracker_agrees,
            "init_peak_gb": None if r.tracker_peak is None else r.tracker_peak / mm.GB, "seconds": r.seconds,
            "engine_minus_paper_gb": r.engine_total / mm.GB - paper if paper is not None else None,
        })
    return pd.DataFrame(rows)


def figure1(at_scale: pd.DataFrame) -> pd.DataFrame:
    rows = at_scale[(at_scale.model == "7.5B") & (at_scale.nd == 64)].copy()
    rows["paper_gb"] = rows.stage.map(FIGURE1_GB)
    rows["error_gb"] = rows.engine_gb - rows.paper_gb
    return rows[["stage", "scheme", "paper_gb", "analysis_gb", "engine_gb", "tracker_gb", "error_gb"]]


def bench_1t(quick: bool = False) -> dict:
    """The 1T model at Nd = 1024, stage 3, in a fresh process: wall time and peak RSS."""
    psi, hidden, heads = TABLE1_SHAPES["1T"] if quick else BENCH_1T
    command = [sys.executable, "-m", "zero_ref.analysis.at_scale", "--psi", str(psi), "--hidden", str(hidden),
               "--heads", str(heads), "--nd", "1024", "--stage", "3"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the 1T benchmark failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = time.perf_counter() - start   # including interpreter and torch import
    result["command"] = " ".join(["python", *command[1:]])
    return result


def table2(quick: bool, quiet: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Our search beside Table 2 and the no-MP result; the engine at scale confirms the states of
    the shapes found for the measured columns (MP 1 and no-MP only in quick mode)."""
    search = pd.DataFrame(mms.search_rows())
    a = mms.Assumptions()
    engine_gb = []
    for _, row in _bar(list(search.iterrows()), "engine at scale (Table 2 shapes)", quiet):
        confirm = row.paper_measured_b is not None and pd.notna(row.paper_measured_b) and row.ours_shape
        if confirm and (not quick or row.nm == 1):
            layers, hidden = map(int, row.ours_shape.split("x"))
            heads = dict(mms.FAMILY)[hidden]
            r = measure_at_scale(ModelShape(layers, hidden, heads, a.vocab, a.seq), int(row.stage), int(row.nd),
                                 mp=int(row.nm))
            engine_gb.append(r.engine_total / mm.GB)
        else:
            engine_gb.append(None)
    search["engine_states_gb"] = engine_gb
    return search, pd.DataFrame(mms.sensitivity_rows()), pd.DataFrame(mms.versus_nd_rows())


def real_runs(worlds: list[int], run: real.RealRun, quiet: bool = False) -> pd.DataFrame:
    """Gloo ranks on this CPU at each world size; with a GPU, also one rank of a fake group of 4 on
    it (real CUDA allocations, torch.cuda.max_memory_allocated)."""
    import torch

    from zero_ref.launch import spawn

    rows = []
    for world in _bar(worlds, "real runs (gloo ranks)", quiet):
        ranks = spawn(real.rank_main, world, run, [3, 2, 1, 0], timeout=900)
        rows += [row for rank in ranks for row in rank]
    if torch.cuda.is_available():
        rows += real.one_rank_of(4, run, [3, 2, 1, 0], "cuda")
    return pd.DataFrame(real.compare(rows, run))


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """Run every leg, write the CSVs, plots and REPORT.md into ``out``; return the headline rows."""
    from experiments import memory_report

    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    analysis = pd.DataFrame(mm.table1_rows())
    lap("analysis")
    at_scale = engine_at_scale(quick, quiet)
    lap("engine_at_scale")
    bench = bench_1t(quick)
    lap("bench_1t")
    t2, sensitivity, versus_nd = table2(quick, quiet)
    lap("max_model_size")
    run = real.RealRun(steps=1, batch=1, seq=32, layers=2) if quick else real.RealRun(steps=2)
    runs = real_runs([2] if quick else [2, 4], run, quiet)
    lap("real_runs")

    table1 = at_scale[at_scale.stage > 0].merge(
        analysis[["model", "nd", "stage", "gb"]].rename(columns={"gb": "formula_gb"}), on=["model", "nd", "stage"])
    fig1 = figure1(at_scale)
    table1.to_csv(out / "table1.csv", index=False)
    at_scale.to_csv(out / "memory_vs_nd.csv", index=False)
    fig1.to_csv(out / "figure1.csv", index=False)
    (out / "bench_1t.json").write_text(json.dumps(bench, indent=2) + "\n")
    t2.to_csv(out / "table2.csv", index=False)
    sensitivity.to_csv(out / "table2_sensitivity.csv", index=False)
    versus_nd.to_csv(out / "max_model_vs_nd.csv", index=False)
    (out / "assumptions.json").write_text(json.dumps(mms.assumptions_table(), indent=2) + "\n")
    runs.to_csv(out / "real_runs.csv", index=False)
    memory_report.plots(out, at_scale, versus_nd, t2, runs, fig1)
    lap("write_and_plot")
    meta = provenance() | {"quick": quick, "seconds": seconds, "real_run": asdict(run)}
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    headline = memory_report.write_report(out, table1, fig1, bench, t2, sensitivity, runs, run, meta)
    return {"headline": headline, "meta": meta}


def main(argv: list[str] | None = None) -> dict:
    return study_main(run_study, "memory", "The ZeRO paper's memory and model-size studies.", "fewer extra cases and real runs (~1 minute)", argv)


if __name__ == "__main__":
    main()
