"""Stage 3's gather schedule (zero_ref/core/units.py) over a scripted control channel: the first pass
learns it in rounds, later passes follow it with one closing round each, and with `trust_after`
(checks="off") a schedule every rank followed for that many passes stops its closing rounds; a
request outside it is then refused on this rank, by name, instead of waiting for a round no other
rank will join."""

from __future__ import annotations

import pytest

from zero_ref.core.units import DONE, FAILED, GatherSchedule


class ScriptedComm:
    """One rank's control channel: `exchange` answers with this rank's request and the other
    ranks' scripted ones (DONE unless a test queues something else)."""

    def __init__(self, others: int = 1):
        self.others, self.queued, self.exchanges = others, [], 0

    def exchange(self, values: list[int]) -> list[list[int]]:
        self.exchanges += 1
        others = self.queued.pop(0) if self.queued else [DONE] * self.others
        return [values] + [[v] for v in others]


def _pass(schedule: GatherSchedule, units: list[int], held: set[int] = frozenset(), failed: bool = False) -> None:
    schedule.begin()
    for u in units:
        schedule.acquire(u, held=u in held)
    schedule.finish(failed)


def test_a_followed_schedule_stops_its_closing_rounds_after_trust_after_quiet_passes():
    comm, issued = ScriptedComm(), []
    schedule = GatherSchedule(comm, issued.append, depth=1, trust_after=2)
    _pass(schedule, [0, 1, 2])                     # learning: a round per unit, then the closing one
    assert schedule.entries == [0, 1, 2] and comm.exchanges == 4 and not schedule.trusted
    for quiet in (1, 2):                           # following it: one closing round each
        before = comm.exchanges
        _pass(schedule, [0, 1, 2], held={1, 2})
        assert comm.exchanges == before + 1 and schedule.quiet_passes == quiet
    assert schedule.trusted
    before, issued[:] = comm.exchanges, []
    _pass(schedule, [0, 1, 2], held={1, 2})
    assert comm.exchanges == before and issued == [0, 1, 2]   # the whole schedule, no round
    with pytest.raises(RuntimeError, match=r"unit 7 outside the gather order.*checks='strict'"):
        schedule.begin()
        schedule.acquire(7, held=False)


def test_a_request_or_a_failure_on_any_rank_restarts_the_count_and_without_trust_after_rounds_never_stop():
    comm = ScriptedComm(others=2)
    schedule = GatherSchedule(comm, lambda u: None, depth=1, trust_after=2)
    _pass(schedule, [0, 1])
    _pass(schedule, [0, 1], held={1})
    assert schedule.quiet_passes == 1
    comm.queued = [[3, DONE], [DONE, DONE]]         # another rank needed unit 3: its pass went apart
    _pass(schedule, [0, 1], held={1})
    assert schedule.quiet_passes == 0 and not schedule.trusted
    comm.queued = [[FAILED, DONE]]                  # another rank's pass raised
    _pass(schedule, [0, 1], held={1})
    assert schedule.failed_ranks == [1] and schedule.quiet_passes == 0
    strict = GatherSchedule(ScriptedComm(), lambda u: None, depth=1)
    for _ in range(6):
        _pass(strict, [0, 1], held={1})
    assert not strict.trusted and strict.comm.exchanges == 2 + 5   # learning: 2, then one round a pass
