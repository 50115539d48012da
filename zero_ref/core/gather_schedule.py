"""Stage 3's gathers in one order on every rank, whatever order each rank's modules run in.

An all-gather pairs with the all-gathers of the other ranks by position: if rank 0 gathers unit A
while rank 1 gathers unit B of the same size, both silently receive a mix of the two. A forward
whose module order depends on the data (or a module skipped on one rank) would do exactly that if
each rank gathered what it needs when it needs it. So gathers are not issued by need but by a
*schedule*, the same on every rank:

* The first pass of each kind (forward, backward) learns it. Each rank that needs a unit it does
  not hold enters a *round*: one control exchange in which every rank says which unit it needs
  (or that its pass is done); every rank then gathers all the requested units, in rank order. A
  rank whose pass is over keeps answering rounds until every rank's is. The sequence of units so
  gathered, the same on every rank by construction, is the schedule (each unit once).
* Later passes follow it: a rank that needs unit u issues the schedule's gathers in order up to u
  (plus `depth` more, the prefetch), so every rank issues the same gathers in the same order. A
  rank whose modules run in another order simply holds a few units longer.
* A unit that is needed again after its schedule entry was used (a rank-dependent loop, say)
  first issues the rest of the schedule, then enters a round, so the gathers still line up; at
  the end of a pass each rank issues whatever it has not, and answers rounds until all are done.

Every rank thus issues exactly the same gathers, and gets exactly the values it needs; a round
costs one exchange of a few integers per rank on the control channel (one per pass when nothing
deviates). Nothing here moves data: `issue(u)` (the stage's) starts the gather of unit u.

A rank whose pass raised (its forward failed part-way) still finishes the pass as above, but
answers FAILED instead of DONE: every rank sees the same rounds, so every rank learns which ranks'
passes raised (`failed_ranks`) and can stop with them (stage3.py).
"""

from __future__ import annotations

from typing import Callable

from .labels import label

DONE = -1     # a round's answer: this rank's pass is over
FAILED = -2   # ... and it raised


class GatherSchedule:
    """The order in which every rank issues unit gathers during one kind of pass.

    Args:
        comm: the engine's Comm (rounds use its control channel).
        issue: `issue(u)` starts gathering unit u on this rank (the stage decides where to put it).
        depth: how many schedule entries to issue beyond the one needed (the prefetch).
    """

    def __init__(self, comm, issue: Callable[[int], None], depth: int):
        self.comm, self.issue, self.depth = comm, issue, depth
        self.entries: list[int] | None = None   # learned by the first pass
        self.position: dict[int, int] = {}      # unit -> index in entries
        self.begin()

    @property
    def learned(self) -> bool:
        return self.entries is not None

    def begin(self) -> None:
        """A pass starts: nothing has been issued yet."""
        self.cursor = 0
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
        """A module is about to use unit u; `held` says whether this rank holds it (gathered or in
        flight). Afterwards it does, and the prefetch has been issued."""
        if self.learned and u in self.position and (held or self.position[u] >= self.cursor):
            self._issue_through(self.position[u] + 1 + self.depth)
        elif not held:
            if self.learned:   # u's entry is used up, or u is not in the schedule at all
                self._issue_through(len(self.entries))   # the gathers must line up before a round
            self._round(u)

    def _round(self, request: int) -> list[int]:
        """One control exchange: every rank's request (or DONE, or FAILED); gather the requested units."""
        wanted: list[int] = []
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
        """This rank's pass is over (`failed`: it raised): issue the rest of the schedule, answer
        rounds until every rank's pass is over, and, after a first pass, keep what was gathered as
        the schedule."""
        if self.learned:
            self._issue_through(len(self.entries))
        while self._round(FAILED if failed else DONE):
            pass
        if not self.learned:
            self.entries = list(dict.fromkeys(self.gathered))
            self.position = {u: k for k, u in enumerate(self.entries)}
