"""Whole tensors from model-parallel slices, and slices from whole tensors.

Under model parallelism (MP) each rank holds a slice of every split parameter: the layer's
`tensor_parallel.Split` says along which dimension and in how many blocks (q/k/v). This file is the
io side of that one description, used three ways:

* export (engine.full_state_dict): after the data-parallel gather every rank holds the fp32 master
  of its own MP slice of the model; `join_over_model_parallel` then all-gathers each split
  parameter's slice over the MP group (engine.mp_comm), one parameter at a time, and joins the
  slices with the parameter's Split. Replicated parameters (layer norms, row-parallel biases,
  position embeddings) are equal on every MP rank and taken as they are;
* import (engine.load_state_dict): a split parameter given at its full shape is cut to this MP
  rank's slice (`this_ranks_value`);
* offline (`zero-ref consolidate`): a checkpoint saved under MP is one sub-checkpoint per MP rank
  (`path/mp<rank>-of-<Nm>`, ZeroEngine._mp_path), each glued on its own; their manifests record the
  splits ("model_parallel"), so `join_sub_checkpoints` joins them with no process group.
"""

from __future__ import annotations

import torch

from ..tensor_parallel import split_of


def join_over_model_parallel(module: torch.nn.Module, mp_comm, values: dict[int, torch.Tensor],
                             device: torch.device) -> None:
    """Replace, in `values` ({id(parameter): this MP rank's fp32 value}), each split parameter's
    slice with the unsplit tensor on `device`. Collective over the MP group: one all_gather per
    split parameter, in the model's parameter order (the same on every MP rank, whatever order the
    stages' flat groups learned), so a rank holds at most one parameter's slices beyond `values`."""
    for param in module.parameters():   # a tied parameter once
        split = split_of(param)
        if split is None:
            continue
        mine = values[id(param)].to(mp_comm.device).reshape(-1)
        every = torch.empty(mp_comm.world_size * mine.numel(), dtype=mine.dtype, device=mp_comm.device)
        mp_comm.all_gather(every, mine, in_step=False)
        values[id(param)] = split.join(list(every.view(mp_comm.world_size, *param.shape))).to(device)


def this_ranks_value(param: torch.nn.Parameter, value: torch.Tensor, mp_comm) -> torch.Tensor:
    """What this MP rank loads into `param` from `value`: its slice when `value` has the split
    parameter's full shape, else `value` as given (a slice, a replicated parameter, or a shape that
    fits neither, which the caller refuses naming both shapes: `full_shape`)."""
    split = split_of(param) if mp_comm is not None else None
    if split is None or tuple(value.shape) != split.full_shape(param.shape, mp_comm.world_size):
        return value
    return split.cut(value, mp_comm.world_size, mp_comm.rank)


def full_shape(param: torch.nn.Parameter, mp_comm) -> tuple[int, ...] | None:
    """The unsplit shape of a split parameter under model parallelism, else None."""
    split = split_of(param) if mp_comm is not None else None
    return None if split is None else split.full_shape(param.shape, mp_comm.world_size)
