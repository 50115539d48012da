"""The largest batch per rank that fits a memory budget, found on meta tensors (no memory used).

A timed run's model and engine (run_spec.build_engine) run three steps as one rank of a fake
process group (at_scale.fake_world) under alloc_trace's recorder: every allocation the rank would
make, and when it would free it. The budget is checked against the peak of live bytes (the CPU's
measure, exact there) or, for a GPU held to the budget, against the caching-allocator model's
replay of the same trace (what CUDA would reserve). `max_batch` doubles then bisects.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from experiments.run_spec import RunSpec, build_engine


def step_trace(spec: RunSpec, nd: int, batch: int):
    """Every allocation one rank of ``nd`` x ``spec.mp`` makes in three steps of ``spec`` at
    ``batch``, from the model's construction on (alloc_trace.AllocationTrace, marks "step 0".."step
    2"): the same model and engine as a timed run, built on meta tensors as one rank of a fake
    process group (at_scale.fake_world)."""
    from zero_ref.analysis.alloc_trace import record_allocations
    from zero_ref.analysis.at_scale import fake_world

    spec = replace(spec, batch=batch)
    with fake_world(nd * spec.mp), record_allocations({"meta"}) as trace:
        _, engine, _ = build_engine(spec, torch.device("meta"))
        tokens = torch.zeros(batch, spec.seq, dtype=torch.long, device="meta")
        for i in range(3):
            trace.mark(f"step {i}")
            engine.backward(engine(tokens))
            engine.step()
        engine.close()
    return trace


def step_peak_bytes(spec: RunSpec, nd: int, batch: int, steady: bool = True) -> int:
    """Peak bytes one rank holds in ``step_trace``. ``steady``: the third step's peak; else the
    peak over all three (the first step peaks higher once: stages 0-2 repack their buckets in
    gradient-arrival order, and for a moment both layouts exist, bucketed.py). On the CPU this is
    exactly what a real run's recorder sees; a GPU also needs what its caching allocator reserves
    beyond it (``fits_cuda_budget``)."""
    trace = step_trace(spec, nd, batch)
    return max(trace.live_bytes()[trace.marks["step 2" if steady else "step 0"]:])


def fits_cuda_budget(spec: RunSpec, nd: int, batch: int, budget_bytes: float) -> bool:
    """Would a CUDA run held to ``budget_bytes`` (set_per_process_memory_fraction caps the bytes
    the caching allocator reserves) get through ``step_trace``? Its allocations, construction
    included, replayed through the allocator model (zero_ref.analysis.caching_allocator: rounding, splitting,
    caching, release and retry at the cap), which ran out where the allocator would."""
    from zero_ref.analysis import caching_allocator

    return caching_allocator.fits(step_trace(spec, nd, batch), int(budget_bytes))


def max_batch(spec: RunSpec, nd: int, budget_bytes: float, limit: int = 4096, steady: bool = True,
              allocator: bool = False) -> int:
    """The largest batch per rank whose steps fit ``budget_bytes`` (0 if not even one sequence): by
    the steady-state step's peak of live bytes (``steady``), by the peak of every step from the
    first on, or (``allocator``) by what CUDA's caching allocator would need for all of them
    (``fits_cuda_budget``), which a run held to the budget on a GPU must get through."""
    def fits(batch: int) -> bool:
        if allocator:
            return fits_cuda_budget(spec, nd, batch, budget_bytes)
        return step_peak_bytes(spec, nd, batch, steady) <= budget_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
