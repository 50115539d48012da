"""What stages 0-2 share: full parameters on every rank, packed into buckets in gradient-arrival order.

Every rank holds the model's parameters in one flat buffer (each parameter a view of its range),
cut into buckets of at most `bucket_numel` elements (CB). A bucket is reduced as soon as backward
has produced all its gradients, so reductions overlap the rest of backward; that needs buckets to
fill one after another. The first backward records the arrival order, the ranks agree on it (the
lowest rank's whose backward completed) and, if a bucket completed out of launch order, the stage
repacks (`relayout`, carrying gradients and optimizer state with `partition.move_state`), as DDP
rebuilds its buckets after the first iteration. Checkpoints store the learned order.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch import nn

from .comm import Comm
from ..config import ZeroConfig
from .grad_buffers import GroupArrivals, points_at, register_grad_hooks
from .labels import label
from .partition import GroupLayout, move_state, pack_into_buckets
from .stage_base import Stage, pieces_of


class BucketedStage(Stage):
    """Base of stages 0-2. Subclasses build layout, buffers and optimizer for an order (`_lay_out`)
    and handle gradients (`_on_grad`, `_end_backward`, `_grad_state`); `shard_states`: optimizer
    state sharded (stages 1-2); `binds_per_backward`: `.grad` points into a bucket per backward."""

    shard_states = True
    binds_per_backward = False

    def __init__(self, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm):
        super().__init__(trainable, config, comm)
        self.arrival_log: list[int] | None = []    # parameter indices in arrival order, until learned
        self.pending: list = []                    # all-gathers in flight (stages 1-2)
        self._lay_out(trainable[::-1])
        self.hooks = register_grad_hooks(trainable, self._after_grad,
                                         self._before_grad if self.binds_per_backward else None)

    def _set_layout(self, layout: GroupLayout) -> None:
        self.layout, self.groups = layout, layout.groups
        self.order = [p for group in layout.groups for p in group.params]
        self.slot = {id(p): (g, i) for g, group in enumerate(layout.groups) for i, p in enumerate(group.params)}

    # --- gradient hooks --------------------------------------------------------------------------
    def _before_grad(self, param: nn.Parameter) -> None:
        self.check_in_backward()
        self._bind(self.slot[id(param)][0])

    def _after_grad(self, param: nn.Parameter) -> None:
        self.check_in_backward()
        self.mark_used(param)
        if self.arrival_log is not None:
            self.arrival_log.append(self.index[id(param)])
        g, i = self.slot[id(param)]
        self._on_grad(g, i, param)

    def end_backward(self, boundary: bool, failed: bool = False) -> None:
        self._end_backward(boundary)
        if self.arrival_log is not None:
            self._learn_order(None if failed else self.arrival_log)

    def zero_grads(self, keep_used: bool = False) -> None:
        super().zero_grads(keep_used)
        if self.arrival_log:   # a first backward that raised: learn the order from a whole one
            self.arrival_log = []

    # --- the bucket order ------------------------------------------------------------------------
    def _learn_order(self, log: list[int] | None) -> None:
        """Agree on the first completed backward's arrival order (`log` None: this rank's raised) and
        repack if a bucket completed out of order."""
        logs = self.comm.all_gather_object(log) if self.world_size > 1 else [log]
        agreed = next((each for each in logs if each is not None), None)
        if agreed is None:
            self.arrival_log = []
            return
        self.arrival_log = None
        arrived = set(agreed)
        order = [self.trainable[k] for k in agreed] + [p for p in self.order if self.index[id(p)] not in arrived]
        if not self._completes_in_order(agreed):
            self.relayout(order)

    def _completes_in_order(self, arrivals: list[int]) -> bool:
        """Did the buckets complete one after another, in launch order, under `arrivals`?"""
        missing = [len(group.params) for group in self.groups]
        completed = []
        for k in arrivals:
            g = self.slot[id(self.trainable[k])][0]
            missing[g] -= 1
            if missing[g] == 0:
                completed.append(g)
        return completed == list(range(len(completed)))

    def learned_order(self) -> list[int] | None:
        """Parameter indices in bucket order once learned (for checkpoints), else None."""
        return None if self.arrival_log is not None else [self.index[id(p)] for p in self.order]

    def wants_order(self) -> bool:
        return self.arrival_log is not None

    def adopt_order(self, indices: list[int]) -> None:
        """Start in a checkpoint's learned order; the state is about to be overwritten."""
        self.arrival_log = None
        order = [self.trainable[k] for k in indices]
        if [id(p) for p in order] != [id(p) for p in self.order]:
            self.relayout(order, carry_state=False)

    def _pack(self, order: list[nn.Parameter]) -> GroupLayout:
        """Buckets of `order`, padded to a multiple of Nd when their state is sharded."""
        pad = self.world_size if self.shard_states else 1
        return GroupLayout(pack_into_buckets(order, self.config.bucket_numel, pad))

    def _range_in(self, group) -> tuple[int, int]:
        """This rank's segment of a bucket: its shard, or (stage 0) the whole bucket."""
        return group.shard_range(self.rank) if self.shard_states else (0, group.padded_numel)

    def segment_range(self, g: int) -> tuple[int, int]:
        return self._range_in(self.groups[g])

    def planned_pieces(self, order: list[int] | None):
        if order is None:
            return self.owned_pieces()
        groups = self._pack([self.trainable[k] for k in order]).groups
        return pieces_of(groups, lambda g: self._range_in(groups[g]))

    def relayout(self, order: list[nn.Parameter], carry_state: bool = True) -> None:
        """Pack the buckets in `order`, carrying parameters, gradients and optimizer state over."""
        old_layout = self.layout
        old = {"grads": self._grad_state(), **{k: (v, self.shard_states) for k, v in self.optimizer.flats().items()}}
        steps = self.optimizer.step_count, self.optimizer.param_steps
        self._lay_out(order)   # copies the parameters' current values into the new flat buffer
        self.optimizer.step_count, self.optimizer.param_steps = steps
        if not carry_state:
            return
        new = {"grads": self._grad_state(), **{k: (v, self.shard_states) for k, v in self.optimizer.flats().items()}}
        for kind, (old_flat, sharded) in old.items():
            if old_flat is not None:
                move_state(self.comm, old_layout, self.layout, old_flat, new[kind][0], sharded)

    # --- after the update: the parameters of the sharded stages ----------------------------------
    def segment_updated(self, g: int) -> None:
        """Stages 1-2: start gathering bucket g's updated parameters while the next segment updates."""
        if self.shard_states:
            with label("zero_ref::regather bucket", g):   # a profiler label only
                self.pending.append(self.comm.all_gather(
                    self.layout.full_slice(self.flat_params, g), self.layout.own_slice(self.flat_params, g, self.rank),
                    async_op=True))

    def after_update(self) -> None:
        self._wait_pending()

    def _wait_pending(self) -> None:
        while self.pending:
            self.pending.pop(0).wait()

    def param_buffer(self, g: int) -> torch.Tensor:
        return self.layout.full_slice(self.flat_params, g)

    # --- what subclasses provide -----------------------------------------------------------------
    def _lay_out(self, order: list[nn.Parameter]) -> None:
        raise NotImplementedError

    def _bind(self, g: int) -> None:
        """Point group g's `.grad` at its bucket before autograd accumulates (binds_per_backward)."""

    def _on_grad(self, g: int, i: int, param: nn.Parameter) -> None:
        raise NotImplementedError

    def _end_backward(self, boundary: bool) -> None:
        raise NotImplementedError

    def _grad_state(self) -> tuple[torch.Tensor, bool]:
        """(the flat gradient state, is it sharded?) as `move_state` carries it."""
        raise NotImplementedError


class FullGradBuffer:
    """A full flat gradient buffer, one slice per bucket (stages 0 and 1), where every micro-batch
    accumulates. On the micro-batch that ends a step each complete bucket goes to `reduce(g)` in the
    agreed order, at most `max_in_flight` at once; `end_backward` launches the rest and waits."""

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
        if not points_at(param, view):   # fp32 reduction, or the user replaced or cleared `.grad`
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
        """Zero the buffer once reductions a raised backward left in flight have finished."""
        if self.in_flight:
            while self.in_flight:
                self._wait_oldest()
            self.comm.reduce_stream.join()
        self.flat.zero_()
