"""AdamW over flat fp32 shards.

What a rank updates is a list of flat segments, one per group (see partition.py): the fp32 master
segment, the gradient segment (in the model dtype, still multiplied by the loss scale) and, in
mixed precision, the low-precision parameter segment that receives the rounded result. The moments
live in two contiguous fp32 buffers of the rank's shard length. The update itself is one call per
segment into `triton_kernels` (the fused Triton kernel on CUDA, its torch twin elsewhere), so there
is no per-parameter Python loop on this path; segments longer than `bucket_numel` are updated in
chunks of that size, which bounds the temporaries of the torch twin (the paper's constant buffers).

Before the update, the caller learns the global gradient norm from `local_sum_of_squares`:
squares are summed on each rank's segments and added across ranks with one scalar all-reduce. The
same number detects fp16 overflow: it is non-finite exactly when some gradient is.
"""

from __future__ import annotations

import torch

import triton_kernels

from .config import ZeroConfig


class ShardedAdamW:
    """AdamW with torch.optim.AdamW's semantics over the segments one rank owns.

    Args:
        masters: fp32 master segments (views; they may alias fp32 parameters).
        config: hyper-parameters.
        kernels: the `triton_kernels.load(...)` backend that runs the update and the norm.
    """

    def __init__(self, masters: list[torch.Tensor], config: ZeroConfig, kernels: triton_kernels.Kernels):
        self.masters = masters
        self.config = config
        device = masters[0].device if masters else torch.device("cpu")
        self.kernels = kernels
        total = sum(m.numel() for m in masters)
        self.exp_avg_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avgs, self.exp_avg_sqs = [], []
        start = 0
        for master in masters:
            self.exp_avgs.append(self.exp_avg_flat[start:start + master.numel()])
            self.exp_avg_sqs.append(self.exp_avg_sq_flat[start:start + master.numel()])
            start += master.numel()
        self.step_count = 0

    def local_sum_of_squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Sum of squares (fp32, 0-d tensor) over this rank's gradient segments, in chunks of at
        most `bucket_numel` elements (so the torch twin's fp32 temporaries stay constant-size)."""
        total = torch.zeros((), dtype=torch.float32, device=self.exp_avg_flat.device)
        chunk = self.config.bucket_numel
        for grad in grads:
            for start in range(0, grad.numel(), chunk):
                sum_sq, _ = self.kernels.norm_and_overflow(grad[start:start + chunk])
                total += sum_sq
        return total

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], low_precision_outs: list[torch.Tensor | None],
             grad_scale: float) -> None:
        """One AdamW update of every segment; `grad_scale` multiplies the gradients first (loss-scale
        inverse times the clipping coefficient)."""
        self.step_count += 1
        beta1, beta2 = self.config.betas
        chunk = self.config.bucket_numel   # bounds the torch twin's temporaries (constant buffers)
        for master, grad, exp_avg, exp_avg_sq, out in zip(
                self.masters, grads, self.exp_avgs, self.exp_avg_sqs, low_precision_outs):
            for start in range(0, master.numel(), chunk):
                part = slice(start, start + chunk)
                self.kernels.fused_adamw_(
                    master[part], grad[part], exp_avg[part], exp_avg_sq[part],
                    None if out is None else out[part],
                    lr=self.config.lr, beta1=beta1, beta2=beta2, eps=self.config.eps,
                    weight_decay=self.config.weight_decay, step=self.step_count, grad_scale=grad_scale)

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold optimizer state (for memory accounting)."""
        return [*self.masters, self.exp_avg_flat, self.exp_avg_sq_flat]
