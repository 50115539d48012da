"""The step's gradient statistics over data- and model-parallel ranks: the global gradient norm
and the non-finite flag, from each rank's own gradients, in one all-reduce.

Who counts what, so that every gradient element enters the sums exactly once:

* stages 1-3 shard the gradients: each data-parallel rank measures its own segments and the sum
  over the DP group covers every element once;
* stage 0 replicates them: every rank holds the same full gradients, so rank 0 measures them and
  the others add zeros;
* under model parallelism (tensor_parallel.py) a parameter split over the MP ranks has a different
  slice on each, but a replicated one (layer norms, row-parallel biases, position embeddings) has
  the same gradient on every MP rank: each contributes 1/Nm of its sum of squares, so the sum
  over the MP group counts it once.

The engine appends its own agreement checks to the same tensor, so a step makes one small
all-reduce per group and one host sync (engine.step).
"""

from __future__ import annotations

import torch

from . import tensor_parallel


class GradStats:
    """[sum of squares, non-finite flag] of a stage's gradient segments, summed over the ranks."""

    def __init__(self, stage, comm, mp_comm):
        self.stage, self.comm, self.mp_comm = stage, comm, mp_comm

    def local(self, grads: list[torch.Tensor], fp64: bool = False) -> torch.Tensor:
        """This rank's [sum of squares, non-finite flag] as they enter the sums over the ranks
        (fp64: [the sum of squares in fp64] alone, for squares that overflow fp32)."""
        optimizer = self.stage.optimizer
        if not self.stage.grads_sharded and self.comm.rank != 0:
            return torch.zeros(1 if fp64 else 2, dtype=torch.float64 if fp64 else torch.float32,
                               device=self.stage.device)
        measure = (lambda pieces: optimizer.sum_of_squares_fp64(pieces).view(1)) if fp64 else optimizer.grad_stats
        stats = measure(grads)
        if self.mp_comm is not None:
            replicated = measure(self._replicated_pieces(grads))[0]
            stats[0] -= replicated * (1.0 - 1.0 / self.mp_comm.world_size)
        return stats

    def sum(self, stats: torch.Tensor, mp_slots: slice | list[int] = slice(0, 2)) -> None:
        """Sum `stats` in place over the data-parallel ranks, then its entries at `mp_slots` over the
        MP ranks: the sum of squares and the flag (and whatever else must stop every MP rank)."""
        if self.comm.world_size > 1:
            self.comm.all_reduce(stats, "sum")
        if self.mp_comm is not None:
            head = stats[mp_slots].clone()
            self.mp_comm.all_reduce(head, "sum")
            stats[mp_slots] = head

    def _replicated_pieces(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's gradient pieces of parameters replicated across the MP group."""
        return [grads[g][offset:offset + end - start] for param, start, end, g, offset in self.stage.owned_pieces()
                if not tensor_parallel.is_model_parallel(param)]
