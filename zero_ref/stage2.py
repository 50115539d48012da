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

from collections import deque

import torch
from torch import nn

from .comm import Comm
from .config import ZeroConfig
from .grad_hooks import GroupArrivals, register_grad_hooks
from .optim import ShardedAdamW
from .partition import GroupLayout, flatten_params, pack_into_buckets
from .precision import make_fp32_master
from .stage_base import Stage

MAX_BUCKETS_IN_FLIGHT = 2


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

        self.grad_buckets: dict[int, torch.Tensor] = {}   # group -> bucket buffer being filled
        self.in_flight: deque = deque()                   # (group, bucket buffer, work handle)
        self.arrivals = GroupArrivals(self.groups, self._launch_reduce_scatter)
        self.hooks = register_grad_hooks(self.groups, self._on_grad)

    def _grad_bucket(self, g: int) -> torch.Tensor:
        if g not in self.grad_buckets:
            self.grad_buckets[g] = torch.zeros(self.groups[g].padded_numel, dtype=self.dtype, device=self.device)
        return self.grad_buckets[g]

    def _on_grad(self, g: int, i: int, param: nn.Parameter) -> None:
        start = self.groups[g].offsets[i]
        self._grad_bucket(g)[start:start + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None
        self.arrivals.arrive(g, i)

    def _launch_reduce_scatter(self, g: int) -> None:
        grad_bucket = self._grad_bucket(g)
        del self.grad_buckets[g]
        lo, hi = self.groups[g].shard_range(self.rank)
        work = self.comm.reduce_scatter_avg(grad_bucket[lo:hi], grad_bucket, async_op=self.config.overlap)
        self.in_flight.append((g, grad_bucket, work))
        self._drain(MAX_BUCKETS_IN_FLIGHT if self.config.overlap else 0)

    def _drain(self, keep: int) -> None:
        """Finish reductions until at most `keep` are in flight: add each result into the shard."""
        while len(self.in_flight) > keep:
            g, grad_bucket, work = self.in_flight.popleft()
            if work is not None:
                work.wait()
            lo, hi = self.groups[g].shard_range(self.rank)
            self.grad_shards[g].add_(grad_bucket[lo:hi])

    def begin_backward(self, boundary: bool) -> None:
        self.arrivals.reset()

    def end_backward(self, boundary: bool) -> None:
        self.arrivals.flush()
        self._drain(0)

    def grad_segments(self) -> list[torch.Tensor]:
        return self.grad_shards

    def low_precision_segments(self) -> list[torch.Tensor | None]:
        return self._low_precision(self.param_shards)

    def after_update(self) -> None:
        self._all_gather_params(self.layout, self.flat_params, self.param_shards)

    def zero_grads(self) -> None:
        self.flat_grad_shard.zero_()

    def full_master(self, g: int) -> torch.Tensor:
        return self._gather_master(g, self.optimizer.masters[g])

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        live_buckets = [*self.grad_buckets.values(), *(bucket for _, bucket, _ in self.in_flight)]
        return {"params": [self.flat_params], "grads": [self.flat_grad_shard, *live_buckets],
                "optimizer_states": self.optimizer.state_tensors()}
