"""The tiny GPT-2 (tied lm_head) trains under every stage, and all stages give the same losses."""

import pytest

from zero_ref.launch import spawn
from zero_ref.models import lm_loss, tiny_gpt2, token_batches


def _train_gpt2(rank, world_size, stages, steps, dtype):
    import zero_ref

    results = {}
    for stage in stages:
        model = tiny_gpt2(seed=0)
        psi = sum(p.numel() for p in model.parameters())
        engine = zero_ref.initialize(model, zero_ref.ZeroConfig(stage=stage, dtype=dtype, lr=3e-3,
                                                                bucket_numel=40_000, kernels="torch"))
        losses = []
        for _, (_, tokens) in zip(range(steps), token_batches(1000, 8, 32, rank, world_size)):
            loss = lm_loss(engine(tokens).logits, tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results[stage] = {"losses": losses, "psi": psi, "comm": engine.comm_stats()["last_step"]}
    return results


def test_tiny_gpt2_all_stages_same_losses():
    ranks = spawn(_train_gpt2, 2, [0, 1, 2, 3], 6, "fp32", timeout=300)
    base = ranks[0][0]["losses"]
    assert base[-1] < base[0]
    for stage in range(4):
        for rank in range(2):
            assert ranks[rank][stage]["losses"] == pytest.approx(ranks[rank][0]["losses"], abs=1e-5), stage
        moved = ranks[0][stage]["comm"]
        psi = ranks[0][stage]["psi"]
        volume = moved["all_reduce"] + moved["reduce_scatter"] + moved["all_gather"]
        expected = (3 if stage == 3 else 2) * psi
        assert expected <= volume <= expected * 1.001, (stage, moved)
