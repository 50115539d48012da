"""MD and measured fragmentation: the caching-allocator model's rules on traces worked out by hand,
the allocation recorder against torch's MemTracker, and the checkpoint arena (exact gradients,
never a slot still in use)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from zero_ref.analysis import caching_allocator as ca
from zero_ref.analysis.alloc_trace import AllocationTrace, record_allocations

MiB = ca.MiB


# ------------------------------------------------------------------------- the allocator model
def test_sizes_follow_pytorchs_rules():
    assert [ca.round_size(n) for n in (1, 512, 513, 4000)] == [512, 512, 1024, 4096]
    assert ca.segment_size(ca.round_size(1000)) == 2 * MiB           # small pool
    assert ca.segment_size(MiB + 512) == 20 * MiB                      # large, under 10 MiB
    assert ca.segment_size(11 * MiB + 1) == 12 * MiB                   # large: rounded up to 2 MiB


def test_blocks_split_merge_and_segments_are_released_under_pressure():
    allocator = ca.CachingAllocatorModel()
    small = [allocator.malloc(1000) for _ in range(3)]                  # one 2 MiB segment, split
    assert allocator.reserved == 2 * MiB and allocator.allocated == 3 * 1024
    a, b = allocator.malloc(5 * MiB), allocator.malloc(5 * MiB)         # one 20 MiB segment, split
    assert allocator.reserved == 22 * MiB
    allocator.free(a, 5 * MiB)
    allocator.free(b, 5 * MiB)                                          # merged back: one free 20 MiB block
    assert allocator.malloc(18 * MiB).size == 18 * MiB                  # best fit reuses it, no new segment
    assert allocator.reserved == 22 * MiB
    for block in small:
        allocator.free(block, 1000)
    # a full device: the cached, wholly free small segment is released so that a new one fits
    tight = ca.CachingAllocatorModel(capacity=22 * MiB)
    kept = tight.malloc(20 * MiB)
    tight.free(tight.malloc(1000), 1000)
    assert tight.reserved == 22 * MiB
    tight.free(kept, 20 * MiB)
    tight.malloc(22 * MiB)                                              # releases both cached segments
    assert tight.reserved == 22 * MiB
    with pytest.raises(ca.OutOfMemory):
        tight.malloc(1000)


def test_interleaving_fragments_and_grouping_long_lived_tensors_does_not():
    from experiments.fragmentation_report import interleaved_example

    interleaved, grouped = interleaved_example(False), interleaved_example(True)
    assert ca.replay(interleaved).peak_requested == ca.replay(grouped).peak_requested == 36 * MiB
    assert ca.fits(interleaved, 52 * MiB) and not ca.fits(interleaved, 52 * MiB - 1)
    assert ca.fits(grouped, 40 * MiB)
    assert 50 * MiB < ca.min_capacity(interleaved) <= 52 * MiB
    assert ca.fragmentation(interleaved) == pytest.approx(1 - 36 / 52, abs=0.02)
    assert ca.fragmentation(grouped) == pytest.approx(1 - 36 / 40, abs=0.02)


def test_the_limit_applies_from_the_start_event_on():
    # 100 MiB at construction, freed; then the steps need 12 MiB: a 12 MiB device runs them
    trace = AllocationTrace([(0, 100 * MiB), (0, -100 * MiB), (1, 12 * MiB), (1, -12 * MiB)])
    assert not ca.fits(trace, 12 * MiB)
    assert ca.fits(trace, 12 * MiB, start=2)
    assert ca.replay(trace, None, start=2).peak_requested == 12 * MiB


def test_a_full_device_flushes_the_cache_and_retries_each_time_it_runs_out():
    # each step: 12 MiB live, then 16 MiB freed, then a small request (the small pool's own 2 MiB
    # segment). At 29 MiB the large pool's cached 16 MiB must go for the small segment and the small
    # segment for the next 16 MiB: from the second step on, two flushes and retries a step
    events = []
    for step in range(3):
        base = 10 * step
        events += [(base, 12 * MiB), (base + 1, 16 * MiB), (base + 1, -16 * MiB), (base + 2, 1000),
                   (base + 2, -1000), (base, -12 * MiB)]
    trace = AllocationTrace(events)
    assert ca.replay(trace, 30 * MiB).alloc_retries == 0             # everything stays cached
    assert ca.replay(trace, 29 * MiB).alloc_retries == 1 + 2 + 2
    assert ca.replay(trace, 29 * MiB, start=6).alloc_retries == 1 + 2   # the cache emptied at the start event
    assert ca.replay(trace, 29 * MiB, count_from=6).alloc_retries == 2 + 2  # the cache as the first step left it
    assert ca.replay(trace).alloc_retries == 0                       # no limit: never full
    with pytest.raises(ca.OutOfMemory):
        ca.replay(trace, 27 * MiB)                                   # 12 and 16 MiB live at once


# ------------------------------------------------------------------------------ the recorder
def test_recorder_sees_allocations_frees_and_storage_resizes():
    with record_allocations() as trace:
        a = torch.ones(1000)
        b = a * 2
        del a
        storage = b.untyped_storage()
        storage.resize_(0)                                  # stage 3's way of freeing a parameter
        storage.resize_(400)                                # and of gathering it again
        del b, storage
    assert trace.events == [(0, 4000), (1, 4000), (0, -4000), (1, -4000), (2, 400), (2, -400)]
    assert trace.peak_bytes() == 8000


def test_storages_made_before_recording_are_not_counted_when_an_op_views_them():
    batch = torch.zeros(4, 250)                              # made before: the harness's data
    with record_allocations(already_alive=[batch]) as trace:
        rows = batch[:2]                                     # a view: the first sight of its storage
        doubled = rows * 2                                   # a real allocation
        del rows, doubled
    assert trace.events == [(0, 2000), (0, -2000)]
    with record_allocations() as trace:                      # unannounced, the view counts it
        rows = batch[:2]
        del rows                                             # the batch keeps the storage alive
    assert trace.events == [(0, 4000)]


def test_recorder_agrees_with_memtracker_on_engine_steps_at_scale():
    from torch.distributed._tools.mem_tracker import MemTracker

    from zero_ref import ZeroConfig, initialize
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.analysis.at_scale import ModelShape, fake_world

    meta = torch.device("meta")
    for stage in (2, 3):
        with fake_world(4):
            tracker = MemTracker()
            with tracker, record_allocations() as trace:
                model = ModelShape(3, 64, 4, 100, 32).build("meta")
                checkpoint_blocks(model.blocks, "plain", contiguous=True)
                engine = initialize(model, ZeroConfig(stage=stage, dtype="fp16", kernels="torch"))
                tokens = torch.zeros(2, 32, dtype=torch.long, device="meta")
                logits = engine(tokens)
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
                del logits
                engine.backward(loss)
                del loss
                assert engine.step()                         # a step on meta tensors makes its allocations
                current = tracker.get_tracker_snapshot("current")[meta]["Total"]
                peak = tracker.get_tracker_snapshot("peak")[meta]["Total"]
            engine.close()
        assert trace.live_bytes()[-1] == current and trace.peak_bytes() == peak, stage


def test_cuda_snapshot_trace():
    snapshot = {"device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 2 * MiB},
        {"action": "alloc", "addr": 0, "size": 512}, {"action": "alloc", "addr": 512, "size": 1024},
        {"action": "free_requested", "addr": 0, "size": 512}, {"action": "free_completed", "addr": 0, "size": 512},
        {"action": "alloc", "addr": 0, "size": 512}]]}
    assert AllocationTrace.from_cuda_snapshot(snapshot).events == [(0, 512), (1, 1024), (0, -512), (2, 512)]


# --------------------------------------------------------------------------- the checkpoint arena
def _model(contiguous: bool, mode: str = "plain"):
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.models import ParallelGPT

    model = ParallelGPT(n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=16)
    return model, checkpoint_blocks(model.blocks, mode, contiguous=contiguous)


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["plain", "pa", "pa_cpu"])
def test_arena_gives_the_same_gradients_and_is_reused(mode):
    tokens = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    reference, _ = _model(False, mode)
    model, checkpoints = _model(True, mode)
    for batch in tokens:
        for m in (reference, model):
            m.zero_grad()
            m(batch).backward()
        assert all(torch.equal(a, b) for a, b in zip(_grads(reference), _grads(model)))
    arena = checkpoints.arena
    assert (arena.allocations, arena.misses, arena.taken) == (1, 0, [False] * 3)
    # Pa+cpu: while a block recomputes, the slice of the one before it is copied back (2 of 3 blocks)
    assert checkpoints.prefetched == (3 * 2 if mode == "pa_cpu" else 0)
    # Pa+cpu's host traffic: every block input (2 x 16 x 32 fp32) to the host and back, 3 steps
    assert checkpoints.host_traffic_bytes == (3 * 3 * 2 * (2 * 16 * 32 * 4) if mode == "pa_cpu" else 0)
    held = arena.buffer.numel() * arena.buffer.element_size()
    assert (checkpoints.host_bytes if mode == "pa_cpu" else checkpoints.device_bytes) == held


def test_arena_never_hands_out_a_slot_in_use():
    """Two graphs alive at once (a second forward before the first backward), a retained graph, a
    longer input: each checkpoint that cannot have a free slot of its size gets its own tensor."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    other = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    reference, _ = _model(False)
    model, checkpoints = _model(True)
    arena = checkpoints.arena
    for m in (reference, model):
        first, second = m(tokens), m(other)
        (first + 2 * second).backward()
    assert arena.misses == 3 and arena.taken == [False] * 3
    assert all(torch.equal(a, b) for a, b in zip(_grads(reference), _grads(model)))
    loss = model(tokens)
    loss.backward(retain_graph=True)                      # the graph keeps its slots
    assert arena.taken == [True] * 3
    model(other)                                          # so this forward misses, and drops its graph
    assert arena.misses == 6 and arena.taken == [True] * 3
    del loss
    assert arena.taken == [False] * 3
    model(torch.randint(0, 64, (4, 16))).backward()       # twice the input: a new, larger buffer
    assert (arena.allocations, arena.slot_numel) == (2, 4 * 16 * 32)
