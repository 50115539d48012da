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

import re
from pathlib import Path

import torch

from ..tensor_parallel import Split, split_of
from .manifest import CheckpointError

_SUB_CHECKPOINT = re.compile(r"^mp(\d+)-of-(\d+)$")


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


# --- offline ---------------------------------------------------------------------------------------
def sub_checkpoints(root: Path) -> list[Path]:
    """The sub-checkpoint roots `root/mp<r>-of-<Nm>` in MP rank order, all Nm of them; [] when
    `root` holds none (not a checkpoint saved under model parallelism)."""
    found = {}
    for child in sorted(root.iterdir()) if root.is_dir() else ():
        match = _SUB_CHECKPOINT.match(child.name)
        if match and child.is_dir():
            found[int(match[1]), int(match[2])] = child
    sizes = sorted({size for _, size in found})
    if len(sizes) > 1:
        raise CheckpointError(f"{root} holds sub-checkpoints of several model-parallel sizes {sizes} "
                              f"({', '.join(p.name for p in found.values())}): keep one size's folders")
    if not sizes:
        return []
    missing = [f"mp{r}-of-{sizes[0]}" for r in range(sizes[0]) if (r, sizes[0]) not in found]
    if missing:
        raise CheckpointError(f"{root} lacks the model-parallel sub-checkpoint(s) {', '.join(missing)}: every MP "
                              "rank's slice is needed to rebuild the unsplit model")
    return [found[r, sizes[0]] for r in range(sizes[0])]


def join_sub_checkpoints(folders: list[Path], glued: list[tuple[dict, dict[str, torch.Tensor]]]
                         ) -> dict[str, torch.Tensor]:
    """The unsplit state dict from MP rank r's (manifest, glued state dict) in `glued[r]`, read
    from `folders[r]`: each split parameter's slices joined by the split its manifest records, every
    other tensor taken from MP rank 0. CheckpointError when the sub-checkpoints do not belong together."""
    size = len(glued)
    for rank, (folder, (manifest, _)) in enumerate(zip(folders, glued)):
        record = manifest.get("model_parallel")
        if record is None:
            raise CheckpointError(f"{folder}: its manifest has no 'model_parallel' field (saved before checkpoints "
                                  "recorded how parameters split), so it cannot be joined offline: load it into an "
                                  f"engine with {size} model-parallel ranks and call full_state_dict()")
        if (record["rank"], record["size"]) != (rank, size):
            raise CheckpointError(f"{folder}: its manifest's 'model_parallel' says rank {record['rank']} of "
                                  f"{record['size']}, but it is sub-checkpoint {rank} of {size}")
    steps = [manifest["global_step"] for manifest, _ in glued]
    if len(set(steps)) > 1:
        raise CheckpointError(f"the model-parallel sub-checkpoints under {folders[0].parent} are at different "
                              f"global steps {steps} (one MP rank saved again, or a save did not finish on all)")
    first_manifest, first = glued[0]
    splits = first_manifest["model_parallel"]["splits"]
    for folder, (manifest, state) in zip(folders[1:], glued[1:]):
        if list(state) != list(first) or manifest["model_parallel"]["splits"] != splits:
            raise CheckpointError(f"{folder} holds other tensors or splits than {folders[0]}: not slices of one model")
    return {key: Split(*splits[key]).join([state[key] for _, state in glued]) if key in splits else value
            for key, value in first.items()}


def refuse_lone_slice(folder: Path, manifest: dict) -> None:
    """CheckpointError when `folder` is one MP rank's sub-checkpoint: glued alone it is a slice,
    not the model."""
    record = manifest.get("model_parallel")
    if record is not None and record["size"] > 1:
        raise CheckpointError(f"{folder} is model-parallel rank {record['rank']}'s slice of a model split over "
                              f"{record['size']} ranks: consolidate the folder that holds mp0-of-{record['size']} "
                              f"... mp{record['size'] - 1}-of-{record['size']} (the one save_checkpoint was given)")
