"""ZeroConfig: the one validated description of a ZeRO training run.

Every field is checked when the config is built; a bad value raises a ValueError that names the
field and says what is allowed, so a typo fails at construction instead of deep inside a step.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STAGES = (0, 1, 2, 3)
KERNELS = ("auto", "triton", "torch")
CHECKS = ("strict", "off")
NONFINITE = ("error", "skip")
REDUCE_DTYPES = ("fp32",)

#: What each stage shards, in the paper's words (Rajbhandari et al., SC20, Sec 5).
STAGE_NAMES = {0: "baseline DP", 1: "Pos", 2: "Pos+g", 3: "Pos+g+p"}


@dataclass(frozen=True)
class ZeroConfig:
    """What to shard, how to compute, and how to update.

    Fields:
        stage: 0 plain data parallel, 1 optimizer states sharded (Pos), 2 + gradients (Pos+g),
            3 + parameters (Pos+g+p).
        dtype: "fp32", "bf16" or "fp16": the dtype of parameters and gradients. The optimizer always
            keeps fp32 master weights and moments (K = 12 bytes per parameter, as in the paper). The
            masters start from the parameters after their cast to `dtype` (the model is converted
            in place), not from the model's original fp32 values as torch.autocast training would.
        lr, betas, eps, weight_decay: AdamW hyper-parameters, with torch.optim.AdamW's semantics
            (weight decay is decoupled). They are the defaults of the parameter groups: a group
            passed to `initialize(..., param_groups=...)` may set its own, and a torch lr_scheduler
            on `engine.optimizer` changes them as training goes (param_groups.py).
        grad_clip: clip gradients to this global L2 norm (over all shards); None turns it off.
        grad_accum_steps: micro-batches per optimizer step. `engine.backward` divides the loss by it,
            so the update equals one on the concatenated batch.
        bucket_numel: the constant size, in elements, of every fusion and communication buffer (the
            paper's CB). A single parameter larger than this gets a bucket of its own.
        overlap: run the reduction of a bucket asynchronously while backward continues. False: wait
            for each one right after it starts (stage 3 on gloo: for at most a moment, since a peer
            may first need this rank in a gather; grad_buffers.py).
        prefetch: stage 3 only: how many parameter units to gather ahead of the one in use.
        reduce_dtype: None (reduce and accumulate gradients in `dtype`) or "fp32": gradients are
            accumulated across micro-batches and reduced across ranks in fp32 (FSDP's reduce_dtype),
            at twice the gradient bytes and traffic of bf16/fp16.
        cast_buffers: also cast floating-point buffers to `dtype`. By default buffers keep their own
            dtype (a RoPE `inv_freq` or BatchNorm statistics stay fp32); parameters always take `dtype`.
        kernels: "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch" for the optimizer step.
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) before each
            forward, as DDP does, so that non-parameter state stays consistent across ranks.
        nonfinite: what a non-finite gradient norm does in fp32/bf16 runs: "error" raises
            FloatingPointError on every rank, "skip" skips the step on every rank and counts it in
            `engine.skipped_steps`. (fp16 always skips and lowers the loss scale.)
        comm_timeout_s: the longest any collective may take before every waiting rank raises
            CollectiveError (a dead or stuck peer); on NCCL the process group's timeout applies.
            The engine then refuses every further call but close, memory_report and comm_stats
            (RuntimeError): its ranks may be at different points of a step.
        initial_loss_scale, loss_scale_growth_interval, min_loss_scale: fp16 dynamic loss scaling:
            the scale halves on overflow (that step is skipped on every rank) and doubles after
            `loss_scale_growth_interval` clean steps.
        checks: "strict" (the default) guards every step: the ranks are compared at initialize, a
            failure on some ranks only or a disagreement between them is refused on every rank,
            parameters written or read from outside the engine are adopted, gathered or refused
            (zero_ref/guard, docs/contract.md). "off" runs the bare core, as DeepSpeed and FSDP2
            do: the same exact updates for a program that every rank runs alike, with no
            protection against one that does not; for reading the algorithm, and for speed on a
            model you trust.
    """

    stage: int = 0
    dtype: str = "fp32"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = None
    grad_accum_steps: int = 1
    bucket_numel: int = 2**22
    overlap: bool = True
    prefetch: int = 1
    reduce_dtype: str | None = None
    cast_buffers: bool = False
    kernels: str = "auto"
    broadcast_buffers: bool = True
    nonfinite: str = "error"
    comm_timeout_s: float = 300.0
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    min_loss_scale: float = 1.0
    checks: str = "strict"

    def __post_init__(self) -> None:
        _check(_one_of(self.stage, STAGES, int), "stage", self.stage, "one of 0, 1, 2, 3")
        _check(_one_of(self.dtype, DTYPES, str), "dtype", self.dtype, f"one of {', '.join(map(repr, DTYPES))}")
        _check(_finite_number(self.lr) and self.lr >= 0, "lr", self.lr, "a finite number >= 0")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else None
        _check(betas is not None and len(betas) == 2 and all(_finite_number(b) and 0 <= b < 1 for b in betas),
               "betas", self.betas, "a pair of numbers in [0, 1)")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        _check(_finite_number(self.eps) and self.eps > 0, "eps", self.eps, "a finite number > 0")
        _check(_finite_number(self.weight_decay) and self.weight_decay >= 0, "weight_decay",
               self.weight_decay, "a finite number >= 0")
        _check(self.grad_clip is None or (_finite_number(self.grad_clip) and self.grad_clip > 0),
               "grad_clip", self.grad_clip, "None (off) or a finite number > 0")
        _check(_positive_int(self.grad_accum_steps), "grad_accum_steps", self.grad_accum_steps,
               "an integer >= 1")
        _check(_positive_int(self.bucket_numel), "bucket_numel", self.bucket_numel, "an integer >= 1")
        _check(isinstance(self.overlap, bool), "overlap", self.overlap, "True or False")
        _check(isinstance(self.prefetch, int) and not isinstance(self.prefetch, bool) and self.prefetch >= 0,
               "prefetch", self.prefetch, "an integer >= 0")
        _check(self.reduce_dtype is None or _one_of(self.reduce_dtype, REDUCE_DTYPES, str), "reduce_dtype",
               self.reduce_dtype, f"None (the model dtype) or {', '.join(map(repr, REDUCE_DTYPES))}")
        _check(isinstance(self.cast_buffers, bool), "cast_buffers", self.cast_buffers, "True or False")
        _check(_one_of(self.kernels, KERNELS, str), "kernels", self.kernels, f"one of {', '.join(map(repr, KERNELS))}")
        _check(isinstance(self.broadcast_buffers, bool), "broadcast_buffers", self.broadcast_buffers,
               "True or False")
        _check(_one_of(self.nonfinite, NONFINITE, str), "nonfinite", self.nonfinite,
               f"one of {', '.join(map(repr, NONFINITE))}")
        _check(_finite_number(self.comm_timeout_s) and self.comm_timeout_s > 0, "comm_timeout_s",
               self.comm_timeout_s, "a finite number of seconds > 0")
        _check(_finite_number(self.initial_loss_scale) and self.initial_loss_scale > 0,
               "initial_loss_scale", self.initial_loss_scale, "a finite number > 0")
        _check(_positive_int(self.loss_scale_growth_interval), "loss_scale_growth_interval",
               self.loss_scale_growth_interval, "an integer >= 1")
        _check(_finite_number(self.min_loss_scale) and 0 < self.min_loss_scale <= self.initial_loss_scale,
               "min_loss_scale", self.min_loss_scale, "a finite number in (0, initial_loss_scale]")
        _check(_one_of(self.checks, CHECKS, str), "checks", self.checks, f"one of {', '.join(map(repr, CHECKS))}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of parameters and gradients."""
        return DTYPES[self.dtype]

    @property
    def grad_dtype(self) -> torch.dtype:
        """The dtype gradients are accumulated and reduced in."""
        return DTYPES[self.reduce_dtype or self.dtype]

    def replace(self, **changes) -> "ZeroConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _one_of(value, allowed, kind: type) -> bool:
    """Whether `value`, of type `kind` (not a bool), is one of `allowed`. The type is checked first:
    a list or dict crashes a lookup in a dict (unhashable), and a tensor or array an `in` on a tuple
    (its == is elementwise), instead of reading as a bad value of the field."""
    return isinstance(value, kind) and not isinstance(value, bool) and value in allowed


def _finite_number(value) -> bool:
    """An int or float (not a bool) that a float holds finitely. Compared, not passed to
    math.isfinite, which raises OverflowError for an int beyond the floats' range."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and -sys.float_info.max <= value <= sys.float_info.max)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"ZeroConfig.{name} = {value!r} is not allowed: expected {allowed}")
