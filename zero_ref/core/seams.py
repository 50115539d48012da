"""The named points where a guard joins the engine's step, and the bare core's answer at each.

The core trusts its caller: every rank builds the same model and config, makes the same calls in
the same order, and writes parameters only through the engine. zero_ref/guard checks that trust
(`checks="strict"`, the default). The core never imports it: the engine calls one `Seams` object,
and this class, the bare core's (`checks="off"`, as DeepSpeed and FSDP2 run), does nothing.
"""

from __future__ import annotations

import contextlib

import torch


class Seams:
    """The engine's seams (the engine passes itself to each). Subclassed by guard/strict.py."""

    mp_counts: tuple[str, ...] = ()
    """The names of `vote`'s counts summed over the model-parallel ranks too."""

    def setup(self, engine, build_groups, refusal: Exception | None, from_meta: bool) -> list[dict]:
        """At initialize, before anything changes: the parameter groups `build_groups()` returns."""
        if refusal is not None:
            raise refusal
        return build_groups()

    def started(self, engine) -> None:
        """At the end of initialize: the engine holds the model."""

    def before_call(self, engine, call: str | None = None, discarding: bool = False) -> None:
        """At the start of a forward, backward, zero_grad (`discarding`) or a collective call that
        training does not make (`call`: full_state_dict, save_checkpoint, ...)."""

    def forward_context(self, engine):
        """Entered around the model's forward."""
        return contextlib.nullcontext()

    def run_backward(self, engine, loss: torch.Tensor, retain_graph: bool) -> None:
        """The autograd pass of engine.backward."""
        engine.stage.run_backward(loss, retain_graph)

    def forward_raised(self, engine) -> None:
        """The model's forward (with gradients enabled) raised on this rank."""

    def backward_raised(self, engine, err: BaseException) -> None:
        """engine.backward raised `err` on this rank (re-raised after this returns)."""

    def zero_grad(self, engine) -> None:
        """engine.zero_grad() is about to drop the micro-batches since the last step."""

    def vote(self, engine, stepping: bool, discarding: bool) -> tuple[dict[str, float], dict[str, list[float]]]:
        """The guard's fields of the step's vote: ({name: count summed over the ranks}, {name:
        values every rank must hold alike}); see grad_stats.StepVote."""
        return {}, {}

    def before_update(self, engine, vote) -> None:
        """After the vote, before anything is updated: raise to refuse the step on every rank."""

    def update_raised(self, engine, err: BaseException) -> None:
        """The update raised once it had begun (re-raised after this returns)."""

    def after_update(self, engine) -> None:
        """The engine wrote new values into the parameters (a step, a load)."""

    def close(self, engine) -> None:
        """engine.close()."""
