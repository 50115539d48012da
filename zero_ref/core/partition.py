"""Flat buffers, padded shard ranges and constant-size buckets (the paper's CB).

A `FlatGroup` is parameters laid back to back in one flat buffer padded (with zeros, which change
no sum or norm) to a multiple of Nd, so it splits into Nd equal shards: rank r owns elements
[r * shard_numel, (r + 1) * shard_numel). Stages 0-2 pack parameters into groups of at most
`bucket_numel` (a larger parameter is a group of its own); stage 3 makes one group per unit. A
rank's shard of the model is its shards of every group, concatenated (`GroupLayout`);
`move_state` carries such state from one layout to another (stages 0-2 repack once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn


@dataclass
class FlatGroup:
    """Parameters `params` at `offsets` in a flat buffer of `padded_numel` elements."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    padded_numel: int
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank `rank`'s shard inside this group's flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def param_ranges(self) -> Iterable[tuple[nn.Parameter, int, int]]:
        """(param, start, end) of each parameter inside the flat buffer."""
        for param, offset in zip(self.params, self.offsets):
            yield param, offset, offset + param.numel()


def make_group(params: Sequence[nn.Parameter], world_size: int) -> FlatGroup:
    """Lay `params` back to back and pad the total to a multiple of `world_size`."""
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += param.numel()
    padded = -(-total // world_size) * world_size
    return FlatGroup(list(params), offsets, total, padded, world_size)


def pack_into_buckets(params: Sequence[nn.Parameter], bucket_numel: int, world_size: int) -> list[FlatGroup]:
    """Greedily pack `params`, in the given order, into groups of at most `bucket_numel` elements."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in params:
        if current and size + param.numel() > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        buckets.append(current)
    return [make_group(bucket, world_size) for bucket in buckets]


class GroupLayout:
    """Where each group lives in the concatenation of all groups (full) and of one rank's shards."""

    def __init__(self, groups: Sequence[FlatGroup]):
        self.groups = list(groups)
        self.full_offsets, self.shard_offsets = [], []
        full = shard = 0
        for group in self.groups:
            self.full_offsets.append(full)
            self.shard_offsets.append(shard)
            full += group.padded_numel
            shard += group.shard_numel
        self.full_numel, self.shard_numel = full, shard

    def full_slice(self, flat: torch.Tensor, g: int) -> torch.Tensor:
        """Group g's part of a full-length concatenated buffer."""
        start = self.full_offsets[g]
        return flat[start:start + self.groups[g].padded_numel]

    def shard_slice(self, flat_shard: torch.Tensor, g: int) -> torch.Tensor:
        """Group g's part of a rank's concatenated shard buffer."""
        start = self.shard_offsets[g]
        return flat_shard[start:start + self.groups[g].shard_numel]

    def own_slice(self, flat: torch.Tensor, g: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of group g, as a view of a full-length concatenated buffer."""
        lo, hi = self.groups[g].shard_range(rank)
        return self.full_slice(flat, g)[lo:hi]


def copy_params_into(group: FlatGroup, flat: torch.Tensor, flatten_) -> None:
    """Copy (and cast) the group's parameters into `flat` with one `flatten_` call; zero the padding."""
    with torch.no_grad():
        flatten_([p.detach().contiguous() for p in group.params], flat, group.offsets)
        flat[group.numel:].zero_()


def bind_params_to(group: FlatGroup, flat: torch.Tensor) -> None:
    """Make each parameter a view of its range in `flat` (same Parameter objects: ties survive)."""
    for param, start, end in group.param_ranges():
        param.data = flat[start:end].view(param.shape)


def flatten_params(layout: GroupLayout, dtype: torch.dtype, device: torch.device, flatten_) -> torch.Tensor:
    """One flat buffer in `dtype` holding every group's parameters, each now a view of its range."""
    flat = torch.empty(layout.full_numel, dtype=dtype, device=device)
    for g, group in enumerate(layout.groups):
        copy_params_into(group, layout.full_slice(flat, g), flatten_)
        bind_params_to(group, layout.full_slice(flat, g))
    return flat


def move_state(comm, old: GroupLayout, new: GroupLayout, old_flat: torch.Tensor, new_flat: torch.Tensor,
               sharded: bool) -> None:
    """Copy a rank's flat state from layout `old` into `new` (same parameters, other groups): local
    when the flats hold whole groups; `sharded`: each old group is all-gathered in turn (outside
    the step's traffic) and this rank keeps the pieces that fall into its new shards."""
    where = {id(p): (g, offset) for g, group in enumerate(new.groups) for p, offset in zip(group.params, group.offsets)}
    for g, group in enumerate(old.groups):
        if sharded:
            full = torch.empty(group.padded_numel, dtype=old_flat.dtype, device=old_flat.device)
            comm.all_gather(full, old.shard_slice(old_flat, g), in_step=False)
        else:
            full = old.full_slice(old_flat, g)
        for param, start, end in group.param_ranges():
            ng, offset = where[id(param)]
            if sharded:
                lo, hi = new.groups[ng].shard_range(comm.rank)
                segment = new.shard_slice(new_flat, ng)
            else:
                lo, hi = 0, new.groups[ng].padded_numel
                segment = new.full_slice(new_flat, ng)
            a, b = max(offset, lo), min(offset + end - start, hi)
            if a < b:
                segment[a - lo:b - lo].copy_(full[start + a - offset:start + b - offset])
