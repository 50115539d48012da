"""The paper's Figures 2, 3, 4 and 8 from the performance model, beside the paper's numbers.

Every run of the paper's appendix (experiments/paper_data/runs.csv: GPUs, MP, layers x hidden,
heads, batch per GPU, ZeRO config) is predicted by zero_ref.analysis.perf_model on ``V100_DGX2`` (the
paper's machine from published numbers, each with its source), with the data-parallel traffic
counted from the real engine at scale (perf_model.dp_traffic: one step on meta tensors as one
rank of a fake group of Nd ranks). Systems: ZeRO-100B = stage 2 (Pos+g) with the run's C1-C5
config, else Pa when model-parallel; the Megatron / PyTorch DDP baseline = stage 0 with plain
checkpoints. The memory column is the memory study's accounting of the run (max_model_size.
per_gpu_bytes, fragmentation measured by the fragmentation study) against a 32 GB V100.

The terms the model has: compute at a published rate, ring collectives at published bandwidths,
Megatron's all-reduces, Pa, Pa+cpu's host copies, the optimizer. Memory pressure is measured
beside them (``memory_pressure``): each run's steps traced on meta tensors (the real engine at the
run's Nd x Nm, batch, checkpoints and MD) and replayed through the caching-allocator model at a
V100's capacity, counting the requests that find the device full and flush the cache before
retrying (each a device synchronisation on a GPU). Where a run has none, the term is zero whatever
a retry costs; a retry's cost would need a GPU to measure.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from experiments.fragmentation_trace import TraceCase, trace_steps
from experiments.max_model_size import Assumptions, Case, per_gpu_bytes
from experiments.paper_values import paper_runs
from zero_ref.analysis import caching_allocator
from zero_ref.analysis import perf_model as pm
from zero_ref.analysis.at_scale import ModelShape

def measured_fragmentation(results: Path) -> float:
    """The largest fragmentation share the fragmentation study measured at the paper's scale
    (``results``/fragmentation/searches.csv, every case), which the memory terms here use."""
    path = results / "fragmentation" / "searches.csv"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the projection's memory terms use the share the "
                                "fragmentation study measured; run it first (zero-ref reproduce --only fragmentation)")
    return float(pd.read_csv(path).fragmentation.max())

COMPUTE_LIMITED = {"Fig 2": lambda r: r["system"] == "ZeRO" and r["label"] in ("40B", "60B", "80B", "100B"),
                   "Fig 3": lambda r: r["gpus"] >= 128,
                   "Fig 4": lambda r: r["system"].startswith("ZeRO") and r["batch_per_gpu"] >= 4}
"""The issue's compute/communication-limited points (15% goal); the others have a 30% goal."""


def system_of(run: dict) -> tuple[int, str]:
    """(stage, checkpoint mode) of a paper run."""
    from zero_ref.analysis.presets import PAPER_CONFIGS

    if run["zero_config"]:
        preset = PAPER_CONFIGS[run["zero_config"]]
        return preset.stage, preset.checkpoints
    if run["system"] == "ZeRO":
        return 2, "pa" if run["mp"] > 1 else "plain"
    return 0, "plain"


@functools.cache
def _dp_traffic(layers: int, hidden: int, heads: int, stage: int, nd: int, nm: int) -> tuple[dict, dict]:
    """perf_model.dp_traffic, once per configuration: it does not depend on the batch, and Fig 8's
    C3-C5 and Fig 3's fixed-batch runs share theirs with other runs."""
    return pm.dp_traffic(layers, hidden, heads, stage, nd, nm=nm)


def predict_run(run: dict, cluster: pm.Cluster = pm.V100_DGX2, batch: int | None = None) -> pm.Prediction:
    """The model's step of one paper run (optionally at another batch per GPU)."""
    stage, checkpoints = system_of(run)
    shape = ModelShape(run["layers"], run["hidden"], run["heads"])
    moved, calls = _dp_traffic(run["layers"], run["hidden"], run["heads"], stage, run["dp"], run["mp"])
    spec = pm.StepSpec(shape.layers, shape.hidden, shape.seq, shape.vocab, batch or run["batch_per_gpu"], run["dp"],
                       run["mp"], stage, checkpoints, 2, moved, calls,
                       pm.optimizer_elements(shape.params_per_mp_rank(run["mp"]), stage, run["dp"]))
    return pm.predict(spec, cluster)


def memory_gb(run: dict, fragmentation: float, batch: int | None = None) -> float:
    """The memory study's accounting of the run on one GPU (GB), the measured ``fragmentation`` share included."""
    stage, checkpoints = system_of(run)
    a = Assumptions(fragmentation=fragmentation)
    case = Case(run["label"], stage, run["dp"], run["mp"], batch or run["batch_per_gpu"], checkpoints)
    terms = per_gpu_bytes(ModelShape(run["layers"], run["hidden"], run["heads"]), case, a)
    return (terms["total"] / (1 - a.fragmentation) + a.context_bytes) / 1e9


def largest_batch(run: dict, fragmentation: float, device_gb: float = 32 * 2**30 / 1e9) -> int:
    """The largest batch per GPU whose accounting fits a 32 GB V100."""
    batch = 0
    while memory_gb(run, fragmentation, batch + 1) <= device_gb and batch < 512:
        batch += 1
    return batch


ALLOCATOR_BYTES = int(Assumptions().device_bytes - Assumptions().context_bytes)
"""What PyTorch's caching allocator can hold on a 32 GB V100: the device less the CUDA context and
the libraries' workspaces (the memory study's 1 GB)."""


def _pressure_case(run: dict) -> tuple:
    """What a run's memory pressure depends on: (layers, hidden, heads, stage, Nd, Nm, batch, checkpoints)."""
    stage, checkpoints = system_of(run)
    return (run["layers"], run["hidden"], run["heads"], stage, run["dp"], run["mp"], run["batch_per_gpu"],
            checkpoints)


def _pressure(layers: int, hidden: int, heads: int, stage: int, nd: int, nm: int, batch: int,
              checkpoints: str) -> dict:
    case = TraceCase(ModelShape(layers, hidden, heads), stage, nd, nm, batch, checkpoints, md=stage > 0)
    trace = trace_steps(case, steps=2)
    first, steady = trace.marks["step 0"], trace.marks["step 1"]
    reserved = caching_allocator.replay(trace, None, steady).peak_reserved
    try:
        retries = caching_allocator.replay(trace, ALLOCATOR_BYTES, first, count_from=steady).alloc_retries
    except caching_allocator.OutOfMemory:
        retries = None
    return {"trace_reserved_gb": reserved / 1e9, "alloc_retries_per_step": retries}


def memory_pressure(run: dict) -> dict:
    """The run's memory pressure on a 32 GB V100, measured on its allocation trace: one rank's
    model and engine at the run's Nd x Nm, batch and checkpoints (MD for ZeRO, as the fragmentation
    study traces them) run two steps on meta tensors, replayed through zero_ref.analysis.caching_allocator
    holding ``ALLOCATOR_BYTES`` from the first step on. ``trace_reserved_gb``: what the second
    (steady) step reserves with no limit; ``alloc_retries_per_step``: its requests that found the
    device full and flushed the cache to retry (None: the steps do not fit at all)."""
    return _pressure(*_pressure_case(run))


def pressures(runs: list[dict], workers: int | None = None, quiet: bool = False) -> list[dict]:
    """``memory_pressure`` of every run, ``workers`` processes at a time (default: up to two), in
    input order; runs of one configuration are traced once."""
    cases = [_pressure_case(run) for run in runs]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers or min(2, os.cpu_count() or 1), mp_context=context) as pool:
        futures = {case: pool.submit(_pressure, *case) for case in dict.fromkeys(cases)}
        for future in tqdm(futures.values(), desc="memory pressure traces", disable=quiet, file=sys.stderr):
            future.result()
    return [futures[case].result() for case in cases]


def projections(fragmentation: float, trace_memory: bool = True, quiet: bool = False) -> pd.DataFrame:
    """One row per paper run: the model's TFLOPS per GPU beside the paper's, the terms, memory (at
    the measured ``fragmentation`` share) and (``trace_memory``: minutes on two cores) the
    memory-pressure term measured on the run's trace."""
    runs = paper_runs()
    untraced = {"trace_reserved_gb": None, "alloc_retries_per_step": None}
    pressure = pressures(runs, quiet=quiet) if trace_memory else [untraced] * len(runs)
    rows = []
    for run, measured in zip(runs, pressure):
        p = predict_run(run)
        paper = run["paper_tflops_per_gpu"]
        limited = COMPUTE_LIMITED.get(run["figure"], lambda r: False)(run)
        rows.append({"figure": run["figure"], "label": run["label"], "system": run["system"],
                     "config": run["zero_config"], "gpus": run["gpus"], "mp": run["mp"], "dp": run["dp"],
                     "batch_per_gpu": run["batch_per_gpu"], "paper_tflops": paper, "model_tflops": p.tflops,
                     "error_pct": 100 * (p.tflops / paper - 1) if paper else None,
                     "goal_pct": (15 if limited else 30) if paper else None,
                     "step_s": p.seconds, **{f"{k}_s": v for k, v in p.terms.items()},
                     "memory_gb": memory_gb(run, fragmentation),
                     "largest_batch_32gb": largest_batch(run, fragmentation), **measured})
    frame = pd.DataFrame(rows)
    frame["within_goal"] = frame.error_pct.abs() <= frame.goal_pct
    return frame


def superlinear_mechanism(frame: pd.DataFrame) -> pd.DataFrame:
    """Fig 3 per GPU count: the paper's and the model's aggregate TFLOPS against ideal-linear from
    64 GPUs, and the model at a fixed batch of 16 (what the batch alone adds)."""
    runs = {r["gpus"]: r for r in paper_runs() if r["figure"] == "Fig 3"}
    fig3 = frame[frame.figure == "Fig 3"].set_index("gpus")
    rows = []
    for gpus, run in sorted(runs.items()):
        fixed = predict_run(run, batch=16)
        rows.append({"gpus": gpus, "batch_per_gpu": run["batch_per_gpu"],
                     "paper_aggregate_pflops": fig3.loc[gpus, "paper_tflops"] * gpus / 1e3,
                     "model_aggregate_pflops": fig3.loc[gpus, "model_tflops"] * gpus / 1e3,
                     "model_batch16_aggregate_pflops": fixed.tflops * gpus / 1e3,
                     "largest_batch_32gb": fig3.loc[gpus, "largest_batch_32gb"]})
    out = pd.DataFrame(rows)
    for col in ("paper", "model", "model_batch16"):
        first = out[f"{col}_aggregate_pflops"].iloc[0]
        out[f"{col}_vs_linear"] = out[f"{col}_aggregate_pflops"] / (first * out.gpus / out.gpus.iloc[0])
    return out
