"""Parameter groups and learning-rate schedules: `engine.optimizer`, a torch Optimizer facade.

Real training changes the learning rate every step (warmup, cosine decay) and leaves biases and
norms out of weight decay. Both are per-parameter hyper-parameters, so neither changes what ZeRO
shards: every parameter keeps its place in the flat buffers, and each rank's optimizer looks up the
hyper-parameters of the parameter a piece belongs to when it updates that piece.

    engine = zero_ref.initialize(model, config, param_groups=[
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warmup_then_cosine)
    ...
    engine.backward(loss); engine.step(); scheduler.step()

`engine.optimizer` is a `torch.optim.Optimizer` (so torch's `lr_scheduler` classes accept it) whose
`param_groups` hold the groups' `lr`, `betas`, `eps` and `weight_decay` (unset ones default to the
ZeroConfig's). `engine.step()` reads them afresh, so a change applies exactly on the next step. Its
`step()` is `engine.step()`, its `zero_grad()` is `engine.zero_grad()`; its state lives in the
engine's shards, so `state_dict()` refuses and points to `engine.save_checkpoint`, which saves the
groups' values (and, if given, the scheduler's state). Only those four values may change: the
parameters' grouping is fixed at initialize (the stage looks a piece's group up in a table built
then), and the update is AdamW's with torch's defaults for its other options, so `engine.step()`
refuses a parameter moved between groups by hand, or an option such as `maximize=True` set on a
group, which it would otherwise ignore.

Every rank must hold the same values, or the shards of one model would take different steps:
with checks="strict" the step's vote compares them exactly and every rank refuses the step together
when they differ (a scheduler stepped on some ranks only) or are invalid somewhere (guard/strict.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")
"""What a group may set (beside "params"); a scheduler may add its own keys (e.g. "initial_lr")."""

ALLOWED_KEYS = ("params", *HYPER_KEYS)
"""The keys a group passed to `initialize` may hold."""

ADAMW_FIXED = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": True}
"""torch.optim.AdamW's other options that change its update, at the only values zero-ref's update
implements. (Its foreach, fused, capturable and differentiable choose how torch computes, not
what: any value gives the same update.)"""

REGROUPING = ("Nothing was updated on any rank. The parameters' grouping is fixed when the engine is built, and "
              f"a group may change only its {', '.join(HYPER_KEYS)}: pass param_groups to zero_ref.initialize "
              "for another grouping")


def check_hyper(where: str, group: dict) -> tuple[float, float, float, float, float]:
    """(lr, beta1, beta2, eps, weight_decay) of one group as floats; ValueError naming the bad key."""
    missing = [key for key in HYPER_KEYS if key not in group]
    if missing:
        raise ValueError(f"{where} lacks {missing}: a group holds {', '.join(HYPER_KEYS)}; set them again")

    def number(key, value, ok, allowed):
        value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"{where}[{key!r}] = {group[key]!r} is not allowed: expected {allowed}")
        return float(value)

    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"{where}['betas'] = {betas!r} is not allowed: expected a pair of numbers in [0, 1)")
    beta1, beta2 = (number("betas", b, lambda v: 0 <= v < 1, "a pair of numbers in [0, 1)") for b in betas)
    return (number("lr", group["lr"], lambda v: v >= 0, "a finite number >= 0"), beta1, beta2,
            number("eps", group["eps"], lambda v: v > 0, "a finite number > 0"),
            number("weight_decay", group["weight_decay"], lambda v: v >= 0, "a finite number >= 0"))


def check_options(where: str, group: dict) -> None:
    """ValueError naming the first of AdamW's options (ADAMW_FIXED) that `group` sets to a value
    zero-ref's update does not implement, which it would silently ignore. Other keys, such as the
    'initial_lr' or 'max_momentum' of torch's schedulers, do not enter the update and may be there."""
    for key, implemented in ADAMW_FIXED.items():
        value = group.get(key, implemented)
        if not (isinstance(value, type(implemented)) and value == implemented):
            raise ValueError(f"{where}[{key!r}] = {value!r} is not supported: zero-ref's AdamW reads "
                             f"{', '.join(ALLOWED_KEYS)} from a group, and is torch's with {key}={implemented!r}. "
                             f"Nothing was updated on any rank; remove the key or set it to {implemented!r}")


def build_groups(spec, model: nn.Module, trainable: list[nn.Parameter], defaults: dict) -> list[dict]:
    """Validated groups from torch's form (a list of dicts with "params" and optional HYPER_KEYS), each
    trainable parameter in exactly one; None: one group of every trainable parameter."""
    if spec is None:
        return [{"params": list(trainable), **defaults}]
    if isinstance(spec, dict) or not hasattr(spec, "__iter__"):
        raise TypeError("param_groups must be a list of dicts like torch's optimizers take "
                        "([{'params': [...], 'weight_decay': 0.0}, ...]), got " + type(spec).__name__)
    names = {id(p): n for n, p in model.named_parameters()}
    trainable_ids = {id(p) for p in trainable}
    owner: dict[int, int] = {}
    groups = []
    for i, group in enumerate(spec):
        where = f"param_groups[{i}]"
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"{where} must be a dict with a 'params' entry, got {group!r:.80}")
        unknown = sorted(set(group) - set(ALLOWED_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}: allowed are {', '.join(ALLOWED_KEYS)}")
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for param in params:
            if not isinstance(param, nn.Parameter) or id(param) not in names:
                raise ValueError(f"{where}['params'] holds a tensor that is not a parameter of the model "
                                 f"({type(param).__name__} of shape {tuple(getattr(param, 'shape', ()))})")
            if id(param) not in trainable_ids:
                raise ValueError(f"{where}['params'] holds {names[id(param)]}, which is frozen "
                                 "(requires_grad=False): frozen parameters are not optimized")
            if id(param) in owner:
                raise ValueError(f"parameter {names[id(param)]} is in param_groups[{owner[id(param)]}] and "
                                 f"{where}: each parameter belongs to one group")
            owner[id(param)] = i
        merged = {**defaults, **{k: v for k, v in group.items() if k != "params"}, "params": params}
        if "betas" in group:
            merged["betas"] = tuple(group["betas"]) if isinstance(group["betas"], (tuple, list)) else group["betas"]
        check_hyper(where, merged)
        groups.append(merged)
    missing = [names[id(p)] for p in trainable if id(p) not in owner]
    if missing:
        raise ValueError(f"trainable parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} are in no "
                         "param group: list each in one group, or freeze it with requires_grad_(False)")
    return groups


class ZeroOptimizer(torch.optim.Optimizer):
    """The engine's optimizer as torch sees it: `param_groups` to read and change (by hand or by a
    torch lr_scheduler), `step()` = `engine.step()`, `zero_grad()` = `engine.zero_grad()`. The
    optimizer state itself (fp32 masters and moments) is sharded inside the engine's stage."""

    def __init__(self, engine, groups: list[dict]):
        self._engine = engine
        self._building = True
        defaults = {k: v for k, v in groups[0].items() if k in HYPER_KEYS}
        super().__init__([dict(g) for g in groups], defaults)
        self._building = False
        index = engine.stage.index
        self.group_of = [0] * len(index)
        """group_of[k]: the group of trainable parameter k (the stage's index)."""
        for g, group in enumerate(self.param_groups):
            for param in group["params"]:
                self.group_of[index[id(param)]] = g
        self.members = [sorted(map(id, group["params"])) for group in self.param_groups]
        """members[g]: the ids of group g's parameters at initialize, which group_of holds."""

    def hyperparameters(self) -> list[tuple[float, float, float, float, float]]:
        """(lr, beta1, beta2, eps, weight_decay) per group, as this rank holds them now (validated,
        with the groups' members and options: `check_grouping`)."""
        self.check_grouping()
        return [check_hyper(f"engine.optimizer.param_groups[{g}]", group) for g, group in enumerate(self.param_groups)]

    def check_grouping(self) -> None:
        """ValueError unless the groups hold the parameters they held at initialize and no option
        zero-ref does not implement (`check_options`): the update takes a parameter's group from
        `group_of`, so a parameter moved to another group by hand would keep its old group's
        hyper-parameters, silently."""
        if len(self.param_groups) != len(self.members):
            raise ValueError(f"engine.optimizer.param_groups holds {len(self.param_groups)} groups, the engine was "
                             f"built with {len(self.members)}. {REGROUPING}")
        for g, (group, members) in enumerate(zip(self.param_groups, self.members)):
            where = f"engine.optimizer.param_groups[{g}]"
            params = group.get("params")
            if not isinstance(params, (list, tuple)) or sorted(map(id, params)) != members:
                raise ValueError(f"{where}['params'] was changed after initialize ({self._change(params, members)}). "
                                 f"{REGROUPING}")
            check_options(where, group)

    def _change(self, params, members: list[int]) -> str:
        """How `params` differs from a group's `members` at initialize, in the model's names."""
        if not isinstance(params, (list, tuple)):
            return f"it is a {type(params).__name__}, not a list of parameters"
        names = {id(p): n for n, p in self._engine.module.named_parameters()}
        held = {id(p) for p in params}
        gained = sorted(names.get(i, "a tensor not of the model") for i in held - set(members))
        lost = sorted(names[i] for i in set(members) - held)
        changes = [f"{what} {', '.join(map(repr, which[:3]))}{' ...' if len(which) > 3 else ''}"
                   for what, which in (("it now holds", gained), ("it no longer holds", lost)) if which]
        return "; ".join(changes) or "it lists a parameter twice"

    def step(self, closure=None):
        """`engine.step()`: the update, if the backwards since the last step complete one."""
        if closure is not None:
            raise ValueError("engine.optimizer.step takes no closure: run forward and engine.backward, then step")
        return self._engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """`engine.zero_grad(set_to_none)`: discard the gradients accumulated since the last step."""
        self._engine.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        if not self._building:
            raise RuntimeError("the engine's parameter groups are fixed when it is built: pass every group "
                               "to zero_ref.initialize(..., param_groups=[...])")
        super().add_param_group(param_group)

    def state_dict(self):
        raise RuntimeError("the optimizer state is sharded across the ranks: save it with engine.save_checkpoint "
                           "(it keeps the groups' hyper-parameters and, if passed, the lr scheduler's state)")

    def load_state_dict(self, state_dict) -> None:
        raise RuntimeError("the optimizer state is sharded across the ranks: restore it with engine.load_checkpoint")
