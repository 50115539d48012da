"""Stage 1 (Pos): optimizer states sharded.

Sharded: the fp32 master weights and both Adam moments (KΨ bytes) are split into Nd equal shards;
rank r keeps only shard r of each bucket, so optimizer state costs KΨ/Nd per rank. Parameters
(2Ψ) and gradients (2Ψ) stay full on every rank: 4Ψ + KΨ/Nd in all.

Communicated, at the last micro-batch of a step:
1. backward: as each gradient bucket completes, it is reduce-scattered (averaged) in place, so
   rank r ends up with the averaged gradient of exactly the shard it updates (Ψ elements per step);
   the rest of its gradient buffer is left as its local gradients and never read;
2. step: each rank updates its shard of the fp32 master and writes the rounded result into its
   shard of the flat parameter buffer;
3. after the update, each bucket of the parameter buffer is all-gathered in place (Ψ elements).
Reduce-scatter plus all-gather is exactly an all-reduce split in two, so the total stays 2Ψ, as
for plain data parallelism (paper Sec 7.2.1).

Layout: as stage 0, but every bucket is padded to a multiple of Nd so that it splits evenly.
"""

from __future__ import annotations

import torch
from torch import nn

from .comm import Comm
from .config import ZeroConfig
from .grad_hooks import FullGradBuckets, register_grad_hooks
from .optim import ShardedAdamW
from .partition import GroupLayout, flatten_params, pack_into_buckets
from .precision import make_fp32_master
from .stage_base import Stage


class Stage1(Stage):
    """Optimizer-state partitioning with full gradients and parameters."""

    def __init__(self, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm):
        super().__init__(trainable, config, comm)
        self.groups = pack_into_buckets(trainable[::-1], config.bucket_numel, self.world_size)
        self.layout = GroupLayout(self.groups)
        self.flat_params = flatten_params(self.layout, self.dtype, self.device, self.kernels.flatten_)
        self.flat_grads = torch.zeros_like(self.flat_params)
        self.param_shards = [self.layout.own_slice(self.flat_params, g, self.rank) for g in range(len(self.groups))]
        self.grad_shards = [self.layout.own_slice(self.flat_grads, g, self.rank) for g in range(len(self.groups))]
        self.optimizer = ShardedAdamW(make_fp32_master(self.param_shards), config, self.kernels)

        self.grad_buckets = FullGradBuckets(self.groups, self._grad_bucket, self._reduce_scatter)
        self.hooks = register_grad_hooks(self.groups, self.grad_buckets.add)

    def _grad_bucket(self, g: int) -> torch.Tensor:
        return self.layout.full_slice(self.flat_grads, g)

    def _reduce_scatter(self, g: int):
        """Average bucket g over the group in place: rank r's own chunk receives its average."""
        return self.comm.reduce_scatter_avg(self.grad_shards[g], self._grad_bucket(g), async_op=self.config.overlap)

    def begin_backward(self, boundary: bool) -> None:
        self.grad_buckets.begin_backward(boundary)

    def end_backward(self, boundary: bool) -> None:
        self.grad_buckets.end_backward(boundary)

    def after_update(self) -> None:
        self._all_gather_params(self.layout, self.flat_params, self.param_shards)

    def zero_grads(self) -> None:
        self.flat_grads.zero_()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_params], "grads": [self.flat_grads],
                "optimizer_states": self.optimizer.state_tensors()}
