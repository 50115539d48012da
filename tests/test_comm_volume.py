"""Elements moved per step, counted below zero-ref: a TorchDispatchMode sees every c10d collective
torch.distributed runs (the dispatcher's c10d ops, whatever called them) and counts floating-point
elements the paper's way. The count must equal the engine's own ledger, kind by kind, and the
paper's 2Ψ (stages 0-2) or 3Ψ (stage 3) up to padding and the step's statistics all-reduce."""

import pytest

from awkward import AwkwardNet, global_batches, loss_fn
from scenarios import cfg, local
from zero_ref.analysis.collective_count import CountCollectives
from zero_ref.launch import spawn
from zero_ref.core.param_groups import AGREEMENT_SLOTS


def count_steps(rank: int, world: int) -> dict:
    import zero_ref

    out = {}
    for stage in range(4):
        with zero_ref.initialize(AwkwardNet(), cfg(stage)) as engine:
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
            out[stage] = dict(counter.moved), engine.comm_stats()["last_step"], len(engine.stage.groups)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_counted_by_torch_match_the_ledger_and_the_paper(world):
    model = AwkwardNet()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    # the step's all-reduce of [sum of squares, flag, used per parameter, the hyper-parameters'
    # agreement fingerprint and the micro-batch at which a backward raised (AGREEMENT_SLOTS), whether the
    # parameters were written from outside, whether step() sent them, whether a call dropping the step did,
    # whether zero_grad dropped earlier micro-batches, how many left the engine's buffers]
    statistics = 2 * (2 + tensors + AGREEMENT_SLOTS + 1 + 1 + 1 + 1 + 1)
    buffers = model.gain.numel()     # broadcast_buffers: rank 0's float buffers before each forward
    for rank_out in spawn(count_steps, world, timeout=300):
        for stage in range(4):
            counted, ledger, groups = rank_out[stage]
            assert "other" not in counted
            assert {k: counted.get(k, 0) for k in ledger if k != "total"} == {k: v for k, v in ledger.items()
                                                                             if k != "total"}, stage
            padding = groups * (world - 1)   # each group is padded by fewer than Nd elements
            assert counted["broadcast"] == buffers
            if stage == 0:
                assert counted["all_reduce"] == 2 * psi + statistics
            else:
                gathers = 2 if stage == 3 else 1
                assert psi <= counted["reduce_scatter"] <= psi + padding, stage
                assert gathers * psi <= counted["all_gather"] <= gathers * (psi + padding), stage
                assert counted["all_reduce"] == statistics, stage
