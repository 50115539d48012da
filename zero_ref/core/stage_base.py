"""What the engine asks of every stage, and the few pieces all stages share.

A stage owns the trainable parameters after `initialize`: their flat groups, which segment of each
this rank keeps, how gradients are reduced in backward, what is gathered after the update:

    begin_backward / end_backward   around the autograd pass; on return every reduction the stage
                                    owes for this micro-batch has completed (also after a raise)
    grad_segments                   this rank's gradient segments, aligned with the masters
    segment_updated(g)              the optimizer has written segment g (stages 1-2 gather it)
    after_update                    wait for what segment_updated started
    zero_grads                      clear gradients for the next step
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import triton_kernels

from .comm import Comm
from ..config import ZeroConfig
from .optim import ShardedAdamW
from .partition import FlatGroup

BARE_BACKWARD = ("a backward pass reached zero-ref's gradient hooks outside engine.backward(loss): call "
                 "engine.backward(loss) instead of loss.backward() (it applies the fp16 loss scale and "
                 "1/grad_accum_steps and finishes the step's reductions). The gradients accumulated since "
                 "the last step are not usable: engine.zero_grad() discards them")


def pieces_of(groups: list[FlatGroup], segment_range):
    """(param, param_start, param_end, g, segment_start) for every parameter piece that falls in
    segment g = `segment_range(g)` of each group."""
    for g, group in enumerate(groups):
        lo, hi = segment_range(g)
        for param, start, end in group.param_ranges():
            a, b = max(start, lo), min(end, hi)
            if a < b:
                yield param, a - start, b - start, g, a - lo


class Stage:
    """Base of the four stages. Subclasses set `grads_sharded` (does the gradient norm need a
    cross-rank sum?) and build `self.groups` and `self.optimizer`."""

    grads_sharded = True
    params_sharded = False   # stage 3: the parameters have no values outside the forward and backward
    replicated = False   # True when every rank holds all optimizer state (stage 0)

    def __init__(self, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm):
        self.trainable = trainable
        self.config = config
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dtype = config.torch_dtype
        self.grad_dtype = config.grad_dtype
        self.device = comm.device
        self.kernels = triton_kernels.load(config.kernels, self.device)
        self.groups: list[FlatGroup] = []
        self.optimizer: ShardedAdamW | None = None
        self.hooks: list = []
        self.index = {id(p): k for k, p in enumerate(trainable)}   # a parameter's place among the trainable
        self.used = bytearray(len(trainable))   # which parameters got a gradient since the last step
        self.in_backward = False           # set by the engine around loss.backward()
        self.polluted: str | None = None   # why the gradients since the last step are unusable

    def check_in_backward(self, why: str = BARE_BACKWARD) -> None:
        """Called by every gradient hook: refuse a backward the engine did not start."""
        if not self.in_backward:
            self.polluted = why
            raise RuntimeError(why)

    # --- around forward and backward -------------------------------------------------------------
    def forward_context(self):
        """A context manager entered around the model's forward."""
        return contextlib.nullcontext()

    def run_backward(self, loss: torch.Tensor, retain_graph: bool, autograd=torch.autograd.backward) -> None:
        """The backward pass (a guard may pass its own entry into autograd)."""
        autograd(loss, retain_graph=retain_graph)

    def idle_forward(self) -> None:
        """Issue a forward's collectives without running it (a failed rank's stand-in; stage 3 gathers)."""

    def begin_backward(self, boundary: bool) -> None:
        """Before loss.backward(); `boundary` is True on the last micro-batch of a step."""

    def end_backward(self, boundary: bool, failed: bool = False) -> None:
        """After loss.backward(): finish this micro-batch's reductions. `failed`: the backward raised;
        issue what the other ranks issue at its end, learn nothing from it."""

    # --- the optimizer step ----------------------------------------------------------------------
    def grad_segments(self) -> list[torch.Tensor]:
        """This rank's averaged gradient segments, aligned with the optimizer's masters."""
        raise NotImplementedError

    def segment_updated(self, g: int) -> None:
        """The optimizer has written this rank's segment of group g."""

    def after_update(self) -> None:
        """After the optimizer has updated every segment."""

    def zero_grads(self, keep_used: bool = False) -> None:
        """Clear gradients and, unless `keep_used` (set_to_none=False: zeros are still a gradient),
        which parameters got one."""
        if not keep_used:
            self.used = bytearray(len(self.trainable))
        self._zero_grad_buffers()

    def _zero_grad_buffers(self) -> None:
        raise NotImplementedError

    def mark_used(self, param: nn.Parameter) -> None:
        self.used[self.index[id(param)]] = 1

    def _make_optimizer(self, segments: list[torch.Tensor]) -> ShardedAdamW:
        """AdamW over this rank's `segments`, knowing which parameter each piece belongs to."""
        pieces = [(self.index[id(p)], start, end, g, offset) for p, start, end, g, offset in self.owned_pieces()]
        return ShardedAdamW(segments, pieces, len(self.trainable), self.config, self.kernels)

    # --- state -----------------------------------------------------------------------------------
    def segment_range(self, g: int) -> tuple[int, int]:
        """The [lo, hi) of group g that this rank's segment holds (its shard when sharded)."""
        return self.groups[g].shard_range(self.rank)

    def full_master(self, g: int) -> torch.Tensor:
        """Group g's fp32 masters, full padded length, on every rank (read only; collective when sharded)."""
        if self.segment_range(g) == (0, self.groups[g].padded_numel):
            return self.optimizer.masters[g]
        full = torch.empty(self.groups[g].padded_numel, dtype=torch.float32, device=self.device)
        self.comm.all_gather(full, self.optimizer.masters[g].contiguous(), in_step=False)
        return full

    def param_buffer(self, g: int) -> torch.Tensor:
        """Group g's full parameter buffer (stage 3: freed between uses)."""
        raise NotImplementedError

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The live tensors this stage holds: params, grads, optimizer_states, comm_buffers."""
        raise NotImplementedError

    def owned_pieces(self):
        """(param, param_start, param_end, g, segment_start) of every piece this rank's optimizer holds."""
        return pieces_of(self.groups, self.segment_range)

    def planned_pieces(self, order: list[int] | None):
        """The pieces this rank would own packed in `order` (None: as now), changing nothing."""
        return self.owned_pieces()

    def learned_order(self) -> list[int] | None:
        """The learned packing order (trainable indices) for checkpoints; None at stage 3."""
        return None

    def wants_order(self) -> bool:
        """Whether `adopt_order` would still take a checkpoint's learned order."""
        return False

    def adopt_order(self, order: list[int]) -> None:
        raise NotImplementedError

    def sync_params_from_master(self) -> None:
        """Write the rounded fp32 masters into the parameters and regather (after loading state)."""
        self.optimizer.write_params()
        for g in range(len(self.groups)):
            self.segment_updated(g)
        self.after_update()

    def close(self) -> None:
        """Remove every hook this stage registered."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []
