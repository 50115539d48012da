"""Stage 3's units: how a model is cut into them, one unit's lifetime, and the gather schedule.

A unit is the parameters of one module subtree, gathered and freed together (stage3.py). Its
lifetime is one explicit state (`UnitState`) and a count of named reasons it is held (`Hold`): it
is gathered when a reason appears and freed when none is left, in one place (Stage3._free_if_unheld).

Gathers pair up across ranks by position: if rank 0 gathers unit A while rank 1 gathers unit B of
the same size, both silently receive a mix. So when module order depends on the data, ranks must
not gather by need but follow a `GatherSchedule`, the same on every rank:

* The first pass of each kind (forward, backward) learns it in *rounds*: a rank that needs a unit
  it does not hold exchanges one integer with every rank (the unit, or DONE), and all ranks gather
  every requested unit in rank order. A rank whose pass is over keeps answering until all are.
* Later passes follow it: needing unit u, a rank issues the schedule up to u plus `depth` more
  (the prefetch). A unit needed again after its entry was used issues the rest of the schedule,
  then a round. A rank whose modules run in another order holds a few units longer.
* A rank whose pass raised answers FAILED instead of DONE, so every rank learns whose pass raised
  (`failed_ranks`) and can stop with them.

A round is one control exchange and a wait for the slowest rank (one per pass when nothing
deviates). With `trust_after` (checks="off") a schedule every rank followed that many passes in a
row skips its closing round; a rank then needing a unit outside it raises.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .labels import label


def build_units(model: nn.Module, trainable: list[nn.Parameter], unit_numel: int
                ) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Cut the model into units, children first: a callable module whose subtree holds at least
    `unit_numel` unassigned trainable elements roots a unit of them; the model takes the rest. A
    tied weight goes only to a module whose subtree holds all its users (one gather serves all)."""
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
    """The tensors in a unit root's output (through torch's pytree, which knows Hugging Face's
    ModelOutput, and dataclasses), each to get the hook that gathers the unit for its backward."""
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


DONE = -1     # a round's answer: this rank's pass is over
FAILED = -2   # ... and it raised
TRUST_AFTER = 3
"""Passes in a row without a request or a failure after which checks="off" skips the closing round."""


class GatherSchedule:
    """The order in which every rank issues unit gathers in one kind of pass (see the module
    docstring): `issue(u)` starts unit u's gather; `depth` entries are issued ahead (prefetch)."""

    def __init__(self, comm, issue: Callable[[int], None], depth: int, trust_after: int | None = None):
        self.comm, self.issue, self.depth = comm, issue, depth
        self.entries: list[int] | None = None   # learned by the first pass
        self.position: dict[int, int] = {}      # unit -> index in entries
        self.trust_after = trust_after          # quiet passes after which rounds stop (None: never)
        self.quiet_passes = 0                   # learned passes in a row with one closing round and nothing else
        self.begin()

    @property
    def learned(self) -> bool:
        return self.entries is not None

    @property
    def trusted(self) -> bool:
        """Every rank has followed the schedule for `trust_after` passes: no more closing rounds."""
        return self.trust_after is not None and self.quiet_passes >= self.trust_after

    def begin(self) -> None:
        """A pass starts: nothing has been issued yet."""
        self.cursor = 0
        self.rounds = 0                 # this pass's rounds
        self.gathered: list[int] = []   # this pass's gathers, in order (what a first pass learns)
        self.failed_ranks: list[int] = []   # ranks whose pass raised, as the rounds told

    def _issue(self, u: int) -> None:
        self.gathered.append(u)
        self.issue(u)

    def _issue_through(self, end: int) -> None:
        """Issue schedule entries up to index `end` (exclusive)."""
        while self.cursor < min(end, len(self.entries)):
            self._issue(self.entries[self.cursor])
            self.cursor += 1

    def acquire(self, u: int, held: bool) -> None:
        """A module is about to use unit u (`held`: gathered or in flight here); afterwards it is held."""
        if self.learned and u in self.position and (held or self.position[u] >= self.cursor):
            self._issue_through(self.position[u] + 1 + self.depth)
        elif not held:
            if self.trusted:
                raise RuntimeError(f"stage 3 (checks='off'): this rank needs unit {u} outside the gather order every "
                                   f"rank followed for {self.quiet_passes} passes, which off no longer confirms: the "
                                   "module order depends on the data, use checks='strict'")
            if self.learned:   # u's entry is used up, or u is not in the schedule at all
                self._issue_through(len(self.entries))   # the gathers must line up before a round
            self._round(u)

    def _round(self, request: int) -> list[int]:
        """One control exchange: every rank's request (or DONE, or FAILED); gather the requested units."""
        wanted: list[int] = []
        self.rounds += 1
        with label("zero_ref::schedule round"):   # a profiler label only
            answers = self.comm.exchange([request])
        for rank, (unit,) in enumerate(answers):
            if unit == FAILED and rank not in self.failed_ranks:
                self.failed_ranks.append(rank)
            elif unit >= 0 and unit not in wanted:
                wanted.append(unit)
        for unit in wanted:
            self._issue(unit)
        return wanted

    def finish(self, failed: bool = False) -> None:
        """This rank's pass is over (`failed`: it raised): issue the rest, answer rounds until every
        rank's is over; a first pass keeps what was gathered as the schedule."""
        learned = self.learned
        if learned:
            self._issue_through(len(self.entries))
            if self.trusted:
                return
        while self._round(FAILED if failed else DONE):
            pass
        if not learned:
            self.entries = list(dict.fromkeys(self.gathered))
            self.position = {u: k for k, u in enumerate(self.entries)}
        # every rank saw the same rounds, so every rank counts the same quiet passes
        quiet = learned and self.rounds == 1 and not self.failed_ranks
        self.quiet_passes = self.quiet_passes + 1 if quiet else 0
