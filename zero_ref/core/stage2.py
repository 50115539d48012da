"""Stage 2 (Pos+g): optimizer states and gradients sharded.

Sharded: as stage 1, plus the gradients: rank r keeps only the averaged gradients of the shard it
updates, 2Ψ/Nd bytes. Parameters stay full: 2Ψ + (2 + K)Ψ/Nd in all.

Communicated, on every micro-batch:
1. backward: just before a bucket's first gradient arrives, the bucket takes a constant-size
   buffer from a small pool (CB) and its parameters' `.grad` point into it, so autograd accumulates
   there. A complete bucket is reduce-scattered (averaged) in place, rank r adds chunk r to its
   gradient shard, and the buffer goes back to the pool; with `overlap` one bucket fills while the
   previous one reduces (Ψ elements per step). A parameter larger than a bucket is a group of its
   own, reduce-scattered from autograd's gradient in bucket-size pieces, so no buffer outgrows CB;
2. step: each rank updates its shard and all-gathers that bucket's parameters in place while the
   next bucket updates (Ψ elements): 2Ψ in all, the same as plain data parallelism (Sec 7.2.1).
With gradient accumulation each micro-batch is reduce-scattered and added into the shard, since no
rank may keep the full gradients.

Layout: as stages 0-1 (bucketed.py), padded to a multiple of Nd; no full gradient buffer.
"""

from __future__ import annotations

import torch
from torch import nn

from .bucketed import BucketedStage
from .grad_buffers import GroupArrivals, ShardedGradBuckets
from .partition import flatten_params


class Stage2(BucketedStage):
    """Gradient and optimizer-state partitioning with full parameters."""

    binds_per_backward = True

    def _lay_out(self, order: list[nn.Parameter]) -> None:
        self._set_layout(self._pack(order))
        self.flat_params = flatten_params(self.layout, self.dtype, self.device, self.kernels.flatten_)
        self.param_shards = [self.layout.own_slice(self.flat_params, g, self.rank) for g in range(len(self.groups))]
        self.flat_grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        self.grad_shards = [self.layout.shard_slice(self.flat_grad_shard, g) for g in range(len(self.groups))]
        self.optimizer = self._make_optimizer(self.param_shards)
        self.buckets = ShardedGradBuckets(self.comm, self.groups, self.grad_shards, self.grad_dtype, self.device,
                                          self.config.overlap, self.config.bucket_numel)
        self.arrivals = GroupArrivals(self.groups, self.buckets.reduce_scatter)

    # --- backward --------------------------------------------------------------------------------
    def _bind(self, g: int) -> None:
        self.buckets.bind(g)

    def _on_grad(self, g: int, i: int, param: nn.Parameter) -> None:
        self.buckets.add(g, i, param)
        self.arrivals.arrive(g, i)

    def begin_backward(self, boundary: bool) -> None:
        self.arrivals.reset()

    def _end_backward(self, boundary: bool) -> None:
        self.arrivals.flush()
        self.buckets.drain()

    # --- step and state --------------------------------------------------------------------------
    def grad_segments(self) -> list[torch.Tensor]:
        return self.grad_shards

    def _zero_grad_buffers(self) -> None:
        self.buckets.discard()   # what a backward that raised left behind
        self.flat_grad_shard.zero_()

    def _grad_state(self) -> tuple[torch.Tensor, bool]:
        return self.flat_grad_shard, True

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_params], "grads": [self.flat_grad_shard],
                "optimizer_states": self.optimizer.state_tensors(), "comm_buffers": self.buckets.buffers()}
