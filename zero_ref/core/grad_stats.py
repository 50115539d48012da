"""The step's vote: the global gradient norm, the non-finite flag and which parameters got a
gradient, in one small all-reduce, with any named fields a guard adds.

Who counts what, so that every gradient element enters the sums exactly once:

* stages 1-3 shard the gradients: each data-parallel rank measures its own segments and the sum
  over the DP group covers every element once;
* stage 0 replicates them: every rank holds the same full gradients, so rank 0 measures them and
  the others add zeros;
* under model parallelism (tensor_parallel.py) a parameter split over the MP ranks has a different
  slice on each, but a replicated one (layer norms, row-parallel biases, position embeddings) has
  the same gradient on every MP rank: each contributes 1/Nm of its sum of squares, so the sum
  over the MP group counts it once.

The vote travels as named fields, never as offsets into a vector, and is decided exactly:

* counts (`StepVote.counts`: the guard's "how many ranks stepped", ...) are summed in fp64 with the
  norm, so they are exact integers for any number of ranks up to 2**53;
* values every rank must hold alike (`StepVote.same`: the guard's hyper-parameters, the micro-batch
  at which a backward raised) go in a second all-reduce, a MAX of each value and of its negation:
  every rank held the same x exactly when max(x) == -max(-x). No hash, no wrap-around. This second
  all-reduce is made only when a guard asks for such fields (checks="strict").
"""

from __future__ import annotations

import dataclasses

import torch

from .. import tensor_parallel


@dataclasses.dataclass
class StepVote:
    """What a step's vote told every rank (`GradStats.vote`)."""
    grads: list[torch.Tensor]           # this rank's gradient segments
    sum_sq: float = 0.0                 # of the averaged gradients, over every rank
    nonfinite: float = 0.0              # > 0: a non-finite gradient somewhere
    used: list[float] = dataclasses.field(default_factory=list)   # per parameter: ranks where it got a gradient
    counts: dict[str, float] = dataclasses.field(default_factory=dict)   # a guard's counts, summed
    same: dict[str, bool] = dataclasses.field(default_factory=dict)      # a guard's values: alike everywhere?


class GradStats:
    """The step's vote over the data-parallel ranks (and the norm's part over the MP ranks)."""

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

    def sum(self, stats: torch.Tensor, mp_slots: list[int] = (0, 1)) -> None:
        """Sum `stats` in place over the data-parallel ranks, then its entries at `mp_slots` over the
        MP ranks: the sum of squares and the flag (and whatever else must stop every MP rank)."""
        if self.comm.world_size > 1:
            self.comm.statistics(stats, "sum")
        if self.mp_comm is not None:
            head = stats[list(mp_slots)].clone()
            self.mp_comm.statistics(head, "sum")
            stats[list(mp_slots)] = head

    def vote(self, counts: dict[str, float], same: dict[str, list[float]], mp_counts: tuple[str, ...] = ()
             ) -> StepVote:
        """The step's vote: [sum of squares, non-finite flag, one 0/1 per parameter (did it get a
        gradient here?), `counts`...] summed over the ranks in fp64 (the norm's slots and `mp_counts`
        over the MP ranks too), then, if `same` has fields, the exact MAX vote on them; one host
        sync for each."""
        out = StepVote(grads=self.stage.grad_segments())
        names = list(counts)
        host = torch.tensor([*self.stage.used, *counts.values()], dtype=torch.float64)
        norm = self.local(out.grads).double()   # the statistics are summed on the host: one sync here
        stats = torch.cat([norm, host.to("meta")]) if norm.is_meta else torch.cat([norm.cpu(), host])
        n_used = len(self.stage.used)
        self.sum(stats, mp_slots=[0, 1, *(2 + n_used + names.index(n) for n in mp_counts)])
        if stats.is_meta:   # the engine at scale (analysis/at_scale.py): no gradient values; as if every one were
            out.used = [1.0] * n_used   # present and finite, so that the update makes its real allocations,
            out.counts = dict(counts)   # and a fake group sums nothing: the counts are this rank's own
        else:
            out.sum_sq, out.nonfinite, *rest = stats.tolist()
            out.used = rest[:n_used]
            out.counts = dict(zip(names, rest[n_used:]))
        if same:
            out.same = self._alike(same)
        return out

    def _alike(self, same: dict[str, list[float]]) -> dict[str, bool]:
        """For each field, whether every rank holds exactly the same values: one MAX all-reduce of
        [x, -x] in fp64 (each rank must send the same number of values per field)."""
        values = torch.tensor([v for field in same.values() for v in field], dtype=torch.float64)
        both = torch.cat([values, -values])
        if self.comm.world_size > 1:
            self.comm.statistics(both, "max")
        n, alike, start = len(values), {}, 0
        highest, negated_lowest = both[:n], both[n:]
        for name, field in same.items():
            end = start + len(field)
            alike[name] = bool(torch.equal(highest[start:end], -negated_lowest[start:end]))
            start = end
        return alike

    def _replicated_pieces(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's gradient pieces of parameters replicated across the MP group."""
        return [grads[g][offset:offset + end - start] for param, start, end, g, offset in self.stage.owned_pieces()
                if not tensor_parallel.is_model_parallel(param)]
