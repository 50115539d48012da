"""gloo's workarounds, in one place: what the CPU backend needs that NCCL does not.

* A reduce-scatter: gloo's own all-reduces the whole buffer and keeps one chunk, moving twice and
  summing world_size times what a reduce-scatter needs (4 ranks, 786,432 fp32 elements: 8.5 ms
  against 4.5 ms for this, medians of 30, torch 2.13). Here it is one all-to-all and a local sum
  (`reduce_scatter_by_all_to_all`); the element counter below the engine
  (analysis/collective_count.py) is told that this all-to-all is a reduce-scatter (`counted_as`).
* Completion: gloo's own reduce-scatter never reports it before a wait (`Work.is_completed()` stays
  False, torch 2.13); its all-to-all does, so stage 3's reducer can poll the reductions in flight
  without a waiting thread (in_flight.Pending.settle).
* An fp16 average: gloo sums in fp16 before dividing, so gradients whose mean fits fp16 overflowed at
  world 2 (a loss-scaled 2 * 16384). The all-reduce divides first, as torch's DDP does
  (`divide_first`); the reduce-scatter sums in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist

_counted_kind: ContextVar[str | None] = ContextVar("zero_ref_counted_kind", default=None)


@contextmanager
def counted_as(kind: str):
    """Count the collectives issued inside the block (on this thread) as `kind`, the collective
    they carry out; their elements are counted by their own rule."""
    token = _counted_kind.set(kind)
    try:
        yield
    finally:
        _counted_kind.reset(token)


def counted_kind() -> str | None:
    """The kind the collectives issued now count as (`counted_as`), or None: their own."""
    return _counted_kind.get()


def divide_first(tensor: torch.Tensor, world_size: int) -> dist.ReduceOp:
    """Divide `tensor` by the world size in place; the average is then the all-reduce's SUM."""
    tensor.div_(world_size)
    return dist.ReduceOp.SUM


def reduce_scatter_by_all_to_all(output: torch.Tensor, full: torch.Tensor, group, world_size: int):
    """Rank r receives chunk r of every rank's `full` in one all-to-all (n elements in, n out, as the
    paper counts a reduce-scatter) and, once the wait returns, sums those rows in rank order into
    `output` and divides by the world size. The receive buffer, as large as `full`, lives until then
    and is freed there. Returns (work, what to run after the wait)."""
    received = torch.empty_like(full)   # row j: rank j's chunk r
    with counted_as("reduce_scatter"):
        work = dist.all_to_all_single(received, full, group=group, async_op=True)

    def average():
        rows = received.view(world_size, -1)
        if output.dtype == torch.float16:   # the sum of values whose mean fits fp16 may not: sum in fp32
            output.view(-1).copy_(rows.sum(dim=0, dtype=torch.float32).div_(world_size))
        else:
            torch.sum(rows, dim=0, out=output.view(-1))
            output.div_(world_size)
        # free it now: gloo's worker thread still holds the tensor for a moment after the wait
        # returns (measured: 10-15% of calls), which made a rank's bytes depend on timing
        received.untyped_storage().resize_(0)
    return work, average
