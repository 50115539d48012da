"""Stage 3's units: how a model is cut into them, and what one unit's lifetime is made of.

A unit is the parameters of one module subtree, gathered and freed together (stage3.py). Its
lifetime is one explicit state (`UnitState`) and a count of named reasons it is held (`Hold`): it
is gathered when a reason appears and freed when none is left, in one place (Stage3._free_if_unheld).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


def build_units(model: nn.Module, trainable: list[nn.Parameter], unit_numel: int
                ) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Cut the model into units, walking modules children-first: a module whose subtree holds at
    least `unit_numel` not-yet-assigned trainable elements becomes the root of a unit holding them;
    the model itself takes whatever is left. A parameter shared by several modules (a tied weight)
    is only taken by a module whose subtree contains all of its users, so one gather serves them
    all. A container that is never called (nn.ModuleList: no forward of its own) roots no unit."""
    wanted = {id(p) for p in trainable}
    users: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), set()).add(id(module))
    assigned: set[int] = set()
    units = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        subtree = {id(m) for m in module.modules()}
        params = [p for p in module.parameters()
                  if id(p) in wanted and id(p) not in assigned and users[id(p)] <= subtree]
        callable_root = type(module).forward is not nn.Module.forward
        if params and (module is model or (callable_root and sum(p.numel() for p in params) >= unit_numel)):
            units.append((module, params))
            assigned.update(id(p) for p in params)

    visit(model)
    return units


FOREIGN_BACKWARD = (
    "stage 3: a backward outside this engine's engine.backward(loss) reached one of its modules, whose "
    "parameters that backward needs gathered: loss.backward() instead of engine.backward(loss), a loss "
    "another engine (or plain autograd) differentiates through this model (a GAN's discriminator), or "
    "torch.autograd.grad through it (a gradient penalty). At stage 3 a model takes part in backward only "
    "through its own engine.backward: put both models in one engine, or give this one stage 0-2 (which "
    "also take torch.autograd.grad, create_graph included). The gradients accumulated since the last step "
    "are not usable: engine.zero_grad() discards them")


def internal(method):
    """Mark a Stage3 hook body as the stage's own code (`stage.internal` > 0 while it runs), which a
    guard's watcher lets pass."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self.internal += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self.internal -= 1
    return wrapper


class UnitState(enum.Enum):
    FREED = "freed"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Hold(enum.Enum):
    """Why a unit is gathered."""
    RUNNING = "running"      # a root using it is inside its forward (counted: roots nest)
    SCHEDULED = "scheduled"  # issued ahead by the forward's schedule (a prefetch, or for a peer); until used
    FORWARD = "forward"      # kept to the end of this forward: used twice in one, or an untracked view of it
    BACKWARD = "backward"    # needed by this backward, until its gradients are all in
    PINNED = "pinned"        # an untracked view of it is in the graph: through the whole backward


@dataclasses.dataclass(eq=False)
class Unit:
    """One unit's lifetime: its state, why it is held, its gather in flight."""
    name: str
    full: torch.Tensor        # the full flat buffer; its storage is freed while FREED
    state: UnitState = UnitState.FREED
    holds: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    gather: object = None     # the all-gather in flight while GATHERING
    version: int = 0          # torch's count of in-place writes into its parameters, when gathered


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors in a unit root's output, through lists, tuples and dicts (torch's pytree, which
    also knows Hugging Face's ModelOutput) and dataclasses: each gets the hook that gathers the unit
    before its backward. A tensor hidden anywhere else misses it (guard/unit_reads.py then gathers
    the unit from the backward nodes that read it)."""
    found, pending = [], [output]
    while pending:
        for leaf in tree_flatten(pending.pop())[0]:
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                pending.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf))
    return found


def module_name(model: nn.Module, module: nn.Module) -> str:
    """`module`'s name in `model` ("<model>" for the model itself)."""
    return next((name or "<model>" for name, m in model.named_modules() if m is module), "?")
