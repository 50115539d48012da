"""`ZeroConfig(checks="strict")`: every protection of the engine, at the core's seams (core/seams.py).

What each seam adds to the bare core:

    setup            the ranks compare model, config and parameter groups; a refusal on one rank is
                     a ValueError on every rank (same_everywhere.py)
    started          the model is this engine's (ownership.py); at stage 3 its parameters say so
                     when read while freed (sharded_param.py), and reads outside a unit are watched
                     in forward and backward (unit_reads.py)
    before_call      a rank at a step boundary that did not step sends the vote first, so a failure
                     elsewhere is told to every rank (step_failures.py); a collective call training
                     does not make opens on the calls channel (refusals.announce)
    forward_raised / backward_raised
                     the failure protocol: the failing rank issues the collectives the others
                     issue, and the vote tells every rank whether it was everyone's (step_failures.py)
    vote             named fields: counts (ranks that stepped, dropped the step, dropped earlier
                     micro-batches, wrote parameters from outside, replaced a parameter's .data) and
                     values every rank must hold alike, compared exactly (the hyper-parameters, the
                     micro-batch at which a forward or backward raised)
    before_update    refuse, on every rank alike, a step the vote does not agree on; adopt or refuse
                     values written into the parameters from outside (param_writes.py)
    update_raised    an update that raised part-way leaves this engine refusing every call
"""

from __future__ import annotations

import contextlib

from ..core.in_flight import CollectiveError
from ..core.seams import Seams
from . import ownership, param_writes, refusals, step_failures
from .same_everywhere import check_same_everywhere
from .sharded_param import mark_sharded, plain
from .unit_reads import ExternalUseWatcher, run_autograd

FORWARD_ON_EVERY_RANK = (
    "It was the engine's forward, which runs collectives (rank 0's buffers first under ZeroConfig.broadcast_buffers; "
    "at stage 3 each unit's gather), so every rank must run it: to evaluate on some ranks only, call "
    "engine.module(...) under torch.no_grad() there (stages 0-2), or evaluate on every rank")
HYPER_INVALID = ("{n} of {everyone} ranks hold invalid hyper-parameters in engine.optimizer.param_groups (a bad value, "
                 "an option zero-ref does not implement, or parameters moved between groups: those ranks raise what "
                 "they found). Nothing was updated on any rank")
HYPER_DIFFER = ("the ranks hold different hyper-parameters in engine.optimizer.param_groups (a learning-rate "
                "scheduler or a manual change applied on some ranks only?): every rank must set the same values. "
                "Nothing was updated on any rank")


class Strict(Seams):
    """The guard of one engine, and what it remembers between calls of a step."""

    mp_counts = ("detached",)   # a parameter replaced on one MP rank stops every MP rank

    def __init__(self):
        self.failed_at = 0               # micro-batch of this step at which a forward or backward raised (0: none)
        self.discarded_mid_step = False  # zero_grad() dropped gradients of this step's earlier micro-batches
        self.boundary_unchecked = False  # a backward reached a step boundary and no vote followed yet
        self.watcher: ExternalUseWatcher | None = None
        self.marked: list = []           # stage 3: the parameters that say so when read while freed
        self.writes: param_writes.WriteRecord | None = None   # what the engine last wrote into the parameters

    def setup(self, engine, build_groups, refusal, from_meta):
        return check_same_everywhere(engine.module, engine.comm, engine.config, build_groups, refusal,
                                     from_meta=from_meta)

    def started(self, engine) -> None:
        if engine.stage.params_sharded:   # reading a freed one raises instead of reading past its storage
            self.marked = mark_sharded(engine.module, engine.stage.trainable)
            self.watcher = ExternalUseWatcher(engine.stage)
        ownership.take(engine, engine.module)
        self.writes = param_writes.WriteRecord(engine.stage)

    def before_call(self, engine, call=None, discarding=False) -> None:
        step_failures.check_nobody_failed_at_the_boundary(engine, self, discarding)
        if call is not None:
            refusals.announce(engine.comm, call)

    @contextlib.contextmanager
    def forward_context(self, engine):
        try:
            with self._watching() if self.watcher is not None else contextlib.nullcontext():
                yield
        except CollectiveError as err:   # most often a forward run on some ranks only (an evaluation on rank 0)
            raise CollectiveError(f"{err}. {FORWARD_ON_EVERY_RANK}") from err

    @contextlib.contextmanager
    def _watching(self):
        with plain(self.marked), self.watcher:
            yield

    def run_backward(self, engine, loss, retain_graph) -> None:
        self.boundary_unchecked = engine.at_boundary
        if self.watcher is None:
            engine.stage.run_backward(loss, retain_graph)
            return
        with self._watching():   # entered below Tensor.backward, so it stays on in hooks (unit_reads.run_autograd)
            engine.stage.run_backward(loss, retain_graph, autograd=run_autograd)

    def forward_raised(self, engine) -> None:
        self.failed_at = engine.micro_step % engine.config.grad_accum_steps + 1

    def backward_raised(self, engine, err) -> None:
        step_failures.backward_raised(engine, self, err)

    def zero_grad(self, engine) -> None:
        self.discarded_mid_step |= engine.micro_step % engine.config.grad_accum_steps != 0

    def forget_dropped_step(self) -> None:
        """A load replaced the step in progress: what zero_grad or a failure recorded of it is moot."""
        self.discarded_mid_step, self.failed_at = False, 0

    def vote(self, engine, stepping, discarding):
        """This rank's fields of the step's vote; what they record is then forgotten (it is told)."""
        stage, optimizer = engine.stage, engine.optimizer
        try:
            hyper = [v for group in optimizer.hyperparameters() for v in group]
            invalid = 0.0
        except ValueError:   # step() raises it on every rank alike, after the vote
            hyper, invalid = [0.0] * (5 * len(optimizer.members)), 1.0
        detached = ownership.detached(stage) + [p for p in engine.frozen if p.requires_grad]
        counts = {"stepping": float(stepping), "discarding": float(discarding),
                  "discarded": float(self.discarded_mid_step), "written": float(self.writes.written()),
                  "detached": float(len(detached)), "invalid_hyper": invalid}
        same = {"failed_at": [float(self.failed_at)], "hyper": hyper}
        self.failed_at, self.discarded_mid_step, self.boundary_unchecked = 0, False, False
        return counts, same

    def before_update(self, engine, vote) -> None:
        step_failures.refuse_if_the_ranks_failed_apart(engine, vote)
        step_failures.refuse_unless_every_rank_steps(engine, vote)
        step_failures.refuse_if_some_ranks_discarded(engine, vote)
        if vote.counts["detached"]:
            unfrozen = [p for p in engine.frozen if p.requires_grad]
            raise RuntimeError(ownership.detached_message(engine.module, engine.dtype, ownership.detached(engine.stage),
                                                          unfrozen))
        if vote.counts["invalid_hyper"]:
            engine.optimizer.hyperparameters()   # raises this rank's own reason, if it has one
            raise ValueError(HYPER_INVALID.format(n=int(vote.counts["invalid_hyper"]), everyone=engine.ranks_summed))
        if not vote.same["hyper"]:
            raise ValueError(HYPER_DIFFER)
        param_writes.adopt_or_refuse(engine, self.writes, vote.counts["written"])

    def update_raised(self, engine, err) -> None:
        step_failures.step_raised(engine, err)

    def after_update(self, engine) -> None:
        self.writes.note()

    def close(self, engine) -> None:
        ownership.release(engine.module)
