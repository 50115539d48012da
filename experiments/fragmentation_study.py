"""Fragmentation measured: allocation traces replayed through a caching-allocator model (MD, Fig 7).

The memory study's searches (Table 2, Fig 4, Fig 6) lose a share of each GPU to the caching
allocator's fragmentation; it chose 15%. Here that share is measured instead, per case:

1. **trace**: one rank of the case's Nd x Nm grid runs two real training steps of the model the
   search found, on meta tensors (experiments/fragmentation_trace.py): the real engine, torch's
   checkpointing with our Pa/Pa+cpu hooks, every storage allocated and freed in order;
2. **replay** through zero_ref.analysis.caching_allocator (PyTorch's CUDA caching-allocator rules): the
   smallest device that runs the steps, against the bytes they ask for at their peak, gives the
   fragmentation share;
3. **search again** with the measured share (and trace the new model): the answer beside the
   paper's and beside the answer at the chosen 15%.

The search starts from no allowance at all (the accounting alone), so the paper's numbers play no
part in the measured share. The 2019 baseline (stage 0, Megatron-LM / PyTorch DDP) runs without
MD; ZeRO's configurations with MD (activations.CheckpointArena), and the same model without MD is
traced too for Fig 4 and Fig 6, to show what MD buys. Fig 7 (the most memory PyTorch caches per configuration C1-C5
at 40B and 100B; the paper gives only its order) is the replay's peak of reserved bytes.

What the traces leave out: memory outside the caching allocator (CUDA context, cuBLAS and NCCL
workspaces: the search's 1 GB), the baseline's fp32 gradient copy (one long-lived buffer), and
attention is the math path (torch's meta kernels), which holds the seq x seq scores as 2019's
Megatron-LM did.

Writes ``fragmentation.csv`` (one row per trace), ``searches.csv`` (per case: paper, ours at 15%,
ours measured), ``fig7.csv`` (full runs) and ``meta.json``; experiments/fragmentation_report.py
(the report step) draws ``fragmentation.png`` and ``REPORT.md`` from them.

    python -m experiments.fragmentation_study --out results/fragmentation
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments.fragmentation_trace import TraceCase, measure
from experiments.max_model_size import (
    FAMILY,
    FIG6_BATCH,
    FIG6_FAMILY,
    FIG6_GPUS,
    FIG6_NM,
    NO_MP_CASES,
    Assumptions,
    Case,
    largest_model,
    per_gpu_bytes,
    table2_cases,
)
from experiments.paper_values import FIG6_B, NO_MP_B
from experiments.provenance import ROOT, provenance
from zero_ref.analysis.at_scale import ModelShape
from zero_ref.analysis.presets import PAPER_CONFIGS

CHOSEN = 0.15
"""The memory study's chosen fragmentation share, which this study replaces."""

QUICK_BUCKET_NUMEL, QUICK_STEPS = 2**26, 1
"""--quick's traces: gradient buckets of 2**26 elements, 16x the engine's default of 2**22, and one
training step, not two. At stage 2 the engine fills each bucket-sized piece of a reduction one
rank's row at a time, Nd = 128 small copies per piece, each recorded by the trace, which made
--quick's three traces of Fig 4's ZeRO case take minutes; and a trace's peak is in its first step
(the repack), so the second adds time, not a different peak. The shares measured move by tenths of
a percent. Full runs keep the default bucket and two steps."""

FIG7 = {"40B": (ModelShape(50, 8192, 32), 16), "100B": (ModelShape(125, 8192, 64), 32)}
"""Fig 7's models (appendix): shape and batch per GPU, at MP 16 on 400 GPUs."""


def search_cases(quick: bool) -> list[tuple[str, Case, float, tuple]]:
    """(study, case, the paper's size in B, the family of shapes searched) of every
    measured max-model-size point: Table 2's measured columns, Fig 4's sizes, Fig 6's C1-C5."""
    cases = [("Fig 4 / Sec 10.4", case, NO_MP_B[case.stage], FAMILY) for case in NO_MP_CASES]
    if quick:
        return cases
    cases += [("Table 2", case, paper_b, FAMILY) for case, paper_b in table2_cases() if paper_b is not None]
    cases += [("Fig 6", Case(f"Fig 6 {name}", p.stage, FIG6_GPUS // FIG6_NM, FIG6_NM, FIG6_BATCH, p.checkpoints),
               FIG6_B[name], FIG6_FAMILY) for name, p in PAPER_CONFIGS.items()]
    return cases


def _largest(case: Case, fragmentation: float, family: tuple) -> ModelShape:
    return largest_model(case, Assumptions(fragmentation=fragmentation), family)[0]


def _accounted(shape: ModelShape, case: Case) -> float:
    """The search's bytes for `shape` without what the traces cannot hold (the 2019 baseline's
    fp32 gradient copy), to set beside the trace's peak."""
    terms = per_gpu_bytes(shape, case, Assumptions())
    return terms["total"] - (terms["buffers"] if case.stage == 0 else 0)


def _trace_case(case: Case, shape: ModelShape, md: bool, quick: bool = False) -> TraceCase:
    bucket = {"bucket_numel": QUICK_BUCKET_NUMEL} if quick else {}
    return TraceCase(shape, case.stage, case.nd, case.nm, case.batch, case.checkpoints, md, **bucket)


def _measure_all(cases: list[TraceCase], workers: int, quiet: bool, what: str, steps: int = 2) -> list[dict]:
    """measure() every trace case (`steps` steps each), `workers` processes at a time, results in
    input order."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = [pool.submit(measure, case, steps) for case in cases]
        for future in tqdm(futures, desc=what, disable=quiet, file=sys.stderr):
            future.result()
    return [future.result() for future in futures]


def run(quick: bool = False, quiet: bool = False, workers: int | None = None) -> dict[str, pd.DataFrame]:
    """Both rounds of trace-replay-search for every case, and Fig 7 (full runs only)."""
    workers = workers or min(2, os.cpu_count() or 1)
    steps = QUICK_STEPS if quick else 2
    cases = search_cases(quick)
    md = lambda case: case.stage > 0                               # ZeRO with MD, the baseline without
    # round 1: the model the accounting alone allows (no fragmentation), traced
    first = [_largest(c, 0.0, fam) for _, c, _, fam in cases]
    fig7 = [] if quick else [TraceCase(shape, p.stage, FIG6_GPUS // FIG6_NM, FIG6_NM, batch, p.checkpoints, True)
                             for shape, batch in FIG7.values() for p in PAPER_CONFIGS.values()]
    measured = _measure_all([_trace_case(c, s, md(c), quick) for (_, c, _, _), s in zip(cases, first)] + fig7,
                            workers, quiet, "fragmentation: round 1", steps)
    round1, fig7_rows = measured[:len(cases)], measured[len(cases):]
    # round 2: the model that fits with the share measured in round 1, traced with and without MD
    second = [_largest(c, r["fragmentation"], fam) for (_, c, _, fam), r in zip(cases, round1)]
    zero = [i for i, (study, c, _, _) in enumerate(cases) if md(c) and study != "Table 2"]   # MD's effect
    measured = _measure_all([_trace_case(c, s, md(c), quick) for (_, c, _, _), s in zip(cases, second)]
                            + [_trace_case(cases[i][1], second[i], False, quick) for i in zero],
                            workers, quiet, "fragmentation: round 2", steps)
    round2, without_md = measured[:len(cases)], dict(zip(zero, measured[len(cases):]))

    traces, searches = [], []
    for i, ((study, case, paper_b, family), r1, r2) in enumerate(zip(cases, round1, round2)):
        final = _largest(case, r2["fragmentation"], family)
        chosen = _largest(case, CHOSEN, family)
        for round_, row in ((1, r1), (2, r2)):
            traces.append({"study": study, "case": case.name, "round": round_} | row)
        if i in without_md:
            traces.append({"study": study, "case": case.name, "round": 2} | without_md[i])
        searches.append({
            "study": study, "case": case.name, "stage": case.stage, "nd": case.nd, "nm": case.nm,
            "batch": case.batch, "checkpoints": case.checkpoints, "md": md(case), "paper_b": paper_b,
            "chosen_fragmentation": CHOSEN, "ours_chosen_b": chosen.params / 1e9,
            "error_chosen_pct": 100 * (chosen.params / 1e9 - paper_b) / paper_b,
            "fragmentation_round1": r1["fragmentation"], "fragmentation": r2["fragmentation"],
            "fragmentation_without_md": without_md[i]["fragmentation"] if i in without_md else None,
            "ours_b": final.params / 1e9, "ours_shape": final.label(),
            "error_pct": 100 * (final.params / 1e9 - paper_b) / paper_b,
            "converged": final == second[i],
            "traced_shape": second[i].label(), "trace_peak_gb": r2["peak_requested_gb"],
            "accounting_gb": _accounted(second[i], case) / 1e9,
            "change_pct": 100 * (final.params - chosen.params) / chosen.params,
        })
    fig7_table = pd.DataFrame([{"model": size, "config": name} | row
                               for (size, name), row in zip(((s, n) for s in FIG7 for n in PAPER_CONFIGS), fig7_rows)])
    return {"traces": pd.DataFrame(traces), "searches": pd.DataFrame(searches), "fig7": fig7_table}


def run_study(out: Path, quick: bool = False, quiet: bool = False) -> dict:
    """Run and write the tables and meta.json into `out`; fragmentation_report.render draws them."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tables = run(quick, quiet)
    tables["traces"].drop(columns=["trace"]).to_csv(out / "fragmentation.csv", index=False)
    tables["searches"].to_csv(out / "searches.csv", index=False)
    if len(tables["fig7"]):
        tables["fig7"].to_csv(out / "fig7.csv", index=False)
    meta = provenance() | {"quick": quick, "seconds": round(time.perf_counter() - start, 1), "chosen": CHOSEN,
                           "fig7_models": {size: {"layers": shape.layers, "hidden": shape.hidden, "seq": shape.seq,
                                                  "batch": batch, "nm": FIG6_NM} for size, (shape, batch) in FIG7.items()}}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {"meta": meta}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "fragmentation")
    parser.add_argument("--quick", action="store_true", help="Fig 4's two cases only (no Table 2, Fig 6, Fig 7), "
                        "traced with larger gradient buckets for one step (QUICK_BUCKET_NUMEL, QUICK_STEPS)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    from experiments.fragmentation_report import render

    return run_study(args.out, args.quick, args.quiet) | {"headline": render(args.out)}


if __name__ == "__main__":
    main()
