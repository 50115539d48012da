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
all-reduce per group and one host sync (`GradStats.step_statistics`, read by engine.step and by a
rank whose backward raised): which parameters got a gradient, whether the ranks hold the same
hyper-parameters and failed at the same micro-batch (param_groups.py), whether parameters were
written or replaced from outside the engine, and how many ranks sent them from step() (the others
reached the same step boundary and went on without stepping: step_failures.py).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import tensor_parallel
from .param_groups import agreement, agreement_stats, failure_disagreement


@dataclasses.dataclass
class StepStatistics:
    """What a step's statistics all-reduce told every rank (`GradStats.step_statistics`)."""
    grads: list[torch.Tensor]                  # this rank's gradient segments
    hyper: list[tuple] | None = None           # this rank's hyper-parameters (None: invalid here)
    hyper_error: ValueError | None = None      # why they are invalid here
    detached: list = dataclasses.field(default_factory=list)   # parameters whose .data was replaced here
    unfrozen: list = dataclasses.field(default_factory=list)   # frozen at initialize, trainable now
    sum_sq: float = 0.0                        # of the averaged gradients, over every rank
    nonfinite: float = 0.0                     # > 0: a non-finite gradient somewhere
    used: list[float] = dataclasses.field(default_factory=list)   # per parameter: ranks where it got a gradient
    written: float = 0.0                       # ranks whose parameters were written from outside
    stepping: float = 0.0                      # ranks that sent these statistics from step()
    discarding: float = 0.0                    # ranks that sent them dropping the step (zero_grad, a load)
    discarded: float = 0.0                     # ranks whose zero_grad() dropped gradients of this step's
                                               # earlier micro-batches
    detached_anywhere: float = 0.0             # parameters detached or unfrozen, over every rank
    failure_disagrees: str | None = None       # param_groups.failure_disagreement
    disagreement: str | None = None            # param_groups.agreement


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
            self.comm.sum_statistics(stats)
        if self.mp_comm is not None:
            head = stats[mp_slots].clone()
            self.mp_comm.sum_statistics(head)
            stats[mp_slots] = head

    def step_statistics(self, optimizer, frozen: list[nn.Parameter], failed_at: int, ranks: int,
                        stepping: bool, discarding: bool = False, discarded: bool = False) -> StepStatistics:
        """The step's one small all-reduce and host sync: [sum of squares, non-finite flag, one 0/1
        per parameter (did it get a gradient?), the hyper-parameters' agreement fingerprint and
        `failed_at` (the micro-batch at which this rank's forward or backward raised, 0: none;
        param_groups.agreement_stats), were the parameters written from outside (1/0), is this
        `stepping` (sent by step(), 1/0), `discarding` (sent by a call that drops the step, 1/0),
        `discarded` (zero_grad dropped gradients of this step's earlier micro-batches, 1/0), how many
        parameters left the stage's buffers], summed
        over the ranks (`ranks` of them; stage 0: only
        rank 0's sum of squares and flag count; the first two and the last over the MP ranks too),
        then read on the host. `optimizer`: the engine's parameter groups; `frozen`: the parameters
        frozen at initialize."""
        stage = self.stage
        out = StepStatistics(grads=stage.grad_segments())
        try:
            out.hyper = optimizer.hyperparameters()
        except ValueError as err:   # raised by step on every rank alike, after the statistics
            out.hyper_error = err
        out.detached = stage.detached()
        out.unfrozen = [p for p in frozen if p.requires_grad]   # trainable now, but never sharded
        extra = [*agreement_stats(out.hyper, failed_at), float(stage.params_written()), float(stepping),
                 float(discarding), float(discarded), float(len(out.detached) + len(out.unfrozen))]
        stats = torch.cat([self.local(out.grads), stage.used_mask(extra)])
        self.sum(stats, mp_slots=[0, 1, -1])
        n_used = len(stats) - 2 - len(extra)
        if stats.is_meta:   # the engine at scale (at_scale.py): no values; as if every gradient were
            out.used = [1.0] * n_used   # present and finite, so that the update makes its real allocations
            return out
        out.sum_sq, out.nonfinite, *rest = stats.tolist()
        out.used, summed_agree = rest[:n_used], rest[n_used:-5]
        out.written, out.stepping, out.discarding, out.discarded, out.detached_anywhere = rest[-5:]
        out.failure_disagrees = failure_disagreement(summed_agree, ranks)
        out.disagreement = agreement(summed_agree, ranks)
        return out

    def _replicated_pieces(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's gradient pieces of parameters replicated across the MP group."""
        return [grads[g][offset:offset + end - start] for param, start, end, g, offset in self.stage.owned_pieces()
                if not tensor_parallel.is_model_parallel(param)]


def detached_message(model: nn.Module, dtype: torch.dtype, detached: list[nn.Parameter],
                     unfrozen: list[nn.Parameter]) -> str:
    """Why step refuses, on every rank, when a parameter's .data was replaced on any rank (or a
    parameter frozen at initialize was made trainable)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    if unfrozen:
        which = ", ".join(repr(names.get(id(p), "?")) for p in unfrozen)
        return (f"parameters frozen at initialize were made trainable after it ({which} on this rank): the "
                "engine neither shards nor updates them. Nothing was updated on any rank. "
                "Set requires_grad before zero_ref.initialize (build a new engine for a new set of "
                "trainable parameters)")
    here = ", ".join(f"{names.get(id(p), '?')!r} (now {str(p.dtype).removeprefix('torch.')}, storage of its "
                     "own)" for p in detached)
    where = f"on this rank: {here}" if here else "on another rank"
    dtype = str(dtype).removeprefix("torch.")
    return (f"zero-ref's parameters were replaced after initialize, or frozen ones made trainable ({where}): "
            "something set their .data (Module.to(dtype), .float(), .half(), param.data = ...), so the model "
            "no longer reads the values the optimizer updates. Nothing was updated on any rank. Keep every "
            f"trainable parameter in the engine's dtype ({dtype}) and write values with "
            "engine.load_state_dict(...) instead. Hugging Face's Switch "
            "Transformers router calls self.classifier.to(router_dtype) in every forward: give it "
            f"SwitchTransformersConfig(router_dtype='{dtype}').")
