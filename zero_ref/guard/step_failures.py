"""When a forward, backward or step raises on some ranks only: keep the ranks' collectives paired,
and make every rank raise at the same call.

A backward that raises on one rank may not raise on the others, which go on issuing collectives
(gradient reductions, stage 3's gathers, the step's statistics). If the failing rank simply
re-raised, the others would wait for it until `comm_timeout_s`, or worse, pair its next collective
with one of theirs. So:

1. Catch up (`finish_step_after_failure`): the failing rank issues the collectives the others
   issue, in the order every rank shares: the rest of this backward's, those of the step's
   remaining micro-batches (as backwards in which no gradient arrives), then the step's
   statistics. The statistics carry the micro-batch at which this rank's forward or backward
   raised (`Strict.failed_at`; 0: none).
2. Compare: the statistics are summed over the ranks, so every rank learns whether the failure was
   everyone's, at the same micro-batch. If so the error goes on, and `engine.zero_grad()` and the
   same micro-batch again is exact. If not, every rank raises ValueError (the failing ones from
   backward, the others from step) before anything is updated, and `zero_grad()` on every rank
   puts them in step again.
3. Ranks that reach a step boundary and do not step (several backwards before one step, a
   `full_state_dict` first) send the statistics before their next collective call
   (`check_nobody_failed_at_the_boundary`), so they learn of a failure there. The statistics have
   their own channel (comm.py), so a rank that waits there never pairs them with another rank's
   gradient bucket. The statistics also say which ranks sent them from step(): if some ranks step
   at a boundary and others go on without stepping, every rank raises ValueError there, before
   anything is updated (`refuse_unless_every_rank_steps`); step() on every rank then goes on. If the
   others dropped the step instead (zero_grad, load_checkpoint), the stepping ranks drop it too.
4. A zero_grad() in the middle of a step's micro-batches on some ranks only leaves the ranks with
   gradients of different micro-batches: the statistics say so, and every rank raises ValueError
   at that step, nothing updated (`refuse_if_some_ranks_discarded`).

A forward (with gradients enabled) that raised is recorded the same way. At stage 3 a forward that
raises on some ranks raises on every rank (stage3.py), so every rank skips or retries alike; at
stages 0-2 (no collective in forward) a rank that skips the batch alone is caught by the step's
statistics: ValueError on every rank, nothing updated (it is then a batch ahead of the others).

A step that raises once the update has begun (`step_raised`: say the fused Adam runs out of memory
on one rank) cannot be caught up: this rank's shard is partly updated and the others wait in the
regather for it. This rank's engine refuses every later call with the reason; the others' regather
raises CollectiveError within `comm_timeout_s`, after which their engines refuse too. Resume from the
last checkpoint in a new engine.
"""

from __future__ import annotations

from ..core.optim import StepVote
from ..core.in_flight import CollectiveError

FAILURE_DISAGREES = (
    "a backward raised on some ranks and not on the others (or at another micro-batch of the step), or a "
    "forward did: the ranks' gradients are not of the same batches, so nothing was updated on any rank. If "
    "every failure was in engine.backward, engine.zero_grad() on every rank and the next batch put the ranks in "
    "step again (the failing ranks issued the rest of the step's collectives); a rank that went on after its "
    "forward raised is a batch ahead of the others: restart from the last checkpoint")


def backward_raised(engine, guard, err: BaseException) -> None:
    """This rank's backward raised `err` (the engine already refuses to step until zero_grad): for an
    ordinary exception, catch up with the other ranks (raises ValueError if the failure was not
    every rank's). A CollectiveError (a peer is gone) or a KeyboardInterrupt goes on as it is."""
    guard.failed_at = (engine.micro_step - 1) % engine.config.grad_accum_steps + 1
    if isinstance(err, Exception) and not isinstance(err, CollectiveError):
        finish_step_after_failure(engine, err)


def finish_step_after_failure(engine, err: Exception) -> None:
    """Issue the collectives the other ranks issue until the step's vote (step 1 above), then
    raise ValueError if the failure was not every rank's at the same micro-batch (step 2). If a
    collective fails on the way (a peer is gone), `err` goes on with a note."""
    stage = engine.stage
    try:
        stage.end_backward(engine.at_boundary, failed=True)
        while not engine.at_boundary:
            engine.micro_step += 1
            engine.broadcast_buffers()
            stage.idle_forward()
            stage.begin_backward(engine.at_boundary)
            stage.end_backward(engine.at_boundary, failed=True)
        vote = engine.vote()
    except CollectiveError as comm_err:
        err.add_note(f"zero-ref could not keep the other ranks in step after this error: {comm_err}")
        return
    if not vote.same.get("failed_at", True):
        first_line = (str(err).splitlines() or [""])[0][:200]
        raise ValueError(f"engine.backward raised on this rank ({type(err).__name__}: {first_line}); "
                         f"{FAILURE_DISAGREES}") from err


def check_nobody_failed_at_the_boundary(engine, guard, discarding: bool = False) -> None:
    """A backward that raised at a step boundary on some rank caught up to the step there and sent
    the step's vote; this rank reached the boundary and did not step, but went on (another
    micro-batch, a collective call such as full_state_dict). Before any collective that rank never
    issues, send the vote too (step 3 above): every rank learns of the failure and raises
    ValueError; or, `discarding` the step (zero_grad, load_checkpoint), just goes on."""
    if not guard.boundary_unchecked:
        return
    vote = engine.vote(discarding=discarding)
    if not discarding:
        refuse_if_the_ranks_failed_apart(engine, vote)
        refuse_unless_every_rank_steps(engine, vote)


def refuse_if_the_ranks_failed_apart(engine, vote: StepVote) -> None:
    """ValueError if the vote says a forward or backward raised on some ranks only (or at other
    micro-batches); the gradients stay unusable until zero_grad, as on the ranks whose backward
    raised. Checked first wherever a vote is read: it is told only once."""
    if not vote.same.get("failed_at", True):
        engine.stage.polluted = FAILURE_DISAGREES
        raise ValueError(FAILURE_DISAGREES)


def refuse_unless_every_rank_steps(engine, vote: StepVote) -> None:
    """ValueError on every rank if step() sent the vote on some ranks while the others, at the same
    step boundary, went on without stepping (their next call sent it: step 3 above). Nothing was
    updated and the gradients are kept, so step() on every rank then goes on."""
    everyone, stepping, discarding = engine.ranks_summed, vote.counts["stepping"], vote.counts["discarding"]
    if 0 < stepping < everyone and discarding:
        engine.zero_grad()   # as the others did: every rank goes on from the same (empty) step
        raise ValueError(
            f"engine.step() was called at this step boundary on {int(stepping)} of {everyone} ranks, while "
            f"{int(discarding)} dropped the step (zero_grad(), or load_checkpoint). Nothing was updated on "
            "any rank, and the step's gradients are now dropped here too, so every rank goes on alike from the next "
            "micro-batch")
    if 0 < stepping < everyone:
        raise ValueError(
            f"engine.step() was called at this step boundary on {int(stepping)} of {everyone} ranks; the "
            "others went on without it (another forward or backward, or a collective call such as "
            "full_state_dict). Nothing was updated and the gradients are kept: call step() on every rank "
            "(or zero_grad() on every rank to drop them)")


def refuse_if_some_ranks_discarded(engine, vote: StepVote) -> None:
    """ValueError on every rank if zero_grad() dropped gradients of this step's earlier micro-batches
    on some ranks only: the ranks then hold gradients of different micro-batches (at stages 2-3
    the reduced ones of every rank), so no update would be the one torch computes. Nothing is
    updated; the gradients stay unusable until zero_grad() on every rank."""
    everyone, discarded = engine.ranks_summed, vote.counts["discarded"]
    if 0 < discarded < everyone:
        engine.stage.polluted = (
            f"engine.zero_grad() was called on {int(discarded)} of {everyone} ranks only in the middle of this "
            "step's micro-batches, so the ranks hold gradients of different micro-batches. Nothing was updated; "
            "call zero_grad() on every rank (or on none) and go on")
        raise ValueError(engine.stage.polluted)


def step_raised(engine, err: BaseException) -> None:
    """step() raised after the ranks agreed to update: this engine can no longer go on. (A
    CollectiveError is the other ranks' failure: the engine's channels refuse from now on, comm.py.)"""
    if isinstance(err, CollectiveError):
        return
    engine.broken = (
        f"engine.step() raised {type(err).__name__} on this rank while updating the parameters (global step "
        f"{engine.global_step + 1}): its shards are partly updated and the other ranks cannot finish the "
        "step without it. Build a new engine with zero_ref.initialize and load the last checkpoint")
