"""Knowing when a bucket's gradients are complete, and reducing buckets in the same order on every rank.

Autograd calls a parameter's post-accumulate-grad hook once per backward, after every use of the
parameter has contributed to its `.grad` (uses of one parameter share one AccumulateGrad node). The
stage copies that gradient into its flat buffer, drops `.grad`, and tells `GroupArrivals`. When a
group's last parameter has arrived, the group is ready to be reduced.

Collectives must be issued in the same order on every rank, or they pair up wrongly. So a ready
group is launched only once every group before it in a fixed launch order has been launched; a
group that waits for an earlier one is launched as soon as that one is. At the end of backward,
`flush` launches whatever is left (groups holding parameters that got no gradient this time, for
which the buffer simply holds zeros), again in order.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .partition import FlatGroup


class GroupArrivals:
    """Per-group arrival counting and in-order launching for one backward pass.

    Args:
        groups: the flat groups.
        launch: called with a group index to start that group's reduction.
        order: the launch order (group indices); group index order by default.
    """

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
            name = tuple(self.groups[g].params[i].shape)
            raise RuntimeError(
                f"a gradient for a parameter of shape {name} in group {g} arrived after that group was "
                "reduced: a parameter's gradient was produced twice in one backward (e.g. by a second "
                "autograd.backward call before engine.step)")
        if not self.arrived[g][i]:
            self.arrived[g][i] = True
            self.missing[g] -= 1
        self._advance()

    def _advance(self) -> None:
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


def register_grad_hooks(groups: Sequence[FlatGroup], on_grad: Callable[[int, int, nn.Parameter], None]
                        ) -> list[RemovableHandle]:
    """Call `on_grad(g, i, param)` after autograd has accumulated the gradient of param i of group g."""
    handles = []
    for group in groups:
        for i, param in enumerate(group.params):
            handles.append(param.register_post_accumulate_grad_hook(partial(on_grad, group.index, i)))
    return handles


class ShardedGradBuckets:
    """Gradient buckets that live only while they fill and reduce (stages 2 and 3).

    `add(g, i, grad)` copies a parameter's gradient into group g's bucket buffer, allocated zeroed
    on first use. `reduce_scatter(g)` averages the bucket over the group in place and, once done,
    adds chunk `rank` into `grad_shards[g]` and frees the buffer. With `overlap`, at most
    `max_in_flight` reductions run while backward goes on; `drain()` finishes them all. So
    gradient memory is the shard plus a constant number of buckets, whatever the model size.
    """

    def __init__(self, comm, groups, grad_shards: list, dtype, device, overlap: bool, max_in_flight: int = 2):
        self.comm, self.groups, self.grad_shards = comm, groups, grad_shards
        self.dtype, self.device = dtype, device
        self.max_in_flight = max_in_flight if overlap else 0
        self.overlap = overlap
        self.filling: dict = {}      # group -> bucket buffer being filled
        self.in_flight = deque()     # (group, bucket buffer, pending reduce-scatter)

    def _bucket(self, g: int):
        if g not in self.filling:
            self.filling[g] = torch.zeros(self.groups[g].padded_numel, dtype=self.dtype, device=self.device)
        return self.filling[g]

    def add(self, g: int, i: int, grad) -> None:
        start = self.groups[g].offsets[i]
        self._bucket(g)[start:start + grad.numel()].add_(grad.reshape(-1))

    def reduce_scatter(self, g: int) -> None:
        """Launch group g's reduction (a group with no gradient this time reduces zeros)."""
        bucket = self._bucket(g)
        del self.filling[g]
        lo, hi = self.groups[g].shard_range(self.comm.rank)
        pending = self.comm.reduce_scatter_avg(bucket[lo:hi], bucket, async_op=self.overlap)
        self.in_flight.append((g, bucket, pending))
        self.drain(self.max_in_flight)

    def drain(self, keep: int = 0) -> None:
        """Finish reductions until at most `keep` are in flight, adding each result into its shard."""
        while len(self.in_flight) > keep:
            g, bucket, pending = self.in_flight.popleft()
            if pending is not None:
                pending.wait()
            lo, hi = self.groups[g].shard_range(self.comm.rank)
            self.grad_shards[g].add_(bucket[lo:hi])

    def live(self) -> list:
        """The bucket buffers alive now (for memory accounting)."""
        return [*self.filling.values(), *(bucket for _, bucket, _ in self.in_flight)]


class FullGradBuckets:
    """A full flat gradient buffer whose buckets are reduced at the last micro-batch (stages 0, 1).

    Gradients of every micro-batch are added into `bucket(g)` (views of one flat buffer that lives
    for the whole run). On the micro-batch that ends a step, each bucket is handed to `reduce(g)`,
    which starts its collective and returns the pending handle, as soon as the bucket is complete
    and in the same order on every rank; at most `max_in_flight` run at once (gloo stages a copy
    of each input). `end_backward` launches what is left and waits for all of them.
    """

    def __init__(self, groups, bucket: Callable[[int], torch.Tensor], reduce: Callable[[int], object],
                 max_in_flight: int = 2):
        self.groups, self.bucket, self.reduce = groups, bucket, reduce
        self.max_in_flight = max_in_flight
        self.arrivals = GroupArrivals(groups, self._launch)
        self.boundary = True
        self.in_flight = deque()

    def add(self, g: int, i: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook body: accumulate the gradient, drop `.grad`, count it."""
        start = self.groups[g].offsets[i]
        self.bucket(g)[start:start + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None
        if self.boundary:
            self.arrivals.arrive(g, i)

    def _launch(self, g: int) -> None:
        pending = self.reduce(g)
        if pending is not None:
            self.in_flight.append(pending)
            while len(self.in_flight) > self.max_in_flight:
                self.in_flight.popleft().wait()

    def begin_backward(self, boundary: bool) -> None:
        self.boundary = boundary
        self.arrivals.reset()

    def end_backward(self, boundary: bool) -> None:
        if not boundary:
            return   # gradients keep accumulating locally until the last micro-batch
        self.arrivals.flush()
        while self.in_flight:
            self.in_flight.popleft().wait()
