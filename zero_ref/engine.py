"""initialize() and ZeroEngine: forward, backward and step for any stage.

The engine is the only place that knows the order of a training step; the stage files know what is
sharded and what moves. A step at an accumulation boundary is:

    out = engine(batch)      cast floating inputs to the model dtype, (stage 3: gather as needed)
    engine.backward(loss)    backward of loss * loss_scale / grad_accum_steps; the stage reduces
                             gradients during it and has finished when this returns
    engine.step()            global norm (one scalar all-reduce when gradients are sharded), fp16
                             overflow check (skip on every rank alike), clip, fused AdamW on this
                             rank's fp32 master segments, regather, clear gradients
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from . import checkpoint
from .comm import Comm, CommLedger
from .config import ZeroConfig
from .precision import LossScaler
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3
from .stage_base import Stage

MEMORY_CATEGORIES = ("params", "grads", "optimizer_states", "buffers")


def initialize(model: nn.Module, config: ZeroConfig, process_group: dist.ProcessGroup | None = None
               ) -> "ZeroEngine":
    """Take ownership of `model` and return the engine that trains it under `config`.

    The model is converted (to `config.dtype`) and partitioned in place: its Parameter objects are
    kept, but their storage becomes views of the stage's flat buffers (stage 3: freed until used),
    so no second full copy stays alive. Rank 0's values are broadcast first, so every rank starts
    from the same model. `process_group` defaults to the default group; world size 1 works.
    """
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zero_ref.ZeroConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group('gloo' or 'nccl') before zero_ref.initialize "
                           "(under torchrun the environment provides rank and world size; world size 1 works)")
    return ZeroEngine(model, config, process_group)


class ZeroEngine:
    """Trains one model with ZeRO stage `config.stage` over a data-parallel process group.

    Attributes: `module` (the model), `config`, `global_step` (updates applied), `loss_scale`,
    `skipped_steps` (non-finite gradients: fp16 overflows, or nonfinite="skip").
    """

    def __init__(self, model: nn.Module, config: ZeroConfig, process_group: dist.ProcessGroup | None):
        self.module = model
        self.config = config
        self.ledger = CommLedger()
        self.comm = Comm(process_group, self.ledger, config.comm_timeout_s)
        self.dtype = config.torch_dtype
        params = list(model.parameters())
        devices = {p.device for p in params} | {b.device for b in model.buffers()}
        if len(devices) > 1:
            raise ValueError(f"the model's tensors must all be on one device, found {sorted(map(str, devices))}")
        _check_same_model_everywhere(model, self.comm)

        with torch.no_grad():
            self.frozen = [p for p in params if not p.requires_grad]
            for tensor in [*self.frozen, *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(self.dtype)
            for tensor in [*params, *model.buffers()]:   # every rank starts from rank 0's model
                if self.comm.world_size > 1:
                    self.comm.broadcast(tensor.data, 0, in_step=False)
        trainable = [p for p in params if p.requires_grad]
        self.stage: Stage = _make_stage(model, trainable, config, self.comm)
        self.scaler = LossScaler(enabled=self.dtype == torch.float16, scale=config.initial_loss_scale,
                                 growth_interval=config.loss_scale_growth_interval,
                                 min_scale=config.min_loss_scale)
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.micro_step = 0
        self.global_step = 0
        self._skipped_steps = 0

    # --- the training step -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The model's forward. Floating-point tensor inputs are cast to the model dtype."""
        if self.config.broadcast_buffers and self.comm.world_size > 1:
            for buffer in self._float_buffers:
                self.comm.broadcast(buffer.data, 0)
        cast = lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        args, kwargs = tree_map(cast, (args, kwargs))
        self.stage.pre_forward()
        try:
            return self.module(*args, **kwargs)
        finally:
            self.stage.post_forward()

    forward = __call__

    @property
    def at_boundary(self) -> bool:
        """True when the last backward completed a step's worth of micro-batches."""
        return self.micro_step % self.config.grad_accum_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (scaled by the fp16 loss scale and 1 / grad_accum_steps). At an
        accumulation boundary, every gradient reduction of the step has finished on return."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects the scalar loss tensor of this micro-batch")
        self.micro_step += 1
        boundary = self.at_boundary
        self.stage.begin_backward(boundary)
        (loss * (self.scaler.scale / self.config.grad_accum_steps)).backward()
        self.stage.end_backward(boundary)

    @torch.no_grad()
    def step(self) -> bool:
        """Apply the update if the last backward was at an accumulation boundary.

        Returns True when parameters were updated, False when there was nothing to do (mid
        accumulation) or the step was skipped because an fp16 gradient overflowed.
        """
        if self.micro_step == 0 or not self.at_boundary:
            return False
        grads = self.stage.grad_segments()
        optimizer = self.stage.optimizer
        # The global gradient norm: one pass over this rank's gradients and, when they are sharded,
        # one scalar all-reduce. It also tells every rank alike whether any gradient is non-finite.
        sum_sq = optimizer.local_sum_of_squares(grads)
        if self.stage.grads_sharded and self.comm.world_size > 1:
            self.comm.all_reduce_sum(sum_sq)
        norm = math.sqrt(sum_sq.item()) / self.scaler.scale
        if not math.isfinite(norm):
            if not self.scaler.enabled and self.config.nonfinite == "error":
                self.stage.zero_grads()
                raise FloatingPointError(
                    f"non-finite gradient norm at step {self.global_step + 1} (ZeroConfig.nonfinite='error'; "
                    "set nonfinite='skip' to skip such steps)")
            self._finish_step(updated=False)
            return False
        grad_scale = 1.0 / self.scaler.scale
        if self.config.grad_clip is not None:
            grad_scale *= min(1.0, self.config.grad_clip / (norm + 1e-6))
        optimizer.step(grads, self.stage.low_precision_segments(), grad_scale)
        self.stage.after_update()
        self._finish_step(updated=True)
        return True

    def _finish_step(self, updated: bool) -> None:
        self.stage.zero_grads()
        self.scaler.update(found_overflow=not updated)
        self.ledger.close_step()
        self.global_step += int(updated)
        self._skipped_steps += int(not updated)

    # --- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, path, keep: int = 2):
        """Write a sharded checkpoint under the folder `path` (every rank calls it; see checkpoint.py).
        Returns the new checkpoint's folder; `path/latest` names it once it is complete."""
        return checkpoint.save_checkpoint(self, path, keep)

    def load_checkpoint(self, path) -> None:
        """Load a checkpoint written at any world size and stage (every rank calls it)."""
        manifest = checkpoint.load_checkpoint(self, path)
        self.global_step = manifest["global_step"]
        self._skipped_steps = manifest["skipped_steps"]
        self.scaler.load_state_dict(manifest["scaler"])
        self.micro_step = 0

    # --- inspection ------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was non-finite (fp16 overflow, or nonfinite='skip')."""
        return self._skipped_steps

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor of full shape} for every parameter (a tied weight under each of its
        names) plus persistent buffers, from the fp32 master weights; identical on every rank.
        Collective: every rank of the group must call it."""
        names = defaultdict(list)
        for name, param in self.module.named_parameters(remove_duplicate=False):
            names[id(param)].append(name)
        values: dict[str, torch.Tensor] = {}
        for g, group in enumerate(self.stage.groups):
            full = self.stage.full_master(g)
            for param, start, end in group.param_ranges():
                value = full[start:end].view(param.shape).clone()
                for name in names[id(param)]:
                    values[name] = value
        for param in self.frozen:
            for name in names[id(param)]:
                values[name] = param.detach().float().clone()
        state_keys = self.module.state_dict(keep_vars=True)
        out = {}
        for key, tensor in state_keys.items():
            if key in values:
                out[key] = values[key]
            else:   # a persistent buffer
                out[key] = tensor.detach().float().clone() if tensor.is_floating_point() else tensor.detach().clone()
        return out

    def memory_report(self) -> dict[str, int]:
        """Bytes of live tensor storage on this rank by category (each storage counted once)."""
        tensors = self.stage.memory_tensors()
        tensors["params"] = [*tensors["params"], *self.frozen]
        tensors["buffers"] = list(self.module.buffers())
        seen: set[int] = set()
        report = {}
        for category in MEMORY_CATEGORIES:
            total = 0
            for tensor in tensors[category]:
                storage = tensor.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    total += storage.nbytes()
            report[category] = total
        report["total"] = sum(report.values())
        return report

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Elements moved per rank by collective kind, for the last step and cumulatively, counted
        as the paper counts (all-reduce of n: 2n; reduce-scatter or all-gather of n: n)."""
        return self.ledger.stats()


def _make_stage(model: nn.Module, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm) -> Stage:
    if config.stage == 3:
        return Stage3(model, trainable, config, comm)
    return {0: Stage0, 1: Stage1, 2: Stage2}[config.stage](trainable, config, comm)


def _check_same_model_everywhere(model: nn.Module, comm: Comm) -> None:
    """Every rank must hold the same parameter names and shapes; say where they first differ."""
    if comm.world_size == 1:
        return
    mine = [(name, tuple(p.shape), p.requires_grad)
            for name, p in model.named_parameters(remove_duplicate=False)]
    everyone = comm.all_gather_object(mine)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for i, (a, b) in enumerate(zip(reference, theirs)):
            if a != b:
                raise ValueError(f"models differ across ranks: parameter #{i} is {a[0]} {a[1]} "
                                 f"(requires_grad={a[2]}) on rank 0 but {b[0]} {b[1]} "
                                 f"(requires_grad={b[2]}) on rank {rank}")
        raise ValueError(f"models differ across ranks: rank 0 has {len(reference)} parameters, "
                         f"rank {rank} has {len(theirs)}")
