"""Sharded construction: a model built on the meta device gets its values one module at a time.

Stage 3 exists so that a model larger than one device can train, but a model must exist before
`initialize` can shard it. Built under `torch.device("meta")` its parameters have shapes and no
storage; `initialize` then walks the modules in `model.modules()` order (the order they were
constructed in) and, for each module, gives its own parameters and buffers full values on the
device from, in this order of preference:

    state_dict[name]          a checkpoint or a Hugging Face state dict (any mapping, e.g. a lazy
                              safetensors reader), read one tensor at a time
    init_fn(module)           the user's initialiser (e.g. a Hugging Face model's `_init_weights`)
    module.reset_parameters() torch's own initialisers (what nn.Linear's constructor calls)

Each trainable parameter is then handed to the stage, which keeps what it owns (stage 3: this
rank's pieces of the parameter's unit) and releases the rest, so the peak at init is the shards
plus one module's parameters, not the model. Every rank starts the walk from rank 0's RNG state,
so with torch's initialisers the values equal those of the same model built eagerly after the same
`torch.manual_seed` (when its constructor initialises its modules in construction order, as torch's
modules do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn


def has_meta_tensors(model: nn.Module) -> bool:
    """True when any parameter or buffer of `model` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


class Materializer:
    """Gives a meta model's tensors values on `device`, module by module (see the module docstring).

    Built, it has already swapped every meta parameter and buffer for a tensor of the same shape on
    `device` with no storage yet (the same object wherever a tensor is shared, e.g. tied weights),
    so the engine and the stage can lay parameters out; `run` then gives them values."""

    def __init__(self, model: nn.Module, device: torch.device, init_fn: Callable[[nn.Module], None] | None = None,
                 state_dict: Mapping[str, torch.Tensor] | None = None):
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ValueError("sharded construction needs a real device to materialise on, got 'meta'")
        self.init_fn, self.state_dict = init_fn, state_dict
        names = {id(t): name for name, t in (*model.named_parameters(remove_duplicate=False),
                                              *model.named_buffers(remove_duplicate=False))}
        swapped: dict[int, torch.Tensor] = {}
        self.modules: list[tuple[str, nn.Module, list[tuple[str, torch.Tensor]]]] = []
        self.names: dict[int, str] = {}
        for module_name, module in model.named_modules():
            own = []
            for kind, tensors in (("param", module._parameters), ("buffer", module._buffers)):
                for key, old in tensors.items():
                    if old is None or not (old.is_meta or id(old) in swapped):
                        continue
                    if id(old) not in swapped:
                        swapped[id(old)] = self._unallocated(old, kind)
                        self.names[id(swapped[id(old)])] = names[id(old)]
                        own.append((kind, swapped[id(old)]))
                    tensors[key] = swapped[id(old)]
            if own:
                self.modules.append((module_name or "<model>", module, own))

    def _unallocated(self, old: torch.Tensor, kind: str) -> torch.Tensor:
        """A tensor like `old` on the device whose storage is released at once (allocated again by
        `run`): one tensor exists at a time."""
        new = torch.empty_strided(old.shape, old.stride(), dtype=old.dtype, device=self.device)
        new.untyped_storage().resize_(0)
        if kind == "buffer":
            return new
        param = nn.Parameter(new, requires_grad=old.requires_grad)
        param.__dict__.update(old.__dict__)   # attributes such as the model-parallel mark
        return param

    def start_from_rank0_rng(self, comm) -> None:
        """Every rank draws initial values: start them all from rank 0's RNG (`comm`: the engine's)."""
        if comm.world_size == 1:
            return
        states = {"cpu": torch.get_rng_state()}
        if comm.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(comm.device)
        states = comm.all_gather_object(states)[0]
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"], comm.device)

    def run(self, take: Callable[[nn.Parameter], None] | None = None) -> None:
        """Give every swapped tensor its values, module by module; after each module, call
        `take(param)` for its trainable parameters (the stage keeps what it owns and may release the
        rest by resizing the parameter's storage to zero)."""
        for module_name, module, own in self.modules:
            with torch.no_grad():
                for _, tensor in own:
                    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
                self._fill(module_name, module, own)
            if take is not None:
                for kind, tensor in own:
                    if kind == "param" and tensor.requires_grad:
                        take(tensor)

    def _fill(self, module_name: str, module: nn.Module, own: list) -> None:
        if self.state_dict is not None:
            for _, tensor in own:
                name = self.names[id(tensor)]
                if name not in self.state_dict:
                    raise KeyError(f"sharded construction: the state dict has no entry {name!r}")
                value = self.state_dict[name]
                if tuple(value.shape) != tuple(tensor.shape):
                    raise ValueError(f"sharded construction: state dict entry {name!r} has shape "
                                     f"{tuple(value.shape)}, the model's is {tuple(tensor.shape)}")
                tensor.copy_(value)
        elif self.init_fn is not None:
            self.init_fn(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        else:
            missing = ", ".join(self.names[id(t)] for _, t in own)
            raise ValueError(f"sharded construction: module {module_name} ({type(module).__name__}) has meta "
                             f"tensors ({missing}) but no reset_parameters(); pass init_fn= or state_dict= "
                             "to zero_ref.initialize")
