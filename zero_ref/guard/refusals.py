"""Refusing together: a collective call that one rank refuses must be refused on every rank.

`initialize`, `load_state_dict` and `save_checkpoint` are collective: every rank calls them, and
each first checks what it was given, on its own. A rank that refused and returned would leave the
others waiting in the call's next collective, or pairing it with a later one. So every rank sends
its refusal (None when it has none), with whatever the call compares across ranks, in one
`all_gather_object` on the control channel; then a rank that refused raises its own error, and
every other rank raises one naming the ranks that refused and the first one's reason. Either way
nothing has changed on any rank.
"""

from __future__ import annotations

from typing import Any

from ..core.comm import Comm


def gather_refusals(comm: Comm, refusal: Exception | None, payload: Any = None) -> tuple[list[str | None], list]:
    """Every rank's refusal (as "Type: message", None where it had none) and payload, in rank order:
    one exchange of Python objects, none at world size 1."""
    mine = (None if refusal is None else f"{type(refusal).__name__}: {refusal}", payload)
    everyone = comm.all_gather_object(mine) if comm.world_size > 1 else [mine]
    return [theirs for theirs, _ in everyone], [payload for _, payload in everyone]


def raise_refusals(refusal: Exception | None, refusals: list[str | None], what: str,
                   error: type[Exception] = ValueError, consequence: str = "nothing was changed on any rank") -> None:
    """Raise `refusal` (this rank's own) if there is one, else `error` if any rank refused."""
    if refusal is not None:
        raise refusal
    refused = [rank for rank, theirs in enumerate(refusals) if theirs]
    if refused:
        raise error(f"{what} was refused on rank(s) {', '.join(map(str, refused))} ({refusals[refused[0]]}); "
                    f"{consequence}")


def refuse_together(comm: Comm, refusal: Exception | None, payload: Any = None, *, what: str,
                    error: type[Exception] = ValueError, consequence: str = "nothing was changed on any rank"
                    ) -> list:
    """Every rank's payload, once no rank refused; otherwise an error on every rank (see the module)."""
    refusals, payloads = gather_refusals(comm, refusal, payload)
    raise_refusals(refusal, refusals, what, error, consequence)
    return payloads
