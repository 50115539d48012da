"""Whole-model values into and out of a sharded engine (engine.load_state_dict, full_state_dict).

What is sharded: each rank holds the fp32 master (and moments) of its own *pieces* only, a piece
being the part of one parameter inside this rank's segment (stage_base.owned_pieces). So

* loading needs no communication: every rank is given the full tensors and copies the element
  ranges of its own pieces into its master segments; the parameters are then rewritten from the
  masters (rounded to the model dtype and regathered: stage.sync_params_from_master);
* reading the whole model is a collective: the masters are all-gathered one group at a time
  (stage.full_master), so a rank holds at most one full group beyond its shards, and the group's
  flat buffer is cut back into parameters.

Under model parallelism both go through the parameters' splits (model_parallel.py): a full
tensor given to load is cut to this MP rank's slice first; reading gathers over the data-parallel
group as above, then each split parameter's slices over the MP group, and joins them.

`write_model_state` is the one loop that writes values into an engine in place; sharded
checkpoints (checkpoint._apply) restore through it too.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from .manifest import persistent_buffers
from .model_parallel import full_shape, join_over_model_parallel, this_ranks_value
from ..guard.refusals import refuse_together
from ..guard.same_everywhere import ranks_with_other_values, value_digest


def names_by_param(module: torch.nn.Module) -> dict[int, list[str]]:
    """{id(parameter): every name it has in the model} (a tied parameter has several)."""
    names = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    return names


def write_model_state(stage, segments: dict[str, list[torch.Tensor]],
                      piece_values: Callable[[torch.nn.Parameter, int, int], dict[str, torch.Tensor]],
                      whole_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write values into the engine in place, then rewrite the parameters from the masters.
    `piece_values(param, start, end)` gives, for each of this rank's pieces, {kind: the flat values
    of elements [start, end) of that parameter}, copied into `segments[kind]` (the optimizer's lists
    of per-group segments: masters, moments); `whole_values` pairs tensors kept whole on every rank
    (frozen parameters, buffers) with their new values."""
    with torch.no_grad():
        for param, start, end, g, offset in stage.owned_pieces():
            for kind, values in piece_values(param, start, end).items():
                segments[kind][g][offset:offset + end - start].copy_(values)   # copy_ converts dtype and device
        for tensor, value in whole_values:
            tensor.data.copy_(value)
        stage.sync_params_from_master()


def load_state_dict(engine, state_dict: dict[str, torch.Tensor]) -> None:
    """engine.load_state_dict: check everything first (every parameter present, a tied one under
    any of its names and equal under each, shapes as the model's, no unknown key), then copy this
    rank's pieces into the fp32 masters; the optimizer's moments and step counts are kept. Under
    model parallelism a split parameter is given either unsplit (full_state_dict's shape; this MP
    rank cuts its slice) or as this MP rank's slice."""
    names = names_by_param(engine.module)
    buffers = dict(persistent_buffers(engine.module))
    known = {n for ns in names.values() for n in ns} | set(buffers)
    problems = [f"unknown key {k!r}" for k in state_dict if k not in known]
    source = {}
    for param in [p for g in engine.stage.groups for p in g.params] + engine.frozen:
        present = [n for n in names[id(param)] if n in state_dict]
        key = present[0] if present else None
        value = None if key is None else this_ranks_value(param, state_dict[key], engine.mp_comm)
        if key is None:
            problems.append(f"missing {names[id(param)][0]!r}")
        elif any(not torch.equal(state_dict[n], state_dict[key]) for n in present[1:]):
            problems.append(f"{' and '.join(map(repr, present))} are one tied parameter but differ")
        elif tuple(value.shape) != tuple(param.shape):
            unsplit = full_shape(param, engine.mp_comm)
            problems.append(f"{key!r} has shape {tuple(state_dict[key].shape)}, the model's is {tuple(param.shape)}"
                            + (f" (this model-parallel rank's slice; unsplit {unsplit})" if unsplit else ""))
        else:
            source[id(param)] = value.detach()
    given_buffers = [(buffer, state_dict[name]) for name, buffer in buffers.items() if name in state_dict]
    _check_same_on_every_rank(engine.comm, problems, [*source.values(), *(value for _, value in given_buffers)])
    whole = [(param, source[id(param)]) for param in engine.frozen] + given_buffers
    write_model_state(engine.stage, {"master": engine.stage.optimizer.masters},
                      lambda param, start, end: {"master": source[id(param)].reshape(-1)[start:end]}, whole)


def _check_same_on_every_rank(comm, problems: list[str], values: list[torch.Tensor]) -> None:
    """Every rank is given the whole state dict and copies its own pieces, then the parameters are
    regathered: a state dict refused on some ranks only must be refused on every rank (the others
    would wait in the regather), and different values on different ranks would load a mix of them.
    One exchange on the control channel: each rank's problems and each tensor's digest
    (same_everywhere.value_digest)."""
    refusal = ValueError("load_state_dict: " + "; ".join(problems) + ". Nothing was changed") if problems else None
    digest = value_digest(values) if values and not problems and comm.world_size > 1 else []
    everyone = refuse_together(comm, refusal, digest, what="load_state_dict")
    differ = ranks_with_other_values(everyone, digest)
    if differ:
        raise ValueError(f"load_state_dict was given other values on rank(s) {', '.join(map(str, differ))} than on "
                         f"rank {comm.rank}: every rank must pass the same state dict (each loads only its own "
                         "pieces of it). Nothing was changed on any rank")


def full_state_dict(engine, rank0_only: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """engine.full_state_dict: every parameter (a tied one under each of its names) from the
    gathered fp32 masters, frozen parameters and persistent buffers as fp32 (integer buffers as
    they are), in the model's state_dict order.

    Two gathers. Over the data-parallel group, the masters one group at a time: every rank then
    holds the whole of its own model-parallel slice. Under model parallelism, then over the MP
    group, each split parameter's slices, joined into the unsplit tensor (join_over_model_parallel);
    the keys are the unsplit model's. With `rank0_only` only the ranks at data-parallel rank 0 keep
    the first gather and make the second (one MP group: global rank 0's, in a mesh from
    init_device_mesh), and of these only MP rank 0 returns the dict; the others return {}."""
    holds = not rank0_only or engine.comm.rank == 0
    names = names_by_param(engine.module)
    values: dict[int, torch.Tensor] = {}   # id(parameter) -> fp32 value on `device`
    for g, group in enumerate(engine.stage.groups):
        full = engine.stage.full_master(g)      # collective: every rank gathers, one group at a time
        if holds:
            for param, start, end in group.param_ranges():
                values[id(param)] = full[start:end].view(param.shape).to(device, copy=True)
    if not holds:
        return {}
    for param in engine.frozen:
        values[id(param)] = param.detach().float().to(device, copy=True)
    if engine.mp_comm is not None:
        join_over_model_parallel(engine.module, engine.mp_comm, values, device)
        if rank0_only and engine.mp_comm.rank != 0:
            return {}
    by_name = {name: values[key] for key, ns in names.items() for name in ns}
    out = {}
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        if key in by_name:
            out[key] = by_name[key]
        else:   # a persistent buffer
            tensor = tensor.detach()
            out[key] = (tensor.float() if tensor.is_floating_point() else tensor).to(device, copy=True)
    return out
