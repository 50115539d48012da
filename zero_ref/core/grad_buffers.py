"""Gradient hooks, and where gradients live while they are reduced (stages 2-3; stages 0-1 keep
a full buffer: bucketed.py).

Every trainable parameter gets two autograd hooks (`register_grad_hooks`): *before* runs just
before autograd adds a gradient into `param.grad` (stages 2-3 point `.grad` at the parameter's
range in a bucket first, so autograd accumulates straight into it); *after* runs once every use
of the parameter in this backward has been accumulated, and tells `GroupArrivals`.

Collectives pair up by position, so a group whose gradients are complete is launched only after
every group before it in a launch order all ranks share; `flush` launches the rest at the end of
backward. Gradients may arrive in any order on each rank; only the launch order agrees.

`ShardedGradBuckets` takes buffers of at most one bucket from a `BucketPool` (the paper's CB) while
a group fills and reduces; only this rank's reduced shard stays. Reductions run on the side stream
(CUDA); the compute stream waits once, at the end of backward.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .labels import label
from .partition import FlatGroup


def points_at(param: nn.Parameter, view: torch.Tensor) -> bool:
    grad = param.grad
    if grad is None or grad.data_ptr() != view.data_ptr():
        return False
    if grad.is_meta:             # every meta tensor's data_ptr() is 0: compare storage and offset
        return (grad.untyped_storage()._cdata == view.untyped_storage()._cdata
                and grad.storage_offset() == view.storage_offset())
    return True


class GroupArrivals:
    """Counts each group's gradient arrivals in one backward and calls `launch(g)` in `order` (group
    indices, the same on every rank; index order by default)."""

    def __init__(self, groups: Sequence[FlatGroup], launch: Callable[[int], None],
                 order: Sequence[int] | None = None):
        self.groups = groups
        self.launch = launch
        self.order = list(order) if order is not None else list(range(len(groups)))
        self.reset()

    def reset(self) -> None:
        """Forget the previous backward."""
        self.arrived = [[False] * len(g.params) for g in self.groups]
        self.missing = [len(g.params) for g in self.groups]
        self.launched = [False] * len(self.groups)
        self.position = 0

    def set_order(self, order: Sequence[int]) -> None:
        self.order = list(order)

    def arrive(self, g: int, i: int) -> None:
        """Parameter i of group g has its gradient for this backward."""
        if self.launched[g]:
            shape = tuple(self.groups[g].params[i].shape)
            raise RuntimeError(
                f"a gradient for a parameter of shape {shape} in group {g} arrived after that group was "
                "reduced: a parameter's gradient was produced twice in one backward. Reentrant activation "
                "checkpointing does this (torch.utils.checkpoint(..., use_reentrant=True) runs a backward of "
                "its own per checkpoint, so a parameter used in two checkpoints, or inside and outside one, "
                "gets two gradients): use use_reentrant=False")
        if not self.arrived[g][i]:
            self.arrived[g][i] = True
            self.missing[g] -= 1
        while self.position < len(self.order) and self.missing[self.order[self.position]] == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        g = self.order[self.position]
        self.position += 1
        self.launched[g] = True
        self.launch(g)

    def flush(self) -> None:
        """Launch every group not launched yet, in order."""
        while self.position < len(self.order):
            self._launch_next()


def register_grad_hooks(params: Sequence[nn.Parameter], after: Callable[[nn.Parameter], None],
                        before: Callable[[nn.Parameter], None] | None = None) -> list[RemovableHandle]:
    """Call `before(param)` just before autograd accumulates a gradient into `param.grad` (if given)
    and `after(param)` once it has accumulated all of this backward's uses of `param`."""
    handles = []
    for param in params:
        if before is not None:
            handles.append(param.register_hook(lambda grad, p=param: before(p)))
        handles.append(param.register_post_accumulate_grad_hook(after))
    return handles


class BucketPool:
    """Bucket buffers of `buffer_numel` elements reused across groups and backwards (CB): the pool
    holds as many as were ever in use at once. `take(n)` returns a zeroed view of n elements of a
    free buffer (once its last stream is done with it) or of a new one; `give` returns it."""

    def __init__(self, buffer_numel: int, dtype: torch.dtype, device: torch.device):
        self.buffer_numel, self.dtype, self.device = buffer_numel, dtype, device
        self.buffers: list[torch.Tensor] = []
        self.free: list[tuple[torch.Tensor, object]] = []   # (buffer, event of its last use or None)

    def take(self, numel: int) -> torch.Tensor:
        if numel > self.buffer_numel:
            raise ValueError(f"a bucket of {numel} elements does not fit the pool's {self.buffer_numel}")
        if self.free:
            buffer, event = self.free.pop()
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        else:
            buffer = torch.empty(self.buffer_numel, dtype=self.dtype, device=self.device)
            self.buffers.append(buffer)
        return buffer[:numel].zero_()

    def give(self, view: torch.Tensor, event=None) -> None:
        storage = view.untyped_storage()._cdata      # not data_ptr(): every meta tensor's is 0
        buffer = next(b for b in self.buffers if b.untyped_storage()._cdata == storage)
        self.free.append((buffer, event))


class ShardedGradBuckets:
    """Gradient buckets that exist only while a group fills and reduces (stages 2 and 3), each at
    most `piece_numel` elements (a multiple of Nd): the paper's CB, whatever a group's size.

    - A group that fits is one bucket: `bind(g)` (before-hook) points `.grad` into it, `add`
      (after-hook) makes sure a gradient is in it, `reduce_scatter(g)` averages it in place.
    - A larger group is reduced in pieces: `add` holds each gradient, `reduce_scatter(g)` copies
      columns [lo, lo + w) of every rank's shard into a buffer of Nd * w and reduce-scatters that.
    A finished reduction adds this rank's chunk into `grad_shards[g]` and gives the buffer back.
    With `may_block`, at most `max_in_flight` reductions run during backward. Without it (stage 3 on
    gloo, where a blocking wait could deadlock against a peer needing a gather from this rank) done
    ones are `harvest`ed as gradients arrive, and a launch past `max_in_flight` waits at most
    `patience_s` for the oldest (halved, to 10 ms at least, each time it runs out); `drain` waits.
    """

    def __init__(self, comm, groups: Sequence[FlatGroup], grad_shards: list[torch.Tensor], dtype: torch.dtype,
                 device: torch.device, overlap: bool, piece_numel: int, may_block: bool = True,
                 max_in_flight: int = 1, patience_s: float = 0.2):
        self.comm, self.groups, self.grad_shards = comm, groups, grad_shards
        self.piece_width = max(1, -(-piece_numel // comm.world_size))   # columns of each shard per piece
        largest = max((group.padded_numel for group in groups), default=0)
        self.pool = BucketPool(min(largest, self.piece_width * comm.world_size), dtype, device)
        self.overlap, self.may_block = overlap, may_block
        self.max_in_flight = max_in_flight if overlap else 0
        self.patience_s = patience_s
        self.patient = True                   # False once a wait of this backward ran out
        self.filling: dict[int, torch.Tensor] = {}            # group -> its bucket while gradients arrive
        self.held: dict[int, dict[int, torch.Tensor]] = {}    # group in pieces -> {param index: gradient}
        self.in_flight: deque = deque()   # (group, first column, buffer, pending reduce-scatter)

    def in_pieces(self, g: int) -> bool:
        """Is group g larger than one buffer, so that it is reduced piece by piece?"""
        return self.groups[g].shard_numel > self.piece_width

    def _bucket(self, g: int) -> torch.Tensor:
        if g not in self.filling:
            with label("zero_ref::take bucket", g):
                self.filling[g] = self.pool.take(self.groups[g].padded_numel)
        return self.filling[g]

    def bind(self, g: int) -> None:
        """Before-hook body: point group g's `.grad` at its bucket, so autograd accumulates there
        (a group reduced in pieces has no bucket: autograd allocates its gradients)."""
        if g in self.filling or self.in_pieces(g):
            return
        bucket = self._bucket(g)
        for param, start, end in self.groups[g].param_ranges():
            if param.dtype == bucket.dtype:
                param.grad = bucket[start:end].view(param.shape)

    def add(self, g: int, i: int, param: nn.Parameter) -> None:
        """After-hook body: make sure param i's gradient is in group g's bucket (or, for a group in
        pieces, held until the group is reduced); drop `.grad`."""
        if self.in_pieces(g):
            self.held.setdefault(g, {})[i] = param.grad
        else:
            start = self.groups[g].offsets[i]
            view = self._bucket(g)[start:start + param.numel()]
            if not points_at(param, view):
                view.add_(param.grad.reshape(-1))
        param.grad = None

    def reduce_scatter(self, g: int) -> None:
        """Launch group g's reduction (a group with no gradient this time reduces zeros)."""
        for param in self.groups[g].params:   # nothing may write into the bucket any more
            param.grad = None
        if not self.in_pieces(g):
            bucket = self._bucket(g)
            del self.filling[g]
            self._launch(g, 0, bucket)
            return
        held, shard_numel = self.held.pop(g, {}), self.groups[g].shard_numel
        for lo in range(0, shard_numel, self.piece_width):
            width = min(self.piece_width, shard_numel - lo)
            with label("zero_ref::take bucket", g):
                piece = self.pool.take(width * self.comm.world_size)
            self._fill(g, held, lo, piece.view(self.comm.world_size, width))
            self._launch(g, lo, piece)

    def _fill(self, g: int, held: dict[int, torch.Tensor], lo: int, piece: torch.Tensor) -> None:
        """Copy columns [lo, lo + width) of every rank's shard of group g's gradients into `piece`
        (one row per rank); what no held gradient covers (padding, unused parameters) stays zero."""
        group, width = self.groups[g], piece.shape[1]
        offsets = group.offsets
        for rank, row in enumerate(piece):
            first = rank * group.shard_numel + lo          # the row's range in the group's flat buffer
            last = first + width
            i = max(bisect.bisect_right(offsets, first) - 1, 0)
            while i < len(offsets) and offsets[i] < last:
                grad = held.get(i)
                if grad is not None:
                    start = offsets[i]
                    a, b = max(first, start), min(last, start + grad.numel())
                    if a < b:
                        row[a - first:b - first].copy_(grad.reshape(-1)[a - start:b - start])
                i += 1

    def _own_chunk(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a bucket or piece: where its reduce-scatter result lands."""
        width = buffer.numel() // self.comm.world_size
        return buffer[self.comm.rank * width:(self.comm.rank + 1) * width]

    def _launch(self, g: int, lo: int, buffer: torch.Tensor) -> None:
        with label("zero_ref::reduce bucket", g), self.comm.reduce_stream.after_current():
            pending = self.comm.reduce_scatter(self._own_chunk(buffer), buffer,
                                               async_op=self.overlap or not self.may_block)
        self.in_flight.append((g, lo, buffer, pending))
        if self.may_block:
            while len(self.in_flight) > self.max_in_flight:
                self._finish_oldest()
        else:
            self.harvest()
            # let the oldest finish so its buffer is reused, bounded: a wait that runs out means the
            # ranks are not in step (other module orders), so no more waiting in this backward
            while self.patient and len(self.in_flight) > self.max_in_flight and self.in_flight[0][3] is not None:
                if not self.in_flight[0][3].settle(self.patience_s):
                    self.patient = False
                    self.patience_s = max(0.01, self.patience_s / 2)
                    break
                self.harvest()

    def harvest(self) -> None:
        """Finish the reductions that are already complete, oldest first (never blocks)."""
        while self.in_flight and (self.in_flight[0][3] is None or self.in_flight[0][3].done()):
            self._finish_oldest()

    def _finish_oldest(self, keep: bool = True) -> None:
        """Wait for the oldest reduction, add this rank's chunk into the shard (unless `keep` is
        False) and give its buffer back."""
        g, lo, buffer, pending = self.in_flight.popleft()
        with label("zero_ref::reduced bucket", g), self.comm.reduce_stream.on():
            if pending is not None:
                pending.wait()
            if keep:
                chunk = self._own_chunk(buffer)
                self.grad_shards[g][lo:lo + chunk.numel()].add_(chunk)
            self.pool.give(buffer, self.comm.reduce_stream.record_event())

    def drain(self, keep: bool = True) -> None:
        """Finish every reduction in flight; the compute stream then sees the reduced shards."""
        while self.in_flight:
            self._finish_oldest(keep)
        self.comm.reduce_stream.join()
        self.patient = True

    def discard(self) -> None:
        """Forget a backward that did not finish: wait for the reductions it launched (they pair up
        with the other ranks'), give every buffer back, drop held gradients, add nothing."""
        self.drain(keep=False)
        for g, bucket in self.filling.items():
            for param in self.groups[g].params:
                param.grad = None
            self.pool.give(bucket)
        self.filling.clear()
        self.held.clear()

    def buffers(self) -> list[torch.Tensor]:
        """The bucket buffers this object holds (for memory accounting)."""
        return list(self.pool.buffers)
