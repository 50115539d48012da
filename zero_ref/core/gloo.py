"""gloo's workarounds, in one place: what the CPU backend needs that NCCL does not.

* Reduce-scatter: gloo's all-reduces the whole buffer and keeps one chunk (4 ranks, 786,432 fp32
  elements: 8.5 ms against 4.5 ms for this). Here it is one all-to-all and a local sum, which also
  reports completion without a wait (gloo's own never does), so stage 3 can poll its reductions.
  The element counter (analysis/collective_count.py) counts that all-to-all as a reduce-scatter.
* fp16 average: gloo sums in fp16 before dividing, which overflowed at world 2; the all-reduce
  divides first, as DDP does, and the reduce-scatter sums in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist

_counted_kind: ContextVar[str | None] = ContextVar("zero_ref_counted_kind", default=None)


@contextmanager
def counted_as(kind: str):
    """Count the collectives issued inside the block (this thread) as `kind`, the one they carry out."""
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
    """Rank r receives chunk r of every rank's `full` in one all-to-all and, after the wait, sums the
    rows in rank order into `output` and divides by the world size. Returns (work, that sum)."""
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
