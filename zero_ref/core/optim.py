"""AdamW over flat fp32 segments, and the gradient-norm statistics that decide how to step.

What a rank updates is a list of *segments*, one per group (see the engine's vocabulary): the
fp32 master segment, the gradient segment (in the reduce dtype, still multiplied by the loss
scale) and, in mixed precision, the low-precision parameter segment that receives the rounded
result. Masters and both moments live in contiguous fp32 buffers (`master_flat`, `exp_avg_flat`,
`exp_avg_sq_flat`) laid out like the segments. In fp32 training the master *is* the parameter
segment: no second copy. The update is one call per segment chunk into `triton_kernels` (the fused
Triton kernel on CUDA, its torch twin elsewhere); chunks of at most `bucket_numel` bound the torch
twin's temporaries (the paper's constant-size buffers).

Each parameter takes the hyper-parameters of its parameter group (param_groups.py), read afresh
at every step, so a learning-rate schedule applies exactly on the next step.

Like torch.optim.AdamW, a parameter that got no gradient in a step (on any rank) is not updated at
all (no weight decay either), and each parameter counts its own steps for the bias correction: the
engine passes which parameters were used, and each segment is updated in runs of consecutive
parameters that share a step count (one run per segment when every parameter was used).

Before the update the engine asks `grad_stats` for [sum of squares, non-finite flag] over this
rank's segments, one fused pass per chunk (the kernels' `norm_and_overflow`), sums them across
ranks with one two-element all-reduce and reads them on the host once: that single sync decides
skip or step (fp16 overflow, `nonfinite`) and the clipping coefficient. Overflow comes from the
kernels' isfinite flag, never from the sum: finite gradients whose squares overflow fp32 have their
sum recomputed in fp64 (`sum_of_squares_fp64`, the rare path).
"""

from __future__ import annotations

from typing import Callable

import torch

import triton_kernels

from ..config import ZeroConfig


class ShardedAdamW:
    """AdamW with torch.optim.AdamW's semantics over the segments one rank owns.

    Args:
        param_segments: this rank's parameter segments (views of the flat parameter buffers), one per
            group; the masters start as their fp32 values.
        pieces: (parameter index, param_start, param_end, g, segment_start) for every parameter piece
            in the segments (the stage's `owned_pieces`, with the parameter's index among the
            trainable ones).
        num_params: how many trainable parameters there are (the length of `used` in `step`).
        config: its bucket_numel bounds each update call (the hyper-parameters come with each step).
        kernels: the `triton_kernels.load(...)` backend that runs the update and the norm.
    """

    def __init__(self, param_segments: list[torch.Tensor], pieces, num_params: int, config: ZeroConfig,
                 kernels: triton_kernels.Kernels):
        self.config, self.kernels = config, kernels
        self.runs: list[list[tuple[int, int, int]]] = [[] for _ in param_segments]   # (start, end, param)
        for k, start, end, g, offset in pieces:
            self.runs[g].append((offset, offset + end - start, k))
        for runs in self.runs:
            runs.sort()
        self.param_steps = [0] * num_params   # updates applied to each parameter (its AdamW `step`)
        device = param_segments[0].device if param_segments else torch.device("cpu")
        total = sum(s.numel() for s in param_segments)
        if all(s.dtype == torch.float32 for s in param_segments):
            self.master_flat = None            # the parameter segments are the masters
            self.masters = list(param_segments)
            self.low_precision = [None] * len(param_segments)
        else:
            self.master_flat = torch.empty(total, dtype=torch.float32, device=device)
            self.masters = self._views(self.master_flat, param_segments)
            for master, segment in zip(self.masters, param_segments):
                master.copy_(segment)
            self.low_precision = list(param_segments)
        self.exp_avg_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avgs = self._views(self.exp_avg_flat, param_segments)
        self.exp_avg_sqs = self._views(self.exp_avg_sq_flat, param_segments)
        self.step_count = 0

    @staticmethod
    def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        views, start = [], 0
        for segment in like:
            views.append(flat[start:start + segment.numel()])
            start += segment.numel()
        return views

    def _chunks(self, grads: list[torch.Tensor]):
        size = self.config.bucket_numel
        for grad in grads:
            for start in range(0, grad.numel(), size):
                yield grad[start:start + size]

    # --- the norm and the overflow flag ----------------------------------------------------------
    def grad_stats(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """[sum of squares, 1.0 if any element is inf or NaN else 0.0] over `grads`: an fp32 tensor of
        two elements on the device (no host sync), one fused pass per chunk."""
        device = self.exp_avg_flat.device
        sum_sq = torch.zeros((), dtype=torch.float32, device=device)
        nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        for chunk in self._chunks(grads):
            part, flag = self.kernels.norm_and_overflow(chunk)
            sum_sq += part
            nonfinite |= flag
        return torch.stack([sum_sq, nonfinite.float()])

    def sum_of_squares_fp64(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of squares in fp64, for finite gradients whose fp32 sum overflowed (rare)."""
        total = torch.zeros((), dtype=torch.float64, device=self.exp_avg_flat.device)
        for chunk in self._chunks(grads):
            total += chunk.double().square().sum()
        return total

    # --- the update ------------------------------------------------------------------------------
    def _updates(self, g: int, used: list[bool], group_of: list[int]):
        """[start, end, step, parameter group] ranges of segment g to update: consecutive used
        parameters that share a step count and a parameter group (hence hyper-parameters), merged."""
        merged: list[list[int]] = []
        for start, end, k in self.runs[g]:
            if not used[k]:
                continue
            key = [self.param_steps[k], group_of[k]]
            if merged and merged[-1][1] == start and merged[-1][2:] == key:
                merged[-1][1] = end
            else:
                merged.append([start, end, *key])
        return merged

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], grad_scale: float, used: list[bool], group_of: list[int],
             hyper: list[tuple[float, float, float, float, float]],
             on_segment_done: Callable[[int], None] | None = None) -> None:
        """One AdamW update of the used parameters in every segment; `grad_scale` multiplies the
        gradients first (loss-scale inverse times the clipping coefficient). Parameter k takes the
        hyper-parameters (lr, beta1, beta2, eps, weight_decay) of its group, `hyper[group_of[k]]`
        (param_groups.py). `on_segment_done(g)` runs after segment g is written (stages 1-2 start
        gathering that group's parameters while the next segment updates)."""
        self.step_count += 1
        for k, was_used in enumerate(used):
            self.param_steps[k] += int(was_used)
        chunk = self.config.bucket_numel
        for g, (master, grad, exp_avg, exp_avg_sq, out) in enumerate(zip(
                self.masters, grads, self.exp_avgs, self.exp_avg_sqs, self.low_precision)):
            for first, last, step, group in self._updates(g, used, group_of):
                lr, beta1, beta2, eps, weight_decay = hyper[group]
                for start in range(first, last, chunk):
                    part = slice(start, min(start + chunk, last))
                    self.kernels.fused_adamw_(
                        master[part], grad[part], exp_avg[part], exp_avg_sq[part],
                        None if out is None else out[part],
                        lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, step=step, grad_scale=grad_scale)
            if on_segment_done is not None:
                on_segment_done(g)

    @torch.no_grad()
    def write_params(self) -> None:
        """Round the masters into the low-precision parameter segments (after loading state)."""
        for master, out in zip(self.masters, self.low_precision):
            if out is not None:
                out.copy_(master)

    def flats(self) -> dict[str, torch.Tensor | None]:
        """The flat state buffers by kind (the master is None when it is the parameters)."""
        return {"master": self.master_flat, "exp_avg": self.exp_avg_flat, "exp_avg_sq": self.exp_avg_sq_flat}

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold optimizer state (for memory accounting)."""
        return [*self.masters, self.exp_avg_flat, self.exp_avg_sq_flat]
