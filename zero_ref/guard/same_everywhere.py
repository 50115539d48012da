"""What `initialize` checks across the ranks before anything changes.

Every rank builds its own engine, and the engines then talk by position: a bucket reduced on one
rank pairs with whatever the others reduce at that point. Ranks that hold different models, pass
different configs (another `bucket_numel` lays out other buckets; another stage issues other
collectives) or group the parameters differently would pair the wrong collectives: the backend
aborts on a size mismatch, or the numbers are silently wrong. So each rank sends one description
of what it was given (`all_gather_object` on the control channel, once per engine), and every
rank raises the same ValueError, naming the first difference, when they differ; a `param_groups`
refused on some ranks only is refused on every rank. Values are compared later the same way, by a
digest of each tensor (`value_digest`, `ranks_with_other_values`): a state dict given to
`engine.load_state_dict`, parameters written in place from outside the engine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import nn

from ..core.comm import Comm
from ..config import ZeroConfig
from ..param_groups import HYPER_KEYS
from .refusals import gather_refusals, raise_refusals


def check_same_everywhere(model: nn.Module, comm: Comm, config: ZeroConfig,
                          build_groups: Callable[[], list[dict]], refused: Exception | None = None,
                          from_meta: bool = False) -> list[dict]:
    """The parameter groups `build_groups()` returns, once every rank has found the same model
    (names, shapes, requires_grad, and `from_meta`: built on the meta device), the same config and
    the same groups (members and values). `refused`: this rank cannot take the model (initialize's
    own checks); every rank then raises."""
    groups = None
    if refused is None:
        try:
            groups = build_groups()
        except (TypeError, ValueError) as err:
            refused = err
    params = model.named_parameters(remove_duplicate=False)
    mine = {"params": [(name, tuple(p.shape), p.requires_grad) for name, p in params], "from_meta": from_meta,
            "config": dataclasses.asdict(config),
            "groups": None if groups is None else _describe(groups, model)}
    refusals, everyone = gather_refusals(comm, refused, mine)
    _check_models(everyone)       # a model or config that differs is named first: it explains a refusal
    _check_configs(everyone)
    raise_refusals(refused, refusals, "zero_ref.initialize",
                   consequence="nothing was changed on any rank (every rank must be able to take the same model, "
                               "config and param_groups)")
    _check_groups(everyone)
    return groups


def _describe(groups: list[dict], model: nn.Module) -> list[tuple]:
    """Each group as (its parameters' names, its hyper-parameters), comparable across ranks."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(sorted(names[id(p)] for p in group["params"]), tuple(repr(group[k]) for k in HYPER_KEYS))
            for group in groups]


def _check_models(everyone: list[dict]) -> None:
    """Every rank must hold the same parameter names and shapes, built the same way; say where they
    first differ."""
    built = [each["from_meta"] for each in everyone]
    if len(set(built)) > 1:
        raise ValueError(f"models differ across ranks: rank(s) {', '.join(str(r) for r, b in enumerate(built) if b)} "
                         "built theirs on the meta device (sharded construction: values made by initialize), the others "
                         "did not. Every rank must build the model the same way")
    reference = everyone[0]["params"]
    for rank, theirs in enumerate(each["params"] for each in everyone):
        if theirs == reference:
            continue
        for i, (a, b) in enumerate(zip(reference, theirs)):
            if a != b:
                raise ValueError(f"models differ across ranks: parameter #{i} is {a[0]} {a[1]} "
                                 f"(requires_grad={a[2]}) on rank 0 but {b[0]} {b[1]} "
                                 f"(requires_grad={b[2]}) on rank {rank}")
        raise ValueError(f"models differ across ranks: rank 0 has {len(reference)} parameters, "
                         f"rank {rank} has {len(theirs)}")


def _check_configs(everyone: list[dict]) -> None:
    reference = everyone[0]["config"]
    for rank, theirs in enumerate(each["config"] for each in everyone):
        differ = [key for key in reference if theirs[key] != reference[key]]
        if differ:
            which = ", ".join(f"{key}={reference[key]!r} on rank 0 but {theirs[key]!r} on rank {rank}"
                              for key in differ)
            raise ValueError(f"ZeroConfig differs across ranks: {which}. Every rank must pass the same config "
                             "(the ranks' collectives pair up by position)")


def _check_groups(everyone: list[dict]) -> None:
    reference = everyone[0]["groups"]
    for rank, theirs in enumerate(each["groups"] for each in everyone):
        if theirs == reference:
            continue
        if len(theirs) != len(reference):
            raise ValueError(f"param_groups differ across ranks: {len(reference)} groups on rank 0, {len(theirs)} on "
                             f"rank {rank}")
        for i, ((members_0, hyper_0), (members, hyper)) in enumerate(zip(reference, theirs)):
            if members != members_0:
                only_0, only_here = sorted(set(members_0) - set(members)), sorted(set(members) - set(members_0))
                where = (f"{only_here[:3]} on rank {rank} but not on rank 0" if only_here else
                         f"{only_0[:3]} on rank 0 but not on rank {rank}")
                raise ValueError(f"param_groups differ across ranks: group {i} holds {where}. Every rank must "
                                 "group the parameters alike")
            if hyper != hyper_0:
                values = ", ".join(f"{key}={a} on rank 0 but {b} on rank {rank}"
                                   for key, a, b in zip(HYPER_KEYS, hyper_0, hyper) if a != b)
                raise ValueError(f"param_groups differ across ranks: group {i} has {values}")


def value_digest(values: list[torch.Tensor]) -> list[tuple[float, ...]]:
    """Each tensor's fp64 (sum, sum of magnitudes, sum of squares) over its finite elements and its
    counts of NaN, +inf and -inf: a few numbers per tensor that ranks exchange to learn whether they
    hold the same values. Non-finite elements are counted apart because, summed in, one NaN makes
    every sum NaN, which equals nothing: not the same NaN on another rank, nor hides a finite
    element that differs beside it."""
    def sums(v: torch.Tensor) -> torch.Tensor:
        d = v.detach().double()   # any dtype, bool and integer buffers included
        finite = torch.where(d.isfinite(), d, 0.0)
        return torch.stack([finite.sum(), finite.abs().sum(), finite.square().sum(),
                            d.isnan().sum().double(), d.isposinf().sum().double(), d.isneginf().sum().double()])

    rows = [sums(v) for v in values]
    if len({r.device for r in rows}) == 1:   # one transfer (a GPU's parameters: one host sync)
        return [tuple(r) for r in torch.stack(rows).tolist()]
    return [tuple(r.tolist()) for r in rows]


def ranks_with_other_values(everyone: list[list], mine: list) -> list[int]:
    """The ranks whose digest differs from `mine`. The same values summed in another order differ
    by rounding only, so sums agree within 1e-9 of their magnitudes (or are equal: sums that
    overflowed to inf alike); the counts of non-finite elements agree exactly."""
    def same(a, b) -> bool:
        (sum_a, abs_a, sq_a, *nonfinite_a), (sum_b, abs_b, sq_b, *nonfinite_b) = a, b
        return (nonfinite_a == nonfinite_b
                and (sum_a == sum_b or abs(sum_a - sum_b) <= 1e-9 * max(abs_a, abs_b) + 1e-30)
                and math.isclose(abs_a, abs_b, rel_tol=1e-9) and math.isclose(sq_a, sq_b, rel_tol=1e-9))

    return [rank for rank, theirs in enumerate(everyone)
            if len(theirs) != len(mine) or not all(same(a, b) for a, b in zip(theirs, mine))]
