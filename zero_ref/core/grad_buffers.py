"""Where gradients live while they are accumulated and reduced.

`FullGradBuffer` (stages 0 and 1): one flat buffer of the whole model, alive for the whole run.
`ShardedGradBuckets` (stages 2 and 3): buffers of at most one bucket taken from a `BucketPool`
while a group fills and reduces, then given back (a larger group is reduced in bucket-size
pieces); only this rank's reduced shard stays.

In both, a parameter's `.grad` is a view of its range in the buffer whenever the buffer has the
parameter's dtype, so autograd accumulates straight into it: no per-parameter copy, no allocation
per step. With `reduce_dtype="fp32"` under bf16/fp16 the dtypes differ: autograd's gradient is
added into the fp32 buffer and dropped (the cost of accumulating in fp32).

Reductions are launched on the communication side stream (`comm.reduce_stream`, CUDA only) and
waited on there, so the compute stream never stalls behind one; `end_backward`/`drain` makes the
compute stream wait once, at the end of backward.

Profiler labels (labels.py): "zero_ref::reduce bucket <g>" where a bucket's reduction starts,
and for stages 2-3 "zero_ref::take bucket <g>" where a bucket gets its buffer from the pool and
"zero_ref::reduced bucket <g>" where its reduced chunk is added into the shard and the buffer goes
back.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Callable, Sequence

import torch
from torch import nn

from .labels import label
from .grad_hooks import GroupArrivals
from .partition import FlatGroup, GroupLayout


def _points_at(param: nn.Parameter, view: torch.Tensor) -> bool:
    grad = param.grad
    if grad is None or grad.data_ptr() != view.data_ptr():
        return False
    if grad.is_meta:             # every meta tensor's data_ptr() is 0: compare storage and offset
        return (grad.untyped_storage()._cdata == view.untyped_storage()._cdata
                and grad.storage_offset() == view.storage_offset())
    return True


class FullGradBuffer:
    """A full flat gradient buffer, one slice per bucket (stages 0 and 1).

    Gradients of every micro-batch accumulate here. On a micro-batch that ends a step, each bucket
    is handed to `reduce(g)` (which starts its collective and returns the pending handle) as soon as
    it is complete and in the same order on every rank, with at most `max_in_flight` reductions in
    flight (gloo stages a copy of each input); `end_backward` launches what is left and waits.
    """

    def __init__(self, layout: GroupLayout, dtype: torch.dtype, device: torch.device, comm,
                 reduce: Callable[[int], object], max_in_flight: int = 2):
        self.layout, self.comm, self.reduce = layout, comm, reduce
        self.max_in_flight = max_in_flight
        self.flat = torch.zeros(layout.full_numel, dtype=dtype, device=device)
        self.views = {}
        for g, group in enumerate(layout.groups):
            bucket = layout.full_slice(self.flat, g)
            for param, start, end in group.param_ranges():
                self.views[id(param)] = bucket[start:end].view(param.shape)
        self.arrivals = GroupArrivals(layout.groups, self._launch)
        self.boundary = True
        self.in_flight: deque = deque()
        self.bind()

    def bucket(self, g: int) -> torch.Tensor:
        return self.layout.full_slice(self.flat, g)

    def bind(self) -> None:
        """Point every parameter's `.grad` at its range of the buffer (when the dtypes agree)."""
        for group in self.layout.groups:
            for param in group.params:
                view = self.views[id(param)]
                param.grad = view if view.dtype == param.dtype else None

    def add(self, g: int, i: int, param: nn.Parameter) -> None:
        """After-hook body: make sure the gradient is in the buffer, then count it."""
        view = self.views[id(param)]
        if not _points_at(param, view):   # fp32 reduction, or the user replaced or cleared `.grad`
            view.add_(param.grad.reshape(view.shape))
            param.grad = view if view.dtype == param.dtype else None
        if self.boundary:
            self.arrivals.arrive(g, i)

    def _launch(self, g: int) -> None:
        with label("zero_ref::reduce bucket", g), self.comm.reduce_stream.after_current():
            pending = self.reduce(g)
        if pending is not None:
            self.in_flight.append(pending)
            while len(self.in_flight) > self.max_in_flight:
                self._wait_oldest()

    def _wait_oldest(self) -> None:
        with self.comm.reduce_stream.on():
            self.in_flight.popleft().wait()

    def begin_backward(self, boundary: bool) -> None:
        self.boundary = boundary
        self.arrivals.reset()

    def end_backward(self, boundary: bool) -> None:
        if not boundary:
            return   # gradients keep accumulating locally until the last micro-batch
        self.arrivals.flush()
        while self.in_flight:
            self._wait_oldest()
        self.comm.reduce_stream.join()

    def zero(self) -> None:
        """Zero the buffer, once any reduction still writing into it has finished (a backward that
        raised may have left some in flight; they pair up with the other ranks', so they complete)."""
        if self.in_flight:
            while self.in_flight:
                self._wait_oldest()
            self.comm.reduce_stream.join()
        self.flat.zero_()


class BucketPool:
    """Bucket buffers reused across groups and backwards (the paper's constant-size buffers, CB).

    Every buffer has the same `buffer_numel` elements, so any free one serves any request and the
    pool holds exactly as many as were ever in use at once. `take(n)` returns a zeroed view of n
    elements of a free buffer (once the stream that last used it has finished with it) or of a new
    one; `give` returns it.
    """

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
    """Gradient buckets that exist only while a group fills and reduces (stages 2 and 3).

    Every buffer is at most `piece_numel` elements (rounded up to a multiple of Nd): the paper's
    constant-size buffers, whatever the size of a group.
    - A group that fits is one bucket: `bind(g)` (before-hook) takes it from the pool and points the
      group's `.grad` at it, so autograd accumulates there; `add` (after-hook) makes sure a gradient
      is in it. `reduce_scatter(g)` averages it over the ranks in place.
    - A larger group (stage 3's units, a big embedding at stage 2) is reduced in pieces: autograd
      keeps each parameter's gradient (`add` holds on to it) and `reduce_scatter(g)` copies columns
      [lo, lo + w) of every rank's shard into one buffer of Nd * w elements and reduce-scatters that,
      piece after piece; the gradients are dropped once copied.
    Once a reduction is done, this rank's chunk is added into `grad_shards[g]` and the buffer goes
    back to the pool. With `may_block`, at most `max_in_flight` reductions run while backward goes on
    (older ones are waited for; by default one reduces while the next buffer fills: two buffers);
    without it (stage 3 on gloo, where an unbounded host wait could deadlock against a peer that
    first needs a parameter gather from this rank, or a gather round) every reduction is issued
    asynchronously, even without `overlap`; finished reductions are harvested as gradients
    arrive (`harvest`), a launch past `max_in_flight` (0 without `overlap`) waits at most
    `patience_s` for the oldest (after one such wait runs out, none more until `drain`), and
    `drain()` waits for the rest. So the buffers stay at max_in_flight + 1 unless a reduction takes longer than
    `patience_s` (ranks out of step, a very slow link).
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
            if not _points_at(param, view):
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
            # without may_block even overlap=False must not wait unboundedly inside the call: a peer
            # whose data left this group's gradients out reduces it only after the backward's last
            # gather round, which this rank must reach first. It waits below, bounded, instead
            pending = self.comm.reduce_scatter(self._own_chunk(buffer), buffer,
                                               async_op=self.overlap or not self.may_block)
        self.in_flight.append((g, lo, buffer, pending))
        if self.may_block:
            while len(self.in_flight) > self.max_in_flight:
                self._finish_oldest()
        else:
            self.harvest()
            # Give the oldest reduction a moment to finish, so that its buffer is reused rather than
            # a new one made; never longer than `patience_s`, so a peer that first needs a gather
            # from this rank gets it. A wait that runs out means the ranks are not in step (their
            # data chose other module orders): no more waiting until this backward ends.
            while self.patient and len(self.in_flight) > self.max_in_flight and self.in_flight[0][3] is not None:
                if not self.in_flight[0][3].settle(self.patience_s):
                    self.patient = False
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
        """Forget a backward that did not finish (engine.backward raised, then engine.zero_grad):
        wait for the reductions it launched (they pair up with the other ranks'), give every buffer
        back and drop the gradients held or half accumulated, adding nothing into the shards."""
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
