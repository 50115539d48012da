"""Stage 0: plain data parallelism, the paper's baseline.

Sharded: nothing. Every rank holds the full parameters (2Ψ bytes in bf16), the full gradients
(2Ψ) and the full fp32 master weights and Adam moments (KΨ = 12Ψ): 16Ψ in all.

Communicated: each gradient bucket (at most `bucket_numel` elements) is all-reduced, averaging
over the data-parallel group, as soon as backward has produced every gradient in it, so the
reduction of late layers overlaps the backward of early ones. An all-reduce of n elements moves 2n
per rank, so a step moves 2Ψ. Every rank then runs the same AdamW update on the same averaged
gradients, which keeps the replicas identical without further communication.

Layout: parameters are packed in reverse registration order (roughly the order backward produces
their gradients) into one flat parameter buffer and one flat gradient buffer; every parameter is a
view into the first.
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


class Stage0(Stage):
    """Plain data parallelism with bucketed, overlapped all-reduce."""

    grads_sharded = False  # every rank holds the same full averaged gradients
    replicated = True

    def __init__(self, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm):
        super().__init__(trainable, config, comm)
        # Buckets are only for communication here: nothing is sharded, so no padding (world 1).
        self.groups = pack_into_buckets(trainable[::-1], config.bucket_numel, world_size=1)
        self.layout = GroupLayout(self.groups)
        self.flat_params = flatten_params(self.layout, self.dtype, self.device, self.kernels.flatten_)
        self.flat_grads = torch.zeros_like(self.flat_params)
        self.optimizer = ShardedAdamW(make_fp32_master([self.flat_params]), config, self.kernels)

        self.grad_buckets = FullGradBuckets(self.groups, self._grad_bucket, self._all_reduce)
        self.hooks = register_grad_hooks(self.groups, self.grad_buckets.add)

    def _grad_bucket(self, g: int) -> torch.Tensor:
        return self.layout.full_slice(self.flat_grads, g)

    def _all_reduce(self, g: int):
        """Average bucket g over the group, in place (moves 2n elements per rank)."""
        return self.comm.all_reduce_avg(self._grad_bucket(g), async_op=self.config.overlap)

    def begin_backward(self, boundary: bool) -> None:
        self.grad_buckets.begin_backward(boundary)

    def end_backward(self, boundary: bool) -> None:
        self.grad_buckets.end_backward(boundary)

    def grad_segments(self) -> list[torch.Tensor]:
        return [self.flat_grads]

    def low_precision_segments(self) -> list[torch.Tensor | None]:
        return self._low_precision([self.flat_params])

    def zero_grads(self) -> None:
        self.flat_grads.zero_()

    def full_master(self, g: int) -> torch.Tensor:
        return self.layout.full_slice(self.optimizer.masters[0], g).float().clone()

    def segment_of(self, g: int) -> tuple[int, int, int, int]:
        return 0, self.layout.full_offsets[g], 0, self.groups[g].padded_numel

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_params], "grads": [self.flat_grads],
                "optimizer_states": self.optimizer.state_tensors()}
