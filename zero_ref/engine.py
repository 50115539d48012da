"""`zero_ref.initialize` and `ZeroEngine`: the core's engine, guarded, with whole-model state and checkpoints.

core/engine.py runs the step. This module builds it: it chooses the seams (`ZeroConfig.checks`:
"strict" plugs in guard/strict.py, "off" the bare core's), prepares sharded construction
(materialize.py), and adds what training itself never calls: whole-model state dicts (io/state_dict.py)
and sharded checkpoints (io/checkpoint.py). The step contract is docs/contract.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import materialize
from .config import ZeroConfig
from .core.activations import model_checkpoints
from .core.engine import Engine
from .core.seams import Seams
from .guard import ownership, param_writes
from .guard.strict import Strict
from .io import checkpoint
from .io import state_dict as state_dict_io


MEMORY_CATEGORIES = ("params", "grads", "optimizer_states", "buffers", "comm_buffers")


def initialize(model: nn.Module, config: ZeroConfig, process_group: dist.ProcessGroup | None = None,
               mesh=None, *, init_fn=None, state_dict=None, device=None, param_groups=None) -> "ZeroEngine":
    """Take ownership of `model` and return the engine that trains it under `config`.

    The model is converted (parameters to `config.dtype`) and partitioned in place: its Parameter
    objects are kept, but their storage becomes views of the stage's flat buffers (stage 3: freed
    until used), so no second full copy stays alive. Rank 0's values are broadcast first, so every
    rank starts from the same model. `process_group` defaults to the default group; world size 1
    works. Every rank of the group must call it, with the same model structure, config and
    param_groups: they are compared first, and any difference raises ValueError on every rank
    (guard/same_everywhere.py; with `config.checks="off"` nothing is compared: core/seams.py).

    With model parallelism pass `mesh`, a 2-D DeviceMesh with dimensions named "dp" and "mp"
    (`init_device_mesh("cpu", (Nd, Nm), mesh_dim_names=("dp", "mp"))`): ZeRO shards over "dp" only;
    the model's layers split over "mp" (tensor_parallel.py) and the gradient norm spans both.

    Sharded construction: a model built under `torch.device("meta")` is given its values here, one
    module at a time, on `device` (default: this rank's CUDA device under NCCL, else the CPU), from
    `state_dict` (any mapping of names to tensors), `init_fn(module)` or each module's
    `reset_parameters()`; at stage 3 each rank keeps only its shards, so the full model never
    exists on any rank (materialize.py).

    `param_groups` takes torch's form, `[{"params": [...], "weight_decay": 0.0}, ...]`: every trainable
    parameter in exactly one group, each group setting any of lr, betas, eps, weight_decay (the
    config's values otherwise). `engine.optimizer` exposes them as a torch Optimizer, so torch's
    lr_scheduler classes drive the learning rate (param_groups.py).
    """
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zero_ref.ZeroConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group('gloo' or 'nccl') before zero_ref.initialize "
                           "(under torchrun the environment provides rank and world size; world size 1 works)")
    mp_group = None
    if mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group (data parallelism only) or mesh (data x model "
                             "parallelism), not both")
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if getattr(mesh, "ndim", None) != 2 or sorted(names) != ["dp", "mp"]:
            raise ValueError(f"mesh must be a 2-D DeviceMesh with dimensions named 'dp' and 'mp', got "
                             f"dimensions {names or None} of shape {tuple(getattr(mesh, 'shape', ()))}")
        process_group, mp_group = mesh.get_group("dp"), mesh.get_group("mp")
    seams = Strict() if config.checks == "strict" else Seams()
    try:   # refused here on some ranks only, it is refused on every rank at the engine's first exchange
        materializer, refusal = _take(model, config, process_group, init_fn, state_dict, device), None
    except ValueError as err:
        materializer, refusal = None, err
    return ZeroEngine(model, config, process_group, mp_group, materializer, param_groups, refusal, seams)


def _take(model: nn.Module, config: ZeroConfig, process_group, init_fn, state_dict, device
          ) -> materialize.Materializer | None:
    """Check that this rank can take `model` (checks="strict": no other open engine holds it; stage 3: not compiled) and
    prepare sharded construction for a model on the meta device; ValueError says why not."""
    if config.checks == "strict":
        ownership.check_not_taken(model)
        if config.stage == 3:
            ownership.refuse_compiled(model)
    backend = str(dist.get_backend_config(process_group) if hasattr(dist, "get_backend_config")
                  else dist.get_backend(process_group))
    # a fake process group (analysis/at_scale.py) runs the engine on meta tensors on purpose: nothing to materialise
    if materialize.has_meta_tensors(model) and "fake" not in backend:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        return materialize.Materializer(model, device, init_fn, state_dict)
    if init_fn is not None or state_dict is not None:
        raise ValueError("init_fn and state_dict are for models built on the meta device (sharded construction); "
                         "this model already has values (load a state dict into it before initialize, or use "
                         "engine.load_checkpoint)")
    return None


class ZeroEngine(Engine):
    """The engine `initialize` returns: core/engine.Engine (forward, backward, step, zero_grad,
    comm_stats, close) with whole-model state dicts, sharded checkpoints and the memory report.
    Usable as a context manager that `close()`s it."""

    def _open_collective_call(self, call: str, discarding: bool = False) -> None:
        """The start of a collective call that training does not make (guard/refusals.CALLS); with
        checks="strict" the vote first if this rank stopped at a boundary without stepping, then the
        call's name on the calls channel (guard/strict.py)."""
        self.check_open()
        self.seams.before_call(self, call, discarding)

    # --- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, path, keep: int = 2, lr_scheduler=None):
        """Write a sharded checkpoint under the folder `path` (every rank calls it; see io/checkpoint.py),
        with the parameter groups' hyper-parameters and, if given, `lr_scheduler`'s state. Returns the
        new checkpoint's folder; `path/latest` names it once it is complete."""
        self._open_collective_call("save_checkpoint")
        self._adopt_param_writes()
        return checkpoint.save_checkpoint(self, self._mp_path(path), keep, lr_scheduler)

    def load_checkpoint(self, path, lr_scheduler=None) -> None:
        """Load a checkpoint written at any world size and stage (every rank calls it), and the state
        of `lr_scheduler` if given. Every rank verifies what it reads, then all vote: a failure
        anywhere changes nothing anywhere. The step in progress, if any, is dropped."""
        self._open_collective_call("load_checkpoint", discarding=True)
        checkpoint.load_checkpoint(self, self._mp_path(path), lr_scheduler)
        self.seams.after_update(self)   # the engine wrote the parameters
        if isinstance(self.seams, Strict):
            self.seams.forget_dropped_step()

    def _mp_path(self, path):
        """With model parallelism each MP rank's slice of the model is its own sharded checkpoint,
        in `path/mp<rank>-of-<Nm>` (so it loads at the same Nm, any data-parallel size)."""
        if self.mp_comm is None:
            return path
        return Path(path) / f"mp{self.mp_comm.rank}-of-{self.mp_comm.world_size}"

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Give the model new values after initialize ({name: tensor of full shape}, the same on every
        rank: a torch state_dict or what full_state_dict returned; under model parallelism the
        unsplit model's, or this MP rank's slices). Each rank copies its own pieces
        into the fp32 master weights, then the parameters are rewritten from them; the optimizer's
        moments and step counts are kept. The way to write values in bf16/fp16, where training reads
        the master, not the parameter (a write into `param.data` would be lost at the next step), and
        at stage 3, where a parameter has no values outside the forward. Checked before anything changes:
        every parameter present (a tied one under any of its names, equal under each), shapes as the
        model's, no unknown key, and the same values on every rank; a state dict refused on one rank
        is refused on every rank (io/state_dict.py)."""
        self._open_collective_call("load_state_dict")
        state_dict_io.load_state_dict(self, state_dict)
        self.seams.after_update(self)   # the engine wrote the parameters

    def full_state_dict(self, rank0_only: bool = False, device: str | torch.device = "cpu"
                        ) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor of full shape on `device`} for every parameter (a tied weight under each
        of its names) plus persistent buffers, from the fp32 master weights. Collective: every rank
        calls it. Groups are gathered one at a time over the data-parallel group, so the engine's
        device holds at most one full group beyond its shards; under model parallelism each split
        parameter's slices are then all-gathered over the MP group and joined by its layer's split,
        so the dict is the unsplit model's (io/model_parallel.py). With `rank0_only` only rank 0
        returns the dict (under MP: DP and MP rank 0, global rank 0 in a mesh from init_device_mesh;
        only its MP group holds a copy) and the others return {}."""
        self._open_collective_call("full_state_dict")
        self._adopt_param_writes()
        return state_dict_io.full_state_dict(self, rank0_only, torch.device(device))

    def memory_report(self) -> dict[str, int]:
        """Bytes of live tensor storage on this rank by category (each storage counted once):
        params, grads, optimizer_states (the paper's model states), buffers (the model's),
        comm_buffers (constant-size gradient buckets kept for reuse: the paper's CB),
        activation_checkpoints (saved block inputs now alive, activations.py) and their total;
        activation_checkpoints_host: checkpoints offloaded to host memory (Pa+cpu), not in total;
        activation_checkpoints_arena: the part of those two held in MD's contiguous arenas."""
        tensors = self.stage.memory_tensors()
        tensors["params"] = [*tensors["params"], *self.frozen]
        tensors["buffers"] = list(self.module.buffers())
        seen: set[int] = set()
        report = {}
        for category in MEMORY_CATEGORIES:
            total = 0
            for tensor in tensors[category]:
                storage = tensor.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    total += storage.nbytes()
            report[category] = total
        saved = model_checkpoints(self.module)
        report["activation_checkpoints"] = sum(c.device_bytes for c in saved)
        report["total"] = sum(report.values())
        report["activation_checkpoints_host"] = sum(c.host_bytes for c in saved)
        report["activation_checkpoints_arena"] = sum(c.arena.nbytes() for c in saved if c.arena is not None)
        return report

    def _adopt_param_writes(self) -> None:
        """Before the masters are read: values written into the parameters from outside the engine
        are adopted or refused on every rank (checks="strict": guard/param_writes.py)."""
        if isinstance(self.seams, Strict):
            param_writes.adopt_or_refuse(self, self.seams.writes)
