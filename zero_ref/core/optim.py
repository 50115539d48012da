"""Sharded AdamW over flat fp32 segments, and the step's vote that decides how to step.

A rank updates one *segment* per group: the fp32 master, the (loss-scaled) gradient and, in mixed
precision, the low-precision parameter segment that gets the rounded result. Masters and moments
are contiguous fp32 buffers laid out like the segments (in fp32 the master *is* the parameter
segment); one `triton_kernels.fused_adamw_` call per chunk of at most `bucket_numel` (CB).

As torch.optim.AdamW: each parameter takes its group's hyper-parameters, read at every step; one
that got no gradient on any rank is not updated (no weight decay); each counts its own steps.

The vote (`GradStats.vote`): [sum of squares, non-finite flag, one 0/1 per parameter, a guard's
named counts] summed across ranks in fp64 in one small all-reduce and read on the host once: that
sync decides skip (fp16's `LossScaler`) or step, and the clipping. Each gradient element enters the
sum once: stages 1-3 measure their shard; at stage 0 rank 0 measures, the others add zeros; a
parameter replicated over the MP ranks adds 1/Nm of its square from each. Values every rank must
hold alike (a guard's `same` fields) go in a MAX all-reduce of [x, -x]: alike exactly when
max(x) == -max(-x). No hash, no wrap-around.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import triton_kernels

from .. import tensor_parallel
from ..config import ZeroConfig


class ShardedAdamW:
    """torch.optim.AdamW over this rank's `param_segments` (one per group; the masters start as their
    fp32 values). `pieces`: (parameter index, param_start, param_end, g, segment_start) of every
    parameter piece in them; `kernels`: the triton_kernels backend that runs update and norm."""

    def __init__(self, param_segments: list[torch.Tensor], pieces, num_params: int, config: ZeroConfig,
                 kernels: triton_kernels.Kernels):
        self.config, self.kernels = config, kernels
        self.runs: list[list[tuple[int, int, int]]] = [[] for _ in param_segments]   # (start, end, param)
        for k, start, end, g, offset in pieces:
            self.runs[g].append((offset, offset + end - start, k))
        for runs in self.runs:
            runs.sort()
        self.param_steps = [0] * num_params   # updates applied to each parameter (its AdamW `step`)
        device = param_segments[0].device if param_segments else torch.device("cpu")
        total = sum(s.numel() for s in param_segments)
        if all(s.dtype == torch.float32 for s in param_segments):
            self.master_flat = None            # the parameter segments are the masters
            self.masters = list(param_segments)
            self.low_precision = [None] * len(param_segments)
        else:
            self.master_flat = torch.empty(total, dtype=torch.float32, device=device)
            self.masters = self._views(self.master_flat, param_segments)
            for master, segment in zip(self.masters, param_segments):
                master.copy_(segment)
            self.low_precision = list(param_segments)
        self.exp_avg_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq_flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avgs = self._views(self.exp_avg_flat, param_segments)
        self.exp_avg_sqs = self._views(self.exp_avg_sq_flat, param_segments)
        self.step_count = 0

    @staticmethod
    def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        views, start = [], 0
        for segment in like:
            views.append(flat[start:start + segment.numel()])
            start += segment.numel()
        return views

    def _chunks(self, grads: list[torch.Tensor]):
        size = self.config.bucket_numel
        for grad in grads:
            for start in range(0, grad.numel(), size):
                yield grad[start:start + size]

    # --- the norm and the overflow flag ----------------------------------------------------------
    def grad_stats(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """[sum of squares, 1.0 if any element is non-finite] over `grads`, on the device (no sync)."""
        device = self.exp_avg_flat.device
        sum_sq = torch.zeros((), dtype=torch.float32, device=device)
        nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        for chunk in self._chunks(grads):
            part, flag = self.kernels.norm_and_overflow(chunk)
            sum_sq += part
            nonfinite |= flag
        return torch.stack([sum_sq, nonfinite.float()])

    def sum_of_squares_fp64(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of squares in fp64, for finite gradients whose fp32 sum overflowed (rare)."""
        total = torch.zeros((), dtype=torch.float64, device=self.exp_avg_flat.device)
        for chunk in self._chunks(grads):
            total += chunk.double().square().sum()
        return total

    # --- the update ------------------------------------------------------------------------------
    def _updates(self, g: int, used: list[bool], group_of: list[int]):
        """[start, end, step, param group] of segment g to update: runs of used parameters that share
        a step count and a param group, merged."""
        merged: list[list[int]] = []
        for start, end, k in self.runs[g]:
            if not used[k]:
                continue
            key = [self.param_steps[k], group_of[k]]
            if merged and merged[-1][1] == start and merged[-1][2:] == key:
                merged[-1][1] = end
            else:
                merged.append([start, end, *key])
        return merged

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], grad_scale: float, used: list[bool], group_of: list[int],
             hyper: list[tuple[float, float, float, float, float]],
             on_segment_done: Callable[[int], None] | None = None) -> None:
        """One AdamW update of the used parameters, gradients times `grad_scale` (inverse loss scale
        times clipping); parameter k takes (lr, beta1, beta2, eps, weight_decay) `hyper[group_of[k]]`.
        `on_segment_done(g)` runs after segment g is written (stages 1-2 start its gather)."""
        self.step_count += 1
        for k, was_used in enumerate(used):
            self.param_steps[k] += int(was_used)
        chunk = self.config.bucket_numel
        for g, (master, grad, exp_avg, exp_avg_sq, out) in enumerate(zip(
                self.masters, grads, self.exp_avgs, self.exp_avg_sqs, self.low_precision)):
            for first, last, step, group in self._updates(g, used, group_of):
                lr, beta1, beta2, eps, weight_decay = hyper[group]
                for start in range(first, last, chunk):
                    part = slice(start, min(start + chunk, last))
                    self.kernels.fused_adamw_(
                        master[part], grad[part], exp_avg[part], exp_avg_sq[part],
                        None if out is None else out[part],
                        lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, step=step, grad_scale=grad_scale)
            if on_segment_done is not None:
                on_segment_done(g)

    @torch.no_grad()
    def write_params(self) -> None:
        """Round the masters into the low-precision parameter segments (after loading state)."""
        for master, out in zip(self.masters, self.low_precision):
            if out is not None:
                out.copy_(master)

    def flats(self) -> dict[str, torch.Tensor | None]:
        """The flat state buffers by kind (the master is None when it is the parameters)."""
        return {"master": self.master_flat, "exp_avg": self.exp_avg_flat, "exp_avg_sq": self.exp_avg_sq_flat}

    def state_tensors(self) -> list[torch.Tensor]:
        """The tensors that hold optimizer state (for memory accounting)."""
        return [*self.masters, self.exp_avg_flat, self.exp_avg_sq_flat]


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
        """This rank's [sum of squares, non-finite flag] as it enters the sums (fp64: the sum of
        squares alone, for squares that overflow fp32)."""
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
        """Sum `stats` in place over the data-parallel ranks, then its `mp_slots` over the MP ranks."""
        if self.comm.world_size > 1:
            self.comm.statistics(stats, "sum")
        if self.mp_comm is not None:
            head = stats[list(mp_slots)].clone()
            self.mp_comm.statistics(head, "sum")
            stats[list(mp_slots)] = head

    def vote(self, counts: dict[str, float], same: dict[str, list[float]], mp_counts: tuple[str, ...] = ()
             ) -> StepVote:
        """The step's vote (see the module docstring): one sum, and the MAX vote if `same` has fields."""
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
        """Per field, whether every rank holds exactly the same values (one MAX all-reduce of [x, -x])."""
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


@dataclasses.dataclass
class LossScaler:
    """fp16's dynamic loss scale (Micikevicius et al. 2018), or a constant 1.0 when disabled (fp32,
    bf16): the loss is multiplied by `scale` before backward and the gradients divided by it in the
    update; a non-finite gradient on any rank skips the step everywhere and halves the scale, and
    `growth_interval` clean steps double it. An overflow at `min_scale` raises FloatingPointError."""

    enabled: bool
    scale: float = 2.0**16
    growth_interval: int = 2000
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    clean_steps: int = 0

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0

    def update(self, found_overflow: bool, step: int) -> None:
        """After each step (`step`: its number, for the error): back off on overflow, else maybe grow."""
        if not self.enabled:
            return
        if found_overflow:
            if self.scale <= self.min_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflowed at step {step} with the loss scale already at "
                    f"min_loss_scale={self.min_scale:g}: the step was skipped, but lowering the scale "
                    "further is not allowed. Lower the learning rate, clip gradients, lower "
                    "ZeroConfig.min_loss_scale, or train in bf16")
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
