"""The step's vote is exact: named fields compared exactly, no hash that lets a difference through, no
counter that wraps, no limit on the number of ranks (core/optim.py, guard/strict.py)."""

from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch

from zero_ref.launch import spawn

LR = 1e-2


def _sixteen_bit_fingerprint(values: list[float]) -> list[int]:
    """What the vote compared before: a crc32 of the hyper-parameters cut into four 4-bit parts."""
    digest = zlib.crc32(struct.pack(f"<{len(values)}d", *values))
    return [(digest >> (4 * i)) & 15 for i in range(4)]


def _lr_the_fingerprint_misses(lr: float, rest: list[float]) -> float:
    """A learning rate a few ulps above `lr` whose 16-bit fingerprint equals `lr`'s."""
    target, candidate = _sixteen_bit_fingerprint([lr, *rest]), lr
    while True:
        candidate = math.nextafter(candidate, math.inf)
        if _sixteen_bit_fingerprint([candidate, *rest]) == target:
            return candidate


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated failure in backward")


def _votes(rank: int, world_size: int, other_lr: float) -> dict:
    import zero_ref
    from awkward import AwkwardNet, global_batches, loss_fn

    out = {}
    tokens = global_batches(1, 1, 4 * world_size)[0][0].chunk(world_size)[rank]

    # 1. rank 1 holds a learning rate that the 16-bit fingerprint took for rank 0's
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=2, lr=LR, weight_decay=0.0))
    if rank == 1:
        engine.optimizer.param_groups[0]["lr"] = other_lr
    before = engine.full_state_dict()
    engine.backward(loss_fn(engine(tokens), tokens))
    try:
        out["hyper"] = f"stepped: {engine.step()}"
    except ValueError as err:
        out["hyper"] = str(err)
    after = engine.full_state_dict()
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    engine.close()

    # 2. rank 0's backward raises at micro-batch 1, rank 1's at micro-batch 16 (which a count modulo 15
    # read as 1)
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=2, lr=LR, grad_accum_steps=16))
    fail_at = 1 if rank == 0 else 16
    out["failure"] = "no error"
    for micro in range(1, 17):
        loss = loss_fn(engine(tokens), tokens)
        try:
            engine.backward(_RaiseInBackward.apply(loss) if micro == fail_at else loss)
        except (RuntimeError, ValueError) as err:
            out["failure"] = f"{type(err).__name__}: {err}"
            break
    engine.close()
    return out


def test_a_difference_a_16_bit_fingerprint_misses_and_failures_at_micro_batch_1_and_16_are_refused():
    """A learning rate a few ulps apart, with the same 16-bit fingerprint, is refused on every rank
    and nothing changes; a backward failure at micro-batch 1 on one rank and 16 on the other is told
    apart (ValueError on both ranks), where the vote's old count modulo 15 read both as 1."""
    rest = [0.9, 0.999, 1e-8, 0.0]   # betas, eps, weight_decay of the only group
    other = _lr_the_fingerprint_misses(LR, rest)
    assert other != LR and _sixteen_bit_fingerprint([other, *rest]) == _sixteen_bit_fingerprint([LR, *rest])
    results = spawn(_votes, 2, other)
    for out in results:
        assert "different hyper-parameters" in out["hyper"], out["hyper"]
        assert out["unchanged"]
        assert out["failure"].startswith("ValueError") and "backward raised on this rank" in out["failure"], \
            out["failure"]


@pytest.mark.slow
def test_the_vote_works_at_100000_ranks():
    """The engine at scale (a fake process group of 100,000 ranks, this process rank 0): a guarded
    step votes and updates; nothing in the vote caps the number of ranks."""
    import zero_ref
    from zero_ref.analysis.at_scale import fake_world

    from awkward import AwkwardNet, global_batches, loss_fn

    tokens = global_batches(1, 1, 4)[0][0]
    with fake_world(100_000):
        engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=2, lr=LR, checks="strict"))
        engine.backward(loss_fn(engine(tokens), tokens))
        vote = engine.vote(stepping=True)
        assert vote.same == {"failed_at": True, "hyper": True}
        assert vote.counts["stepping"] == 1.0   # a fake group sums nothing: this rank's own count
        assert engine.step()
        engine.close()
