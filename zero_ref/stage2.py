"""Stage 2 (Pos+g): optimizer states and gradients sharded.

Sharded: as stage 1, plus the gradients: rank r keeps only the averaged gradients of the shard it
updates, 2Ψ/Nd bytes. Parameters stay full: 2Ψ + (2 + K)Ψ/Nd in all.

Communicated, on every micro-batch:
1. backward: each parameter's gradient is copied into a constant-size bucket buffer (CB) as soon as
   autograd has produced it, and `.grad` is dropped. When a bucket is complete it is
   reduce-scattered (averaged) in place, rank r adds chunk r to its gradient shard, and the bucket
   buffer is freed. With `overlap`, at most two buckets are in flight while backward goes on, so
   gradient memory never grows with the model (Ψ elements per step);
2. step: each rank updates its shard, then every bucket of the parameter buffer is all-gathered in
   place (Ψ elements): 2Ψ in all, the same as plain data parallelism (paper Sec 7.2.1).
With gradient accumulation each micro-batch is reduce-scattered and added into the shard, since no
rank may keep the full gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import Comm
from .config import ZeroConfig
from .grad_hooks import GroupArrivals, ShardedGradBuckets, register_grad_hooks
from .optim import ShardedAdamW
from .partition import GroupLayout, flatten_params, pack_into_buckets
from .precision import make_fp32_master
from .stage_base import Stage

class Stage2(Stage):
    """Gradient and optimizer-state partitioning with full parameters."""

    def __init__(self, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm):
        super().__init__(trainable, config, comm)
        self.groups = pack_into_buckets(trainable[::-1], config.bucket_numel, self.world_size)
        self.layout = GroupLayout(self.groups)
        self.flat_params = flatten_params(self.layout, self.dtype, self.device, self.kernels.flatten_)
        self.param_shards = [self.layout.own_slice(self.flat_params, g, self.rank) for g in range(len(self.groups))]
        self.flat_grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.grad_shards = [self.layout.shard_slice(self.flat_grad_shard, g) for g in range(len(self.groups))]
        self.optimizer = ShardedAdamW(make_fp32_master(self.param_shards), config, self.kernels)

        self.buckets = ShardedGradBuckets(comm, self.groups, self.grad_shards, self.dtype, self.device,
                                          config.overlap)
        self.arrivals = GroupArrivals(self.groups, self.buckets.reduce_scatter)
        self.hooks = register_grad_hooks(self.groups, self._on_grad)

    def _on_grad(self, g: int, i: int, param: nn.Parameter) -> None:
        self.buckets.add(g, i, param.grad)
        param.grad = None
        self.arrivals.arrive(g, i)

    def begin_backward(self, boundary: bool) -> None:
        self.arrivals.reset()

    def end_backward(self, boundary: bool) -> None:
        self.arrivals.flush()
        self.buckets.drain()

    def after_update(self) -> None:
        self._all_gather_params(self.layout, self.flat_params, self.param_shards)

    def zero_grads(self) -> None:
        self.flat_grad_shard.zero_()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_params], "grads": [self.flat_grad_shard, *self.buckets.live()],
                "optimizer_states": self.optimizer.state_tensors()}
