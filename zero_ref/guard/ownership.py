"""What an engine holds, marked on the model itself: each parameter names its engine, and the
model's `zero_grad()` discards the engine's gradients.

* Each parameter's `zero_ref_engine` is an `Owner`: a weak link to its engine (the model does not
  keep the engine alive). `initialize` refuses a model whose engine is still open (its hooks and
  views are that engine's) or that a stage-3 engine left without values (`check_not_taken`). A copy
  or a pickle of a parameter (`copy.deepcopy(model)`, `torch.save(model)`) belongs to no engine.
* `model.zero_grad()` is how torch users discard gradients (Hugging Face's Trainer calls it every
  step, some loops before every micro-batch). The engine owns the gradients (stages 2-3 keep none in
  `.grad`; at stages 0-1 `.grad` is a view of a buffer the reductions read), so on the model given
  to `initialize` it is `engine.zero_grad(set_to_none)`, then the model class's own `zero_grad`:
  mid-step it drops the micro-batches since the last step, as torch's would. A submodule's `zero_grad()` or
  `p.grad = None` does not reach the engine. `close()` gives the model its class's own back, and
  so does a copy or a pickle of the model.
"""

from __future__ import annotations

import functools
import sys
import weakref

import torch
from torch import nn

from .sharded_param import is_freed


class Owner:
    """A parameter's weak link to the engine that holds it; call it for the engine (or None)."""

    __slots__ = ("engine",)

    def __init__(self, engine=None):
        self.engine = None if engine is None else weakref.ref(engine)

    def __call__(self):
        return None if self.engine is None else self.engine()

    def __reduce__(self):   # a pickled parameter belongs to no engine (and needs no zero_ref to load)
        return (type(None), ())

    def __deepcopy__(self, memo):
        return None


def owner_of(param: nn.Parameter):
    """The open or closed engine holding `param`, or None."""
    owner = getattr(param, "zero_ref_engine", None)
    return owner() if isinstance(owner, Owner) else None


class ZeroGradThroughEngine:
    """The `zero_grad` a model has while an engine holds it: `engine.zero_grad()`, then the model
    class's own. Copied or pickled, it becomes the class's own, bound to the copy."""

    def __init__(self, engine, model: nn.Module):
        self.engine, self.model = weakref.ref(engine), weakref.ref(model)

    def __call__(self, set_to_none: bool = True) -> None:
        engine, model = self.engine(), self.model()
        if engine is not None and not engine.closed:
            engine.zero_grad(set_to_none)
        type(model).zero_grad(model, set_to_none)

    def __reduce__(self):   # the model is being pickled: its copy gets the class's own zero_grad
        model = self.model()
        return (functools.partial, (type(model).zero_grad, model))

    def __deepcopy__(self, memo):
        model = self.model()
        return functools.partial(type(model).zero_grad, memo.get(id(model), model))


def take(engine, model: nn.Module) -> None:
    """Mark `model`'s parameters as `engine`'s and route `model.zero_grad()` to it."""
    for param in model.parameters():
        param.zero_ref_engine = Owner(engine)
    model.zero_grad = ZeroGradThroughEngine(engine, model)


def release(model: nn.Module) -> None:
    """Undo `take`'s routing (the parameters keep naming their engine, now closed)."""
    if isinstance(model.__dict__.get("zero_grad"), ZeroGradThroughEngine):
        del model.zero_grad


def check_not_taken(model: nn.Module) -> None:
    """A model belongs to one open engine at a time (its hooks and views are that engine's), and a
    stage-3 engine leaves the parameters with no values (their storage freed, even once closed)."""
    for name, param in model.named_parameters():
        owner = owner_of(param)
        if owner is not None and not owner.closed:
            raise ValueError(f"parameter {name} already belongs to a zero-ref engine that is not closed: call "
                             "engine.close() on it first (or use `with zero_ref.initialize(...) as engine:`)")
        if is_freed(param):
            raise ValueError(f"parameter {name} has no values: a stage-3 engine sharded it and kept them (they are "
                             "freed here, even after close). Take engine.full_state_dict() before closing it and "
                             "build the model again, or load a checkpoint into the new engine")


def refuse_compiled(model: nn.Module) -> None:
    """Stage 3 gathers each unit's parameters in module hooks and watches parameter reads with a
    TorchFunctionMode; torch.compile traces into both and fails inside dynamo. Say so at initialize,
    before anything changes (stages 0-2 keep their work in gradient hooks, which compiled graphs run)."""
    wrapper = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", ())   # none if never imported
    for name, module in model.named_modules():
        if isinstance(module, wrapper) or \
                getattr(module, "_compiled_call_impl", None) is not None:
            where = f"its submodule {name!r}" if name else "the model"
            raise ValueError(
                f"stage 3 cannot train a torch.compile'd model ({where} is compiled): stage 3 gathers each "
                "unit's parameters in module hooks and watches parameter reads, which torch.compile cannot "
                "trace. Give stage 3 the model uncompiled, or compile it at stages 0-2")


def detached(stage) -> list[nn.Parameter]:
    """The trainable parameters that are no longer views of their place in the stage's buffers:
    something replaced their `.data` after initialize (``Module.to(dtype)``, ``.float()``,
    ``param.data = ...``). The optimizer would update values the model no longer reads."""
    out = []
    for g, group in enumerate(stage.groups):
        home = stage.param_buffer(g)
        storage, offset = home.untyped_storage()._cdata, home.storage_offset()
        for param, start, _ in group.param_ranges():
            if (param.dtype != home.dtype or param.untyped_storage()._cdata != storage
                    or param.storage_offset() != offset + start):
                out.append(param)
    return out


def detached_message(model: nn.Module, dtype: torch.dtype, detached: list[nn.Parameter],
                     unfrozen: list[nn.Parameter]) -> str:
    """Why step refuses, on every rank, when a parameter's .data was replaced on any rank (or a
    parameter frozen at initialize was made trainable)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    if unfrozen:
        which = ", ".join(repr(names.get(id(p), "?")) for p in unfrozen)
        return (f"parameters frozen at initialize were made trainable after it ({which} on this rank): the "
                "engine neither shards nor updates them. Nothing was updated on any rank. "
                "Set requires_grad before zero_ref.initialize (build a new engine for a new set of "
                "trainable parameters)")
    here = ", ".join(f"{names.get(id(p), '?')!r} (now {str(p.dtype).removeprefix('torch.')}, storage of its "
                     "own)" for p in detached)
    where = f"on this rank: {here}" if here else "on another rank"
    dtype = str(dtype).removeprefix("torch.")
    return (f"zero-ref's parameters were replaced after initialize, or frozen ones made trainable ({where}): "
            "something set their .data (Module.to(dtype), .float(), .half(), param.data = ...), so the model "
            "no longer reads the values the optimizer updates. Nothing was updated on any rank. Keep every "
            f"trainable parameter in the engine's dtype ({dtype}) and write values with "
            "engine.load_state_dict(...) instead. Hugging Face's Switch "
            "Transformers router calls self.classifier.to(router_dtype) in every forward: give it "
            f"SwitchTransformersConfig(router_dtype='{dtype}').")
