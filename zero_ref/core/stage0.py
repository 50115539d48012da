"""Stage 0: plain data parallelism, the paper's baseline.

Sharded: nothing. Every rank holds the full parameters (2Ψ bytes in bf16), the full gradients
(2Ψ) and the full fp32 master weights and Adam moments (KΨ = 12Ψ): 16Ψ in all.

Communicated: on the micro-batch that ends a step, each gradient bucket (at most `bucket_numel`
elements) is all-reduced, averaging over the data-parallel group, as soon as backward has produced
every gradient in it, so the reduction of late layers overlaps the backward of early ones. An
all-reduce of n elements moves 2n per rank, so a step moves 2Ψ. Every rank then runs the same
AdamW update on the same averaged gradients, which keeps the replicas identical without further
communication.

Layout (see bucketed.py): one flat parameter buffer and one flat gradient buffer, packed in the
order gradients arrive; every parameter is a view into the first, its `.grad` a view into the
second, so autograd accumulates straight into the buckets. The optimizer's segments are whole
buckets.
"""

from __future__ import annotations

import torch
from torch import nn

from .bucketed import BucketedStage, FullGradBuffer
from .partition import flatten_params


class Stage0(BucketedStage):
    """Plain data parallelism with bucketed, overlapped all-reduce."""

    grads_sharded = False   # every rank holds the same full averaged gradients
    replicated = True
    shard_states = False    # so buckets need no padding either

    def _lay_out(self, order: list[nn.Parameter]) -> None:
        self._set_layout(self._pack(order))
        self.flat_params = flatten_params(self.layout, self.dtype, self.device, self.kernels.flatten_)
        self.grads = FullGradBuffer(self.layout, self.grad_dtype, self.device, self.comm, self._reduce)
        self.optimizer = self._make_optimizer([self._segment(self.flat_params, g) for g in range(len(self.groups))])

    def _segment(self, flat: torch.Tensor, g: int) -> torch.Tensor:
        """This rank's segment of group g in a full-length flat buffer: the whole bucket."""
        return self.layout.full_slice(flat, g)

    def _reduce(self, g: int):
        """Average bucket g over the group, in place (moves 2n elements per rank)."""
        return self.comm.all_reduce(self.grads.bucket(g), "avg", async_op=self.config.overlap)

    # --- backward --------------------------------------------------------------------------------
    def _on_grad(self, g: int, i: int, param: nn.Parameter) -> None:
        self.grads.add(g, i, param)

    def begin_backward(self, boundary: bool) -> None:
        self.grads.begin_backward(boundary)

    def _end_backward(self, boundary: bool) -> None:
        self.grads.end_backward(boundary)

    # --- step and state --------------------------------------------------------------------------
    def grad_segments(self) -> list[torch.Tensor]:
        return [self._segment(self.grads.flat, g) for g in range(len(self.groups))]

    def _zero_grad_buffers(self) -> None:
        self.grads.zero()

    def _grad_state(self) -> tuple[torch.Tensor, bool]:
        return self.grads.flat, False

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_params], "grads": [self.grads.flat],
                "optimizer_states": self.optimizer.state_tensors(), "comm_buffers": []}
