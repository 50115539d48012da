"""The collectives zero-ref calls, on separate channels, and the ledger that counts what they move.

Collectives pair up by their position on one process group, so sequences that may interleave
differently on different ranks get groups of their own over the same ranks (*channels*, created once
per parent group, backend and timeout: `_channel_groups`):

    reduce      gradient reductions and every other collective that moves model data
    gather      stage 3's parameter gathers, which interleave with its reductions in an order that
                depends on each rank's backward (stages 0-2 use the reduce channel)
    control     a few integers or Python objects that keep ranks in step (gather rounds); gloo
    statistics  the step's vote (optim.GradStats), gloo on the host: it must never pair with a
                gradient bucket, also when one rank's backward raised and the others went on
    calls       opens each collective call training does not make (full_state_dict, checkpoints),
                so one made on some ranks only is caught (guard/strict.py); gloo

On gloo every collective is asynchronous and waited on for at most `timeout_s`, so a dead or stuck
peer becomes a CollectiveError, not a hang (in_flight.py); on NCCL a wait only makes the current
stream wait, and NCCL's watchdog enforces the timeout. A failed collective retires the channels
(`retire`). Over one rank data collectives are local copies. gloo's workarounds are in gloo.py.

The ledger counts elements moved per rank as the paper does (Sec 7): an all-reduce of n moves 2n,
a reduce-scatter, all-gather or broadcast of n moves n; control messages are not counted.
"""

from __future__ import annotations

import atexit
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from . import gloo
from .in_flight import CollectiveError, DoneLocally, Pending, SideStream
from .labels import label

# torch 2.13 renamed these; older releases (2.11 on the GPU machine) have only the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass
class CommLedger:
    """Elements moved per rank by collective kind: in the current step, the last one, and since the
    engine was built (`cumulative`, the only count of collectives outside training)."""

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


def _copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` takes ``src``'s values (a no-op when they are the same memory, as in place)."""
    if dst.data_ptr() != src.data_ptr() or dst.shape != src.shape:
        dst.view(-1).copy_(src.view(-1))


_CHANNELS: dict[tuple, tuple] = {}
"""(id of the parent group, data backend, timeout) -> (parent group, [reduce, gather, control, statistics, calls])."""
atexit.register(_CHANNELS.clear)   # release the groups while the interpreter is whole, not during teardown


def _channel_groups(parent: dist.ProcessGroup | None, backend: str, timeout_s: float
                    ) -> tuple[tuple, list[dist.ProcessGroup]]:
    """(cache key, [reduce, gather, control, statistics, calls] groups) over the ranks of `parent`,
    made by the first engine on those ranks and never destroyed (a re-created group would find its
    predecessor's rendezvous keys). Over some ranks only: `use_local_synchronization`; over every
    rank the ordinary way (named by the count of `new_group` calls, alike on every rank)."""
    parent = parent if parent is not None else dist.group.WORLD
    key = (id(parent), backend, timeout_s)
    if key not in _CHANNELS:
        ranks = dist.get_process_group_ranks(parent)
        timeout = timedelta(seconds=timeout_s)
        local = len(ranks) < dist.get_world_size()
        groups = [dist.new_group(ranks, timeout=timeout, backend=kind, use_local_synchronization=local)
                  for kind in (backend, backend, "gloo", "gloo", "gloo")]
        _CHANNELS[key] = (parent, groups)   # holding the parent keeps its id from being reused
    return key, _CHANNELS[key][1]


def backend_for(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend `group` uses for tensors on `device` ("gloo", "nccl", "fake", ...), or a
    ValueError saying why the group cannot serve that device."""
    config = dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else dist.get_backend(group)
    per_device = {}
    for part in str(config).split(","):
        kind, _, name = part.partition(":")
        if name:
            per_device[kind.strip()] = name.strip()
        else:   # a bare backend name serves the device types it supports
            per_device = {"cpu": kind.strip(), "cuda": kind.strip()}
    if "fake" in per_device.values():   # the at-scale studies: any device, meta included
        return "fake"
    name = per_device.get(device.type)
    supported = {"cpu": ("gloo", "fake"), "cuda": ("nccl", "fake")}
    if name not in supported.get(device.type, ()):
        raise ValueError(f"the process group ({config}) cannot run collectives on {device.type} tensors: the model "
                         f"is on {device}; use a group whose {device.type} backend is one of "
                         f"{supported.get(device.type, ())} (e.g. init_process_group('gloo') for CPU models, "
                         "'nccl' or 'cpu:gloo,cuda:nccl' for CUDA models)")
    return name


class Comm:
    """Collectives of one engine over the ranks of `group` on `device`, each counted in the ledger.
    Reductions average, as DDP does; `async_op=True` returns the `Pending` to wait on later.
    `gather_channel=True` gives parameter gathers their own group (stage 3)."""

    def __init__(self, group: dist.ProcessGroup | None, ledger: CommLedger, device: torch.device,
                 timeout_s: float = 300.0, gather_channel: bool = False):
        self.ledger = ledger
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = backend_for(group, device)
        self.alone = self.world_size == 1   # data collectives are local copies (at scale too: as a real rank)
        self.timeout_s = timeout_s if device.type == "cpu" else None   # NCCL: never block the host
        self.control_timeout_s = timeout_s                                # control: always gloo
        self._channels = None
        if self.backend == "fake":   # the at-scale studies: one fake group serves every channel
            self.reduce_group = self.gather_group = self.control_group = self.statistics_group = group
            self.calls_group = group
        else:
            data = "gloo" if device.type == "cpu" else str(dist.get_backend_config(group))
            self._channels, groups = _channel_groups(group, data, timeout_s)
            self.reduce_group, self.gather_group, self.control_group, self.statistics_group, self.calls_group = groups
            if not gather_channel:
                self.gather_group = self.reduce_group
        self.reduce_stream = SideStream(device)   # where reductions are waited on and followed up
        self.issued = 0                           # collectives started so far (their numbers in a trace)
        self.failed = False                       # a collective did not complete: see retire

    def retire(self) -> None:
        """A collective failed: later engines must not reuse these channels, and this engine cannot
        go on (`failed`): its ranks may be at different points of their sequences."""
        self.failed = True
        if self._channels is not None and self._channels in _CHANNELS \
                and _CHANNELS[self._channels][1][2] is self.control_group:
            del _CHANNELS[self._channels]

    # --- data collectives ---------------------------------------------------------------------------
    def _label_issue(self, kind: str, tensor: torch.Tensor):
        """Number the next collective and label the call that starts it (see the module docstring)."""
        self.issued += 1
        return label("zero_ref::issue", kind, f"#{self.issued}", tensor.numel(), tensor.numel() * tensor.element_size())

    def _issue(self, work, what: str, async_op: bool, then=None) -> Pending | None:
        pending = Pending(work, what, self.rank, self.timeout_s, self.retire, self.issued, then)
        if async_op:
            return pending
        pending.wait()
        return None

    def _global(self, group, group_rank: int) -> int:
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank

    def all_reduce(self, tensor: torch.Tensor, op: str = "avg", async_op: bool = False, in_step: bool = True):
        """Average (op="avg") or sum (op="sum") `tensor` over the group, in place."""
        self.ledger.record("all_reduce", 2 * tensor.numel(), in_step)
        reduce_op = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
        with self._label_issue("all_reduce", tensor):
            if self.alone:
                work = DoneLocally(self.device)
            else:
                if op == "avg" and self.backend == "gloo" and tensor.dtype == torch.float16:
                    reduce_op = gloo.divide_first(tensor, self.world_size)
                work = dist.all_reduce(tensor, op=reduce_op, group=self.reduce_group, async_op=True)
        return self._issue(work, f"all_reduce of {tensor.numel()} elements", async_op)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False):
        """Average `full` (same shape on every rank) over the group; rank r receives chunk r in
        `output`, which may be its own chunk of `full`. On gloo: an all-to-all and a local sum (gloo.py)."""
        self.ledger.record("reduce_scatter", full.numel())
        then = None
        with self._label_issue("reduce_scatter", full):
            if self.alone:
                _copy_unless_same(output, full)
                work = DoneLocally(self.device)
            elif self.backend == "gloo":
                work, then = gloo.reduce_scatter_by_all_to_all(output, full, self.reduce_group, self.world_size)
            else:
                work = _reduce_scatter(output, full, op=dist.ReduceOp.AVG, group=self.reduce_group, async_op=True)
        return self._issue(work, f"reduce_scatter of {full.numel()} elements", async_op, then)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False, in_step: bool = True,
                   channel: str = "reduce"):
        """Concatenate every rank's `shard` into `full`; `shard` may be this rank's chunk of `full`.
        `channel="gather"` issues it on the gather channel (stage 3's parameter gathers)."""
        self.ledger.record("all_gather", full.numel(), in_step)
        group = self.gather_group if channel == "gather" else self.reduce_group
        with self._label_issue("all_gather", full):
            if self.alone:
                _copy_unless_same(full, shard)
                work = DoneLocally(self.device)
            else:
                work = all_gather_tensor(full, shard, group=group, async_op=True)
        return self._issue(work, f"all_gather of {full.numel()} elements", async_op)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0, in_step: bool = True) -> None:
        """Broadcast from group rank `src_rank`."""
        self.ledger.record("broadcast", tensor.numel(), in_step)
        with self._label_issue("broadcast", tensor):
            if self.alone:
                return
            work = dist.broadcast(tensor, src=self._global(self.reduce_group, src_rank), group=self.reduce_group,
                                  async_op=True)
        self._issue(work, f"broadcast of {tensor.numel()} elements", async_op=False)

    # --- control messages ---------------------------------------------------------------------------
    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of `len(values)` integers (the same length on every rank), in rank order.
        A fake group returns this rank's values for every rank."""
        mine = torch.tensor(values, dtype=torch.int64)
        gathered = mine.repeat(self.world_size)
        with self._label_issue("control", gathered):
            work = all_gather_tensor(gathered, mine, group=self.control_group, async_op=True)
        Pending(work, "control exchange", self.rank, self.control_timeout_s, self.retire, self.issued).wait()
        return gathered.view(self.world_size, len(values)).tolist()

    def statistics(self, stats: torch.Tensor, op: str = "sum") -> None:
        """All-reduce the step's vote over the group, in place (`op`: "sum" or "max"), on the
        statistics channel, in host memory (a GPU's values are copied to the host first, where the
        step reads them anyway). Counted in the ledger as the all-reduce it is."""
        self.ledger.record("all_reduce", 2 * stats.numel())
        with self._label_issue("all_reduce", stats):
            if self.alone:
                return
            host = stats if stats.device.type in ("cpu", "meta") else stats.cpu()
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            work = dist.all_reduce(host, op=reduce_op, group=self.statistics_group, async_op=True)
        Pending(work, f"all_reduce ({op}) of {stats.numel()} step statistics", self.rank, self.control_timeout_s,
                self.retire, self.issued).wait()
        if host is not stats:
            stats.copy_(host)

    def all_gather_object(self, obj) -> list:
        """Python objects from every rank, on the control channel (not counted as training traffic).
        A fake group returns this rank's object for every rank (without pickling it world_size times)."""
        if self.backend == "fake":
            return [obj] * self.world_size
        gathered = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj, group=self.control_group)
        except RuntimeError as err:
            self.retire()
            raise CollectiveError(f"rank {self.rank}: an exchange of Python objects did not complete: another rank "
                                  f"has probably died, raised, or diverged ({str(err).splitlines()[0][:300]})") from err
        return gathered
