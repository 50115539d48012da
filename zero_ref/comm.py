"""The collectives zero-ref calls, and the ledger that counts what they move.

Every collective of the engine goes through `Comm`, which calls torch.distributed's functional API
on one process group and records the elements moved per rank the way the paper counts them
(Sec 7): an all-reduce of n elements moves 2n (it is a reduce-scatter plus an all-gather); a
reduce-scatter or an all-gather of a full buffer of n elements moves n; a broadcast of n moves n.

torch 2.13 renamed `reduce_scatter_tensor`/`all_gather_into_tensor` to `reduce_scatter_single`/
`all_gather_single`; older releases (the GPU machine runs 2.11) only have the old names. The choice
is made once, here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass
class CommLedger:
    """Elements moved per rank, by collective kind: during the current step, the last finished step,
    and since the engine was built. Collectives made outside training (state dicts, set-up) count
    only in `cumulative`."""

    current: Counter = field(default_factory=Counter)
    last_step: Counter = field(default_factory=Counter)
    cumulative: Counter = field(default_factory=Counter)

    def record(self, kind: str, elements: int, in_step: bool = True) -> None:
        if in_step:
            self.current[kind] += elements
        self.cumulative[kind] += elements

    def close_step(self) -> None:
        """Called at the end of each optimizer step: the current counts become `last_step`."""
        self.last_step, self.current = self.current, Counter()

    def stats(self) -> dict[str, dict[str, int]]:
        def table(counter: Counter) -> dict[str, int]:
            row = {kind: int(counter[kind]) for kind in KINDS}
            row["total"] = sum(row.values())
            return row

        return {"last_step": table(self.last_step), "cumulative": table(self.cumulative)}


class Comm:
    """Collectives on one process group, each counted in the ledger.

    `async_op=True` returns the torch Work handle (call `.wait()`), otherwise None. Reductions
    average over the group (ReduceOp.AVG), as DDP averages gradients.
    """

    def __init__(self, group: dist.ProcessGroup | None, ledger: CommLedger):
        self.group = group
        self.ledger = ledger
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def global_rank(self, group_rank: int) -> int:
        """The rank in the default group of this group's rank `group_rank` (for src arguments)."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False, in_step: bool = True):
        self.ledger.record("all_reduce", 2 * tensor.numel(), in_step)
        return dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group, async_op=async_op)

    def all_reduce_sum(self, tensor: torch.Tensor, in_step: bool = True) -> None:
        self.ledger.record("all_reduce", 2 * tensor.numel(), in_step)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def all_reduce_max(self, tensor: torch.Tensor, in_step: bool = True) -> None:
        self.ledger.record("all_reduce", 2 * tensor.numel(), in_step)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)

    def reduce_scatter_avg(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """Average `full` (identical shape on every rank) over the group; rank r receives chunk r of
        the result in `output`. `output` may be rank r's own chunk of `full` (in place)."""
        self.ledger.record("reduce_scatter", full.numel())
        return _reduce_scatter(output, full, op=dist.ReduceOp.AVG, group=self.group, async_op=async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   in_step: bool = True):
        """Concatenate every rank's `shard` into `full`; `shard` may be this rank's chunk of `full`."""
        self.ledger.record("all_gather", full.numel(), in_step)
        return _all_gather(full, shard, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0, in_step: bool = True) -> None:
        """Broadcast from group rank `src_rank`."""
        self.ledger.record("broadcast", tensor.numel(), in_step)
        dist.broadcast(tensor, src=self.global_rank(src_rank), group=self.group)

    def all_gather_object(self, obj) -> list:
        """Python objects from every rank (set-up checks only; not counted as training traffic)."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered
