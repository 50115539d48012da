"""Activation checkpoints, plain or partitioned across the model-parallel group (ZeRO-R's Pa, Pa+cpu, MD).

Under model parallelism a checkpointed block's input (batch x seq x hidden) is replicated on all
Nm ranks. Pa (paper Sec 6.1) keeps one slice per rank instead, through torch.utils.checkpoint and
autograd's saved-tensor hooks:

    forward   `pack` keeps this rank's 1/Nm of the input (Pa+cpu: in host memory, pinned on CUDA)
    backward  `unpack` all-gathers the slices over the MP group just before the block is
              recomputed (one all-gather per block, against Megatron's 12x in all-reduces); Pa+cpu
              meanwhile copies back the slice backward reaches next, on a side stream

MD (Sec 6.3, `contiguous=True`): checkpoints live for a whole step, what lies between them for one
block; allocated as they come, the long-lived ones cut free memory into holes. A `CheckpointArena`
is one buffer with a slot per block, reused every step, so the short-lived tensors have the rest.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .comm import all_gather_tensor
from .in_flight import SideStream
from ..tensor_parallel import group_rank, group_size

MODES = ("plain", "pa", "pa_cpu")


class CheckpointArena:
    """MD: one buffer with a slot per checkpointed block, sized by the first forward and reused. A
    slot is taken when a block saves its input and given back when autograd frees it; with every
    slot taken, or an input grown while some are, the checkpoint gets a tensor of its own
    (`misses`). When all slots are free a larger input replaces the buffer."""

    def __init__(self, slots: int):
        self.slots = slots
        self.buffer: torch.Tensor | None = None
        self.slot_numel = 0
        self.taken = [False] * slots
        self.misses = 0
        self.allocations = 0                       # buffers made so far (1 when the inputs keep their size)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, pinned: bool):
        """(slot index, a tensor of `numel` elements in it), or (None, None) on a miss."""
        fits = (self.buffer is not None and numel <= self.slot_numel and self.buffer.dtype == dtype
                and self.buffer.device == device)
        if not fits and not any(self.taken):
            self.buffer = None                     # let the old buffer go before making the new one
            self.buffer = torch.empty(self.slots * numel, dtype=dtype, device=device, pin_memory=pinned)
            self.slot_numel, fits = numel, True
            self.allocations += 1
        if not fits or all(self.taken):
            self.misses += 1
            return None, None
        slot = self.taken.index(False)
        self.taken[slot] = True
        start = slot * self.slot_numel
        return slot, self.buffer[start:start + numel]

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def give_back(self, slot: int) -> None:
        self.taken[slot] = False


class _Kept:
    """What a checkpointed block keeps in place of its input: `kept`, this rank's slice (Pa) or all
    of it (plain), flat; Pa+cpu: `on_device`, the slice copied back ahead, and `ready`, its event."""

    __slots__ = ("shape", "device", "kept", "on_device", "ready", "__weakref__")

    def __init__(self, shape: torch.Size, device: torch.device, kept: torch.Tensor):
        self.shape, self.device, self.kept = shape, device, kept
        self.on_device = self.ready = None


@dataclass
class ActivationCheckpoints:
    """What one model's checkpoints hold and move: live saved bytes on the device and on the host
    (with an arena: its whole buffer plus misses), elements all-gathered before recomputation,
    Pa+cpu's bytes copied each way and slices `prefetched` while the block after them recomputed."""

    mode: str
    group: object = None
    arena: CheckpointArena | None = None
    device_bytes: int = 0
    host_bytes: int = 0
    gathered_elements: int = 0
    host_traffic_bytes: int = 0
    prefetched: int = 0
    _offloaded: list = field(default_factory=list, repr=False)    # weak refs to Pa+cpu's _Kept, packing order
    _copy_stream: SideStream | None = field(default=None, repr=False)

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

    # --- the saved-tensor hooks around a checkpointed block ------------------------------------------
    def pack(self, full: torch.Tensor):
        """Keep this rank's slice of a block input (padded to ceil(n / Nm); plain: all of it), in
        the arena's slot (MD) and in host memory for Pa+cpu."""
        if not full.is_floating_point() or full.numel() == 0:   # (torch <= 2.11 saves an empty dummy too)
            return full
        size, rank = (1, 0) if self.mode == "plain" else (group_size(self.group), group_rank(self.group))
        chunk = math.ceil(full.numel() / size)
        flat = full.detach().reshape(-1)
        piece = flat[rank * chunk:(rank + 1) * chunk]
        host = self.mode == "pa_cpu"
        device = torch.device("cpu") if host else full.device
        slot, kept = None, None
        if self.arena is not None:
            allocations = self.arena.allocations
            slot, kept = self.arena.take(chunk, full.dtype, device, host and full.is_cuda)
            if self.arena.allocations != allocations:
                self._hold(self.arena.buffer, host)
        if kept is None:
            kept = torch.empty(chunk, dtype=full.dtype, device=device, pin_memory=host and full.is_cuda)
            self._hold(kept, host)
        if not full.is_meta:             # the engine at scale: no values to keep (Pa+cpu: host memory unused)
            kept[:piece.numel()].copy_(piece, non_blocking=host and full.is_cuda)
            kept[piece.numel():].zero_()
        packed = _Kept(full.shape, full.device, kept)
        if slot is not None:
            weakref.finalize(packed, self.arena.give_back, slot)
        if host:
            self._offloaded = [ref for ref in self._offloaded if ref() is not None] + [weakref.ref(packed)]
            self.host_traffic_bytes += kept.numel() * kept.element_size()
        return packed

    def unpack(self, packed) -> torch.Tensor:
        """All-gather the slices of the MP group back into the full block input (plain: a copy,
        so that nothing outside autograd's use of it points into the arena)."""
        if isinstance(packed, torch.Tensor):
            return packed
        kept = self._on_device(packed)
        if self.mode == "pa_cpu":
            self.host_traffic_bytes += kept.numel() * kept.element_size()
            self._prefetch_before(packed)
        if self.mode == "plain":
            return kept.view(packed.shape).clone()
        gathered = kept.new_empty(kept.numel() * group_size(self.group))
        if group_size(self.group) > 1:
            all_gather_tensor(gathered, kept, group=self.group)
        else:
            gathered.copy_(kept)
        self.gathered_elements += gathered.numel()
        return gathered[:math.prod(packed.shape)].view(packed.shape)

    def _on_device(self, packed: _Kept) -> torch.Tensor:
        """The kept slice on the model's device: the prefetched copy, or one made now."""
        if packed.on_device is None:
            return packed.kept.to(packed.device, non_blocking=True)
        on_device, packed.on_device = packed.on_device, None
        if packed.ready is not None:
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(packed.ready)
            on_device.record_stream(current)      # made on the side stream, used on this one
        return on_device

    def _prefetch_before(self, packed: _Kept) -> None:
        """Pa+cpu's overlap: backward recomputes blocks in reverse, so while this block recomputes,
        copy back the slice packed just before this one, on a side stream (CUDA)."""
        order = [ref() for ref in self._offloaded]
        i = next((k for k in range(len(order) - 1, -1, -1) if order[k] is packed), 0)
        previous = order[i - 1] if i > 0 else None
        if previous is None or previous.on_device is not None:
            return
        if self._copy_stream is None:
            self._copy_stream = SideStream(previous.device)
        with self._copy_stream.after_current():   # after the forward's copy to the host was queued
            previous.on_device = previous.kept.to(previous.device, non_blocking=True)
        previous.ready = self._copy_stream.record_event()
        self.prefetched += 1


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
        if self.checkpoints.mode == "plain" and self.checkpoints.arena is None:   # torch's own, no copy
            self.checkpoints._hold(x, host=False)
            return checkpoint(self.block, x, use_reentrant=False)
        with torch.autograd.graph.saved_tensors_hooks(self.checkpoints.pack, self.checkpoints.unpack):
            return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(blocks: nn.ModuleList, mode: str = "pa", group=None, *,
                      contiguous: bool = False) -> ActivationCheckpoints:
    """Wrap every block of `blocks` in place in a CheckpointedBlock sharing one ActivationCheckpoints
    (returned). `mode`: "plain" (torch's), "pa" (inputs partitioned across the model-parallel
    `group`) or "pa_cpu" (and offloaded to the host); `contiguous`: MD. Apply before initialize."""
    if mode not in MODES:
        raise ValueError(f"activation checkpoint mode = {mode!r} is not allowed: expected one of "
                         f"{', '.join(map(repr, MODES))}")
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"blocks must be an nn.ModuleList of transformer blocks, got {type(blocks).__name__}")
    checkpoints = ActivationCheckpoints(mode, group, CheckpointArena(len(blocks)) if contiguous else None)
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
