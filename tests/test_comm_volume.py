"""Elements moved per step, counted below zero-ref: a TorchDispatchMode sees every c10d collective
torch.distributed runs (the dispatcher's c10d ops, whatever called them) and counts floating-point
elements the paper's way. The count must equal the engine's own ledger, kind by kind, and the
paper's 2Ψ (stages 0-2) or 3Ψ (stage 3) up to padding and the step's statistics all-reduce."""

import pytest

from awkward import AwkwardNet, global_batches, loss_fn
from scenarios import cfg, local
from zero_ref.analysis.collective_count import CountCollectives
from zero_ref.launch import spawn


def count_steps(rank: int, world: int) -> dict:
    import zero_ref

    out = {}
    for stage, checks in [(s, c) for s in range(4) for c in ("strict", "off")]:
        with zero_ref.initialize(AwkwardNet(), cfg(stage, checks=checks)) as engine:
            for step, (tokens,) in enumerate(global_batches(3, 1, 12)):
                part = local(tokens, rank, world)
                counter = CountCollectives()
                with counter:   # the last step: after the first, which learns orders and layouts
                    if step == 2:
                        engine.backward(loss_fn(engine(part), part))
                        engine.step()
                if step < 2:
                    engine.backward(loss_fn(engine(part), part))
                    engine.step()
            out[stage, checks] = dict(counter.moved), engine.comm_stats()["last_step"], len(engine.stage.groups)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_counted_by_torch_match_the_ledger_and_the_paper(world):
    model = AwkwardNet()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    # the step's vote: a sum of [sum of squares, flag, used per parameter] and, with checks="strict",
    # of the guard's six counts (stepping, discarding, discarded, written, detached, invalid_hyper), then
    # (strict only) a MAX of each of its values and their negations: the micro-batch at which a backward
    # raised, and the five hyper-parameters of the only group
    statistics = {"off": 2 * (2 + tensors), "strict": 2 * (2 + tensors + 6) + 2 * 2 * (1 + 5)}
    buffers = model.gain.numel()     # broadcast_buffers: rank 0's float buffers before each forward
    for rank_out in spawn(count_steps, world, timeout=300):
        for (stage, checks), (counted, ledger, groups) in rank_out.items():
            assert "other" not in counted
            assert {k: counted.get(k, 0) for k in ledger if k != "total"} == {k: v for k, v in ledger.items()
                                                                             if k != "total"}, stage
            padding = groups * (world - 1)   # each group is padded by fewer than Nd elements
            assert counted["broadcast"] == buffers
            if stage == 0:
                assert counted["all_reduce"] == 2 * psi + statistics[checks]
            else:
                gathers = 2 if stage == 3 else 1
                assert psi <= counted["reduce_scatter"] <= psi + padding, stage
                assert gathers * psi <= counted["all_gather"] <= gathers * (psi + padding), stage
                assert counted["all_reduce"] == statistics[checks], stage
