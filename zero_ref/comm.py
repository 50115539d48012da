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
from datetime import timedelta

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


class CollectiveError(RuntimeError):
    """A collective failed or did not finish in time: another rank has probably died, raised, or
    taken a different path through the program."""


class Pending:
    """A collective in flight. `wait()` blocks at most `timeout_s` seconds (None: no bound of our
    own, the process group's timeout and watchdog apply), then raises CollectiveError."""

    def __init__(self, work, what: str, rank: int, timeout_s: float | None):
        self.work, self.what, self.rank, self.timeout_s = work, what, rank, timeout_s

    def wait(self) -> None:
        try:
            if self.timeout_s is None:
                self.work.wait()
            else:
                self.work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as err:
            bound = f" within {self.timeout_s:g} s" if self.timeout_s is not None else ""
            raise CollectiveError(
                f"rank {self.rank}: {self.what} did not complete{bound}: another rank has probably died, "
                f"raised, or diverged ({str(err).splitlines()[0][:300]})") from err


class Comm:
    """Collectives on one process group, each counted in the ledger.

    No collective may hang for ever: on gloo, the engine talks on its own process group over the
    same ranks, created with `timeout_s`, so that gloo itself abandons any collective (synchronous
    or not) that a dead or stuck peer never joins; and every collective is issued asynchronously
    and waited on through `Pending`, which turns the failure into a CollectiveError naming the
    collective. On NCCL the given group is used as it is and its own timeout and watchdog apply.
    With `async_op=True` the caller gets the `Pending` handle to wait on later; otherwise the call
    waits before returning. Reductions average over the group (ReduceOp.AVG), as DDP averages
    gradients.
    """

    def __init__(self, group: dist.ProcessGroup | None, ledger: CommLedger, timeout_s: float | None = 300.0):
        self.ledger = ledger
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self.timeout_s = None if backend == "nccl" else timeout_s
        if self.timeout_s is not None and backend == "gloo":   # not NCCL, not the fake test backend
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            group = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout_s), backend="gloo",
                                   use_local_synchronization=True)
        self.group = group

    def _issue(self, work, what: str, async_op: bool) -> Pending | None:
        pending = Pending(work, what, self.rank, self.timeout_s)
        if async_op:
            return pending
        pending.wait()
        return None

    def global_rank(self, group_rank: int) -> int:
        """The rank in the default group of this group's rank `group_rank` (for src arguments)."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def all_reduce_avg(self, tensor: torch.Tensor, async_op: bool = False, in_step: bool = True):
        self.ledger.record("all_reduce", 2 * tensor.numel(), in_step)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        return self._issue(work, f"all_reduce of {tensor.numel()} elements", async_op)

    def all_reduce_sum(self, tensor: torch.Tensor, in_step: bool = True) -> None:
        self.ledger.record("all_reduce", 2 * tensor.numel(), in_step)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._issue(work, f"all_reduce of {tensor.numel()} elements", async_op=False)

    def reduce_scatter_avg(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """Average `full` (identical shape on every rank) over the group; rank r receives chunk r of
        the result in `output`. `output` may be rank r's own chunk of `full` (in place)."""
        self.ledger.record("reduce_scatter", full.numel())
        work = _reduce_scatter(output, full, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        return self._issue(work, f"reduce_scatter of {full.numel()} elements", async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   in_step: bool = True):
        """Concatenate every rank's `shard` into `full`; `shard` may be this rank's chunk of `full`."""
        self.ledger.record("all_gather", full.numel(), in_step)
        work = _all_gather(full, shard, group=self.group, async_op=True)
        return self._issue(work, f"all_gather of {full.numel()} elements", async_op)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0, in_step: bool = True) -> None:
        """Broadcast from group rank `src_rank`."""
        self.ledger.record("broadcast", tensor.numel(), in_step)
        work = dist.broadcast(tensor, src=self.global_rank(src_rank), group=self.group, async_op=True)
        self._issue(work, f"broadcast of {tensor.numel()} elements", async_op=False)

    def all_gather_object(self, obj) -> list:
        """Python objects from every rank (set-up checks only; not counted as training traffic)."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered
