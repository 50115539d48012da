"""What stages 0-2 share: full parameters on every rank, packed into buckets in gradient-arrival order.

Every rank holds the whole model's parameters in one flat buffer (each parameter is a view of its
range), cut into buckets of at most `bucket_numel` elements: the constant-size communication
buffers of the paper (CB). A bucket is reduced as soon as backward has produced all of its
gradients, so reductions overlap the rest of backward and only a few buckets are in flight.

That works only if buckets fill one after another, i.e. if the parameters are packed in the order
their gradients arrive. At first they are packed in reverse registration order (usually close);
the first backward records the true arrival order, the ranks agree on it (rank 0's, if theirs
differ), and if some bucket completed out of launch order the stage packs the buckets anew
(`relayout`), as DDP rebuilds its buckets after the first iteration. The repack copies the
parameters into a new flat buffer and carries gradients and optimizer state over with
`partition.move_state` (sharded state one bucket at a time); for a moment both layouts exist. A
checkpoint stores the learned order, so a resumed run starts in it.
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import Comm
from ..config import ZeroConfig
from .grad_hooks import register_grad_hooks
from .labels import label
from .partition import GroupLayout, move_state, pack_into_buckets
from .stage_base import Stage, pieces_of


class BucketedStage(Stage):
    """Base of stages 0-2. Subclasses implement `_lay_out(order)` (build the layout, buffers and
    optimizer for parameters packed in `order`), `_on_grad`, `_end_backward` and `_grad_state`;
    `shard_states` says whether optimizer state is sharded (stages 1-2) or whole (stage 0), and
    `binds_per_backward` whether `_before_grad` must point `.grad` at a bucket in every backward."""

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
        """Agree on the first backward's arrival order, the lowest rank's whose backward completed
        (`log` None: this rank's raised; if every rank's did, learn from the next backward), and
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
        """Start in a previously learned order (a checkpoint's) instead of learning one; the state
        is about to be overwritten, so nothing is carried over."""
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
