"""Stage 3: parameters read outside the window in which their unit is gathered.

stage3.py gathers a unit around its root's forward and again before its root's backward (a hook on
the root's outputs), and frees it once its gradients are in. Real models read parameters elsewhere:
a parent's `F.linear(h, self.embed.weight)`, a `param.detach()`, an output kept in an attribute, a
tensor hook that runs in backward. This module sees those reads: a TorchFunctionMode over every
torch call of the forward and the backward (`ExternalUseWatcher`), the backward entered so that the
mode stays on inside it (`run_autograd`), and the tensors of a root's output that get the backward
hook (`output_tensors`), and answers each read through the stage's gathers (Stage3.acquire,
gather_for_backward, hold).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core.units import FOREIGN_BACKWARD, Hold
from .sharded_param import METADATA

OUTSIDE_THE_MODEL = (
    "stage 3: parameter {name} (unit {unit}) was read in the engine's forward but outside the model's, where no "
    "unit is gathered: a forward hook on the model itself registered after zero_ref.initialize runs after stage 3 "
    "has freed every unit, and a forward pre-hook on it registered before initialize runs before the first "
    "gather. Register the model's forward hooks before initialize and its pre-hooks after it, or hook a submodule")


class ExternalUseWatcher(TorchFunctionMode):
    """Sees every torch function call of a forward or backward made outside the stage's own code.

    In a forward, an operation on a parameter whose unit no running unit root holds is a use
    outside that root (`F.linear(h, self.embed.weight)`): whether the unit is freed, in flight (a
    prefetch) or still gathered after an earlier use, it is gathered with the innermost running
    root before the operation runs, and from then on with that root, whose backward gathers it too.
    A result that shares a unit's buffer without autograd tracking it (`param.detach()`) keeps the
    unit gathered to the end of the forward and through the next backward. Each backward node such
    an operation makes gathers the units it reads if they are freed when it runs. In backward (hooks, custom
    Functions), an operation on a parameter of a freed unit gathers the unit first. Every operation
    waits for the gathers in flight of the parameters it reads. Calls that read no parameter, or
    only a parameter's metadata (shape, `.grad`, hooks, its storage: sharded_param.METADATA), pass
    untouched.
    """

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stage = self.stage
        if stage.internal or func in METADATA:   # the stage's own code; or no element read (torch's MemTracker
            return func(*args, **kwargs)          # asks each module's parameters for their storages)
        params = self._unit_params(args, kwargs)
        if not params:   # the common case: nothing of a unit is read (an untracked view of one is kept already)
            return func(*args, **kwargs)
        in_forward = bool(stage.frames) and not stage.in_backward
        unit_of = stage.unit_of_param
        if in_forward:   # a unit that no running root holds: its use is outside that root
            self._use_outside([p for p in params if not stage.is_running(unit_of[id(p)])])
        else:            # in backward (a hook, a custom Function), or outside the model's forward
            self._use_outside([p for p in params if stage.is_freed(unit_of[id(p)])])
        for param in params:
            stage.wait_for(unit_of[id(param)])
        result = func(*args, **kwargs)
        if in_forward:
            self._keep_aliased(result)
            if torch.is_grad_enabled():
                self._hook_nodes(result, params)
        return result

    def _hook_nodes(self, result, params: list[nn.Parameter]) -> None:
        """Each backward node this operation made reads the parameters it was given: it gathers their
        units first if they are freed then (its root's output hook may never run, for an output kept
        in an attribute rather than returned)."""
        units = tuple({self.stage.unit_of_param[id(p)] for p in params})
        nodes = {t.grad_fn for t in (result if isinstance(result, (list, tuple)) else (result,))
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for node in nodes:
            node.register_prehook(lambda grads, gs=units: self._before_node(gs))

    def _before_node(self, units: tuple[int, ...]) -> None:
        """Before a backward node that reads these units: gather the freed ones, wait for the rest."""
        stage = self.stage
        stage.internal += 1
        try:
            for g in units:
                if stage.is_freed(g):
                    stage.check_in_backward(FOREIGN_BACKWARD)
                    stage.gather_for_backward(g)
                else:
                    stage.wait_for(g)
        finally:
            stage.internal -= 1

    def _use_outside(self, params: list[nn.Parameter]) -> None:
        """Units used outside their roots: in a forward, gathered now and from now on with the
        innermost running root (the model's, at least); in backward, gathered for it."""
        stage, seen = self.stage, set()
        stage.internal += 1
        try:
            for param in params:
                g = stage.unit_of_param[id(param)]
                if g in seen:
                    continue
                seen.add(g)
                if stage.frames:
                    module, acquired = stage.frames[-1]
                    stage.external.setdefault(id(module), set()).add(g)
                    stage.acquire(g)
                    acquired.append(g)   # released, and hooked for backward, with that root
                elif stage.in_backward:   # a hook or custom Function of backward, outside any recomputation
                    stage.gather_for_backward(g)
                else:
                    name = next(n for n, p in stage.model.named_parameters() if p is param)
                    raise RuntimeError(OUTSIDE_THE_MODEL.format(name=name, unit=stage.units[g].name))
        finally:
            stage.internal -= 1

    def _keep_aliased(self, result) -> None:
        """Each tensor in `result` that shares a unit's full buffer while autograd does not track it
        keeps the unit to the end of this forward and, with grad enabled, through the next backward
        (where its gradients arriving would otherwise free it first)."""
        for tensor in (result if isinstance(result, (list, tuple)) else (result,)):
            if isinstance(tensor, torch.Tensor) and not tensor.requires_grad and tensor.layout is torch.strided:
                try:
                    g = self.stage.unit_of_storage.get(tensor.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):   # a tensor subclass without storage
                    continue
                if g is not None:
                    self.stage.hold(g, Hold.FORWARD)
                    if torch.is_grad_enabled():
                        self.stage.pinned.add(g)

    def _unit_params(self, args, kwargs) -> list[nn.Parameter]:
        """The stage-3 parameters among the arguments (and inside list or tuple arguments)."""
        unit_of = self.stage.unit_of_param
        return [item for arg in (*args, *kwargs.values()) for item in (arg if isinstance(arg, (list, tuple)) else (arg,))
                if isinstance(item, nn.Parameter) and id(item) in unit_of]


def run_autograd(loss: torch.Tensor, retain_graph: bool) -> None:
    """What `loss.backward(retain_graph=...)` runs, without passing through torch-function dispatch:
    a TorchFunctionMode is off while it handles a call, and Tensor.backward is one, so the watcher
    entered around `loss.backward()` would be off in every hook of the backward."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None) or \
        torch.autograd.Variable._execution_engine.run_backward
    run((loss,), (torch.ones_like(loss),), retain_graph, False, (), allow_unreachable=True, accumulate_grad=True)
