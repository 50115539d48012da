"""RankPool: ranks that stay alive between calls, and never hang the caller when one fails; and
what every launch (spawn or RankPool) gives its ranks."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from zero_ref.launch import RankError, RankPool, spawn


class Counter:
    """Keeps state between calls and talks to the other ranks."""

    def __init__(self, rank: int, world_size: int, start: int):
        self.rank, self.total = rank, start

    def add(self, value: int) -> int:
        summed = torch.tensor([float(value + self.rank)])
        dist.all_reduce(summed)
        self.total += int(summed.item())
        return self.total

    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"rank {rank} fails on purpose")
        dist.barrier()      # the other ranks wait in a collective that never completes

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


    def environment(self, name: str) -> str | None:
        return os.environ.get(name)


def _environment(rank: int, world_size: int, name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_see_the_callers_environment_as_it_is_at_each_launch(monkeypatch):
    """Ranks are forked from a server started at the first launch; a variable set or removed
    after that still reaches (or leaves) the ranks of every later spawn and pool."""
    name = "ZERO_REF_TEST_PROBE"
    monkeypatch.delenv(name, raising=False)
    assert spawn(_environment, 1, name) == [None]           # the server exists from here on
    monkeypatch.setenv(name, "set after the first launch")
    assert spawn(_environment, 2, name) == ["set after the first launch"] * 2
    with RankPool(2, Counter, 0) as pool:
        assert pool.call("environment", name) == ["set after the first launch"] * 2
    monkeypatch.delenv(name)
    assert spawn(_environment, 2, name) == [None] * 2


def test_state_is_kept_between_calls_and_a_failing_rank_raises_everywhere_at_once():
    with RankPool(3, Counter, 10, collective_timeout_s=60) as pool:
        assert pool.call("add", 1) == [10 + 6] * 3         # (1+0) + (1+1) + (1+2)
        assert pool.call("add", value=0) == [16 + 3] * 3
        start = time.monotonic()
        with pytest.raises(RankError, match="rank 2 fails on purpose"):
            pool.call("fail_on", 2)
        assert time.monotonic() - start < 30                # not the 60 s collective timeout
        with pytest.raises(RuntimeError, match="closed"):
            pool.call("add", 1)


def test_a_call_past_the_timeout_raises_and_kills_the_ranks():
    pool = RankPool(1, Counter, 0, timeout_s=3)
    processes = list(pool._processes)
    with pytest.raises(TimeoutError, match="did not finish sleep"):
        pool.call("sleep", 60)
    assert not any(p.is_alive() for p in processes)


def test_a_factory_that_raises_is_reported_with_its_traceback():
    with pytest.raises(RankError, match="unexpected keyword|positional"):
        RankPool(2, Counter)
