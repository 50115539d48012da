"""Stage 1 (Pos): optimizer states sharded.

Sharded: the fp32 master weights and both Adam moments (KΨ bytes) are split into Nd equal shards;
rank r keeps only shard r of each bucket, so optimizer state costs KΨ/Nd per rank. Parameters
(2Ψ) and gradients (2Ψ) stay full on every rank: 4Ψ + KΨ/Nd in all.

Everything else is stage 0's (this class changes only what differs): the same persistent flat
gradient buffer, filled by autograd through `.grad` views, buckets padded to a multiple of Nd.

Communicated, on the micro-batch that ends a step:
1. backward: as each gradient bucket completes, it is reduce-scattered (averaged) in place, so
   rank r ends up with the averaged gradient of exactly the shard it updates (Ψ elements per step);
   the rest of its buffer keeps its local gradients and is never read;
2. step: each rank updates its shard of the fp32 master and writes the rounded result into its
   shard of the flat parameter buffer, and all-gathers that bucket in place right away, while the
   next bucket updates (Ψ elements).
Reduce-scatter plus all-gather is exactly an all-reduce split in two, so the total stays 2Ψ, as
for plain data parallelism (paper Sec 7.2.1).

A further backward before the step (gradients accumulate) first all-gathers the averaged chunks
(Ψ elements), so the buffer is a full averaged gradient on every rank, as in stage 0.
"""

from __future__ import annotations

import torch

from .labels import label
from .stage0 import Stage0


class Stage1(Stage0):
    """Optimizer-state partitioning with full gradients and parameters."""

    grads_sharded = True
    replicated = False
    shard_states = True

    def _lay_out(self, order) -> None:
        self.scattered = False   # do the buckets hold averaged own chunks beside local gradients?
        super()._lay_out(order)

    def _segment(self, flat: torch.Tensor, g: int) -> torch.Tensor:
        """This rank's segment of group g in a full-length flat buffer: its own shard."""
        return self.layout.own_slice(flat, g, self.rank)

    def _reduce(self, g: int):
        """Average bucket g over the group in place: rank r's own chunk receives its average."""
        self.scattered = True
        bucket = self.grads.bucket(g)
        return self.comm.reduce_scatter(self._segment(self.grads.flat, g), bucket, async_op=self.config.overlap)

    def _regather_grads(self, in_step: bool = True) -> None:
        """Make the gradient buffer the full averaged gradient on every rank (see the docstring)."""
        with label("zero_ref::regather gradients"):   # a profiler label only
            for g in range(len(self.groups)):
                self.pending.append(self.comm.all_gather(
                    self.grads.bucket(g), self._segment(self.grads.flat, g), async_op=True, in_step=in_step))
            self._wait_pending()
        self.scattered = False

    def begin_backward(self, boundary: bool) -> None:
        if self.scattered:
            self._regather_grads()
        super().begin_backward(boundary)

    def _zero_grad_buffers(self) -> None:
        super()._zero_grad_buffers()
        self.scattered = False

    def _grad_state(self) -> tuple[torch.Tensor, bool]:
        if self.scattered:   # a layout change, not part of the step's traffic
            self._regather_grads(in_step=False)
        return self.grads.flat, False
