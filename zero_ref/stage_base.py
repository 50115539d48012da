"""What the engine asks of every stage, and the few pieces all stages share.

A stage owns the model's trainable parameters after `initialize`: how they are laid out in flat
buffers, which part this rank keeps, how gradients are reduced during backward, and what has to be
gathered after the optimizer has updated this rank's fp32 master segments. The engine drives a
step through this interface:

    pre_forward / post_forward      around the model's forward (stage 3 gathers parameters here)
    begin_backward / end_backward   around loss.backward(); on return at an accumulation boundary
                                    every reduction of the step has completed
    grad_segments                   this rank's reduced gradient segments, aligned with the masters
    low_precision_segments          where the updated parameters are written (None in fp32)
    after_update                    regather what the stage needs (stages 1 and 2: the parameters)
    zero_grads                      clear gradients for the next step
"""

from __future__ import annotations

import torch
from torch import nn

import triton_kernels

from .comm import Comm
from .config import ZeroConfig
from .optim import ShardedAdamW
from .partition import FlatGroup, GroupLayout


class Stage:
    """Base of the four stages. Subclasses set `grads_sharded` (does the gradient norm need a
    cross-rank sum?) and build `self.groups` and `self.optimizer`."""

    grads_sharded = True
    replicated = False   # True when every rank holds all optimizer state (stage 0)

    def __init__(self, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm):
        self.trainable = trainable
        self.config = config
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world_size
        self.dtype = config.torch_dtype
        self.mixed_precision = self.dtype != torch.float32
        self.device = trainable[0].device if trainable else torch.device("cpu")
        self.kernels = triton_kernels.load(config.kernels, self.device)
        self.groups: list[FlatGroup] = []
        self.param_shards: list[torch.Tensor] = []   # this rank's parameter segment of each group
        self.grad_shards: list[torch.Tensor] = []    # its averaged gradient segment of each group
        self.optimizer: ShardedAdamW | None = None

    # --- around forward and backward -------------------------------------------------------------
    def pre_forward(self) -> None:
        """Before the model's forward."""

    def post_forward(self) -> None:
        """After the model's forward."""

    def begin_backward(self, boundary: bool) -> None:
        """Before loss.backward(); `boundary` is True on the last micro-batch of a step."""

    def end_backward(self, boundary: bool) -> None:
        """After loss.backward(): finish this micro-batch's reductions."""

    # --- the optimizer step (defaults for the sharded stages: one segment per group) -------------
    def grad_segments(self) -> list[torch.Tensor]:
        """This rank's averaged gradient segments, aligned with the optimizer's masters."""
        return self.grad_shards

    def low_precision_segments(self) -> list[torch.Tensor | None]:
        return self._low_precision(self.param_shards)

    def after_update(self) -> None:
        """After the optimizer has updated this rank's segments."""

    def zero_grads(self) -> None:
        raise NotImplementedError

    # --- state -----------------------------------------------------------------------------------
    def full_master(self, g: int) -> torch.Tensor:
        """The fp32 master values of group g, full padded length, identical on every rank."""
        return self._gather_master(g, self.optimizer.masters[g])

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The live tensors this stage holds, by category: params, grads, optimizer_states."""
        raise NotImplementedError

    def segment_of(self, g: int) -> tuple[int, int, int, int]:
        """Where this rank's optimizer state for group g lives: (segment index into the master and
        moment lists, offset in that segment, and the [lo, hi) range of the group's flat buffer that
        the segment holds from that offset on). Sharded stages: segment g, their own shard."""
        lo, hi = self.groups[g].shard_range(self.rank)
        return g, 0, lo, hi

    def owned_pieces(self):
        """(param, param_start, param_end, segment, segment_start) for every piece of a parameter
        whose optimizer state this rank holds: the map checkpoints are written and read through."""
        for g, group in enumerate(self.groups):
            segment, base, lo, hi = self.segment_of(g)
            for param, start, end in group.param_ranges():
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    yield param, a - start, b - start, segment, base + a - lo

    def sync_params_from_master(self) -> None:
        """Write the rounded fp32 masters into the parameters and regather (after loading state)."""
        for master, out in zip(self.optimizer.masters, self.low_precision_segments()):
            if out is not None:
                out.copy_(master)
        self.after_update()

    # --- shared helpers --------------------------------------------------------------------------
    def _gather_master(self, g: int, master_segment: torch.Tensor) -> torch.Tensor:
        """All-gather group g's fp32 master shards into a new full-length tensor (not a training
        collective: counted in the cumulative ledger only)."""
        full = torch.empty(self.groups[g].padded_numel, dtype=torch.float32, device=self.device)
        self.comm.all_gather(full, master_segment.contiguous(), in_step=False)
        return full

    def _all_gather_params(self, layout: GroupLayout, flat_params: torch.Tensor,
                           param_shards: list[torch.Tensor]) -> None:
        """Every bucket of the flat parameter buffer, all-gathered in place from the ranks' shards."""
        works = [self.comm.all_gather(layout.full_slice(flat_params, g), param_shards[g], async_op=True)
                 for g in range(len(layout.groups))]
        for work in works:
            work.wait()

    def _low_precision(self, views: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The parameter views the optimizer writes into: none in fp32 (the master is the parameter)."""
        return list(views) if self.mixed_precision else [None] * len(views)
