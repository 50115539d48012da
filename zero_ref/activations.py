"""Activation checkpoints, plain or partitioned across the model-parallel group (ZeRO-R's Pa, Pa+cpu).

With activation checkpointing each transformer block keeps only its input during forward and
recomputes its internals in backward (torch.utils.checkpoint). Under model parallelism that input
(batch x seq x hidden) is replicated on all Nm ranks of the MP group: Nm identical copies. The
paper's Pa (Sec 6.1) keeps one slice per rank instead:

    forward   the block's input is saved through torch's checkpoint, which saves its inputs with
              autograd's saved-tensor machinery; our saved_tensors_hooks pack keeps this rank's
              1/Nm of it (Pa+cpu: in host memory, pinned on CUDA) and lets the full tensor go
    backward  just before the block is recomputed, unpack all-gathers the slices over the MP group
              (one all-gather of batch x seq x hidden per block, against Megatron's 12x in
              all-reduces) and checkpoint recomputes the block from the rebuilt input

Checkpoint memory per rank falls from L x batch x seq x hidden to 1/Nm of it (Pa), or to nothing
on the accelerator (Pa+cpu). `ActivationCheckpoints` counts the live bytes and the elements
gathered; the engine's memory report includes them.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .comm import all_gather_tensor
from .tensor_parallel import group_rank, group_size

MODES = ("plain", "pa", "pa_cpu")


@dataclass
class ActivationCheckpoints:
    """What the checkpoints of one model hold and move. Bytes are those of live saved inputs, by
    where they live: `device_bytes` on the model's device, `host_bytes` offloaded (Pa+cpu).
    `gathered_elements`: elements all-gathered before recomputation (counted as the paper counts
    an all-gather: the full tensor's size)."""

    mode: str
    group: object = None
    device_bytes: int = 0
    host_bytes: int = 0
    gathered_elements: int = 0

    def _hold(self, tensor: torch.Tensor, host: bool) -> None:
        """Count `tensor`'s bytes until torch frees it."""
        nbytes = tensor.numel() * tensor.element_size()
        self._add(nbytes, host)
        weakref.finalize(tensor, self._add, -nbytes, host)

    def _add(self, nbytes: int, host: bool) -> None:
        if host:
            self.host_bytes += nbytes
        else:
            self.device_bytes += nbytes

    # --- the saved-tensor hooks around a checkpointed block (Pa, Pa+cpu) ----------------------------
    def pack(self, full: torch.Tensor):
        """Keep this rank's slice of a block input (padded to ceil(n / Nm) elements)."""
        if not full.is_floating_point():
            return full
        size, rank = group_size(self.group), group_rank(self.group)
        chunk = math.ceil(full.numel() / size)
        flat = full.detach().reshape(-1)
        mine = flat.new_zeros(chunk)
        piece = flat[rank * chunk:(rank + 1) * chunk]
        mine[:piece.numel()] = piece
        if self.mode == "pa_cpu":
            host = torch.empty(chunk, dtype=mine.dtype, pin_memory=mine.is_cuda)
            mine = host.copy_(mine, non_blocking=mine.is_cuda)
        self._hold(mine, host=self.mode == "pa_cpu")
        return full.shape, full.device, mine

    def unpack(self, packed) -> torch.Tensor:
        """All-gather the slices of the MP group back into the full block input."""
        if isinstance(packed, torch.Tensor):
            return packed
        shape, device, mine = packed
        mine = mine.to(device, non_blocking=True)
        gathered = mine.new_empty(mine.numel() * group_size(self.group))
        if group_size(self.group) > 1:
            all_gather_tensor(gathered, mine, group=self.group)
        else:
            gathered.copy_(mine)
        self.gathered_elements += gathered.numel()
        return gathered[:math.prod(shape)].view(shape)


class CheckpointedBlock(nn.Module):
    """One block run under torch.utils.checkpoint (non-reentrant): only its input is kept, whole
    ("plain"), as this rank's MP slice ("pa") or as that slice in host memory ("pa_cpu")."""

    def __init__(self, block: nn.Module, checkpoints: ActivationCheckpoints):
        super().__init__()
        self.block = block
        self.checkpoints = checkpoints

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.block(x)
        if self.checkpoints.mode == "plain":
            self.checkpoints._hold(x, host=False)
            return checkpoint(self.block, x, use_reentrant=False)
        with torch.autograd.graph.saved_tensors_hooks(self.checkpoints.pack, self.checkpoints.unpack):
            return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(blocks: nn.ModuleList, mode: str = "pa", group=None) -> ActivationCheckpoints:
    """Wrap every block of `blocks` in place in a CheckpointedBlock sharing one
    ActivationCheckpoints (returned). `mode`: "plain" (torch's activation checkpointing), "pa"
    (inputs partitioned across the model-parallel `group`) or "pa_cpu" (partitioned and offloaded
    to host memory). Apply before zero_ref.initialize."""
    if mode not in MODES:
        raise ValueError(f"activation checkpoint mode = {mode!r} is not allowed: expected one of "
                         f"{', '.join(map(repr, MODES))}")
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"blocks must be an nn.ModuleList of transformer blocks, got {type(blocks).__name__}")
    checkpoints = ActivationCheckpoints(mode, group)
    for i, block in enumerate(blocks):
        if isinstance(block, CheckpointedBlock):
            raise ValueError(f"block {i} is already checkpointed")
        blocks[i] = CheckpointedBlock(block, checkpoints)
    return checkpoints


def model_checkpoints(model: nn.Module) -> list[ActivationCheckpoints]:
    """The ActivationCheckpoints of every checkpointed block in `model` (each counted once)."""
    found = {}
    for module in model.modules():
        if isinstance(module, CheckpointedBlock):
            found[id(module.checkpoints)] = module.checkpoints
    return list(found.values())
