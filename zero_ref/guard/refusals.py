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

import torch

from ..core.comm import Comm, all_gather_tensor
from ..core.in_flight import Pending

CALLS = ("full_state_dict", "save_checkpoint", "load_checkpoint", "load_state_dict")
"""The collective calls that training does not make, opened on the calls channel (`announce`)."""


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


def announce(comm: Comm, call: str) -> None:
    """Open the collective call `call` (one of `CALLS`) on every rank, before any of its collectives:
    every rank sends the call's name on the calls channel. A rank not making it leaves this one
    waiting here alone until `timeout_s` (CollectiveError, as the others get in their next
    collective) instead of pairing the call's first collective with a gradient bucket; ranks making
    different calls raise ValueError on every rank, and nothing was done."""
    if comm.alone or comm.backend == "fake":
        return
    mine = torch.tensor([CALLS.index(call)], dtype=torch.int64)
    gathered = mine.repeat(comm.world_size)
    work = all_gather_tensor(gathered, mine, group=comm.calls_group, async_op=True)
    Pending(work, f"{call} (a collective call: every rank must make it)", comm.rank, comm.control_timeout_s,
            comm.retire).wait()
    made = [CALLS[code] for code in gathered.tolist()]
    if len(set(made)) > 1:
        each = ", ".join(f"rank {rank}: {name}" for rank, name in enumerate(made))
        raise ValueError(f"the ranks made different collective calls at once ({each}): each must be made by "
                         "every rank, at the same point of the program. Nothing was done")
