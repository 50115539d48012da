"""Sharded construction: a model built on the meta device is given its values inside initialize(),
module by module, and at stage 3 each rank keeps only its shards. Measured at world 4: the peak
bytes during initialize stay near the rank's 16Ψ/Nd of model states (the full model, 4x that
budget, never exists on the rank), and the model trains exactly like the same model built eagerly
after the same seed, from reset_parameters(), an init_fn or a state dict."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zero_ref.launch import spawn

VOCAB, DIM, LAYERS = 96, 64, 6


class Net(nn.Module):
    """torch modules only: each initialises itself with reset_parameters() in its constructor."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                                                  nn.Linear(2 * DIM, DIM)) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return F.linear(self.norm(h), self.embed.weight)   # tied output layer


def batches(steps=3):
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (8, 10), generator=generator) for _ in range(steps)]


def train(engine, rank, world):
    losses = []
    for tokens in batches():
        part = tokens.chunk(world)[rank]
        loss = F.cross_entropy(engine(part)[:, :-1].float().reshape(-1, VOCAB), part[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def build(rank, world, stage, how, source=None):
    """(engine, peak bytes while building and initialising) for one way of building the model."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import zero_ref

    cfg = zero_ref.ZeroConfig(stage=stage, dtype="bf16", lr=1e-2, kernels="torch", bucket_numel=4096)
    tracker = MemTracker()
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")
        torch.manual_seed(rank if how == "meta-other-seeds" else 0)   # sharded construction starts from rank 0's RNG
        if how == "eager":
            engine = zero_ref.initialize(Net(), cfg)
        else:
            with torch.device("meta"):
                model = Net()
            kwargs = {"state_dict": source} if how == "meta-state-dict" else \
                {"init_fn": _init_fn} if how == "meta-init-fn" else {}
            engine = zero_ref.initialize(model, cfg, **kwargs)
    peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).get("Total", 0)
    return engine, peak


def _init_fn(module):
    for param in module.parameters(recurse=False):
        nn.init.normal_(param, std=0.05)


def construct(rank, world):
    out = {}
    torch.manual_seed(0)
    eager_state = Net().state_dict()   # a "checkpoint" to load piece by piece: the eager model's values
    psi = sum(v.numel() for v in eager_state.values())
    for stage in (2, 3):
        for how in ("eager", "meta", "meta-other-seeds", "meta-init-fn", "meta-state-dict"):
            engine, peak = build(rank, world, stage, how, eager_state)
            with engine:
                out[stage, how] = (*train(engine, rank, world), peak, engine.memory_report())
    out["psi"] = psi
    out["largest_module_bytes"] = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in Net().modules()) * 4
    # a module with meta tensors and no way to initialise it says so, on every rank
    import zero_ref

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))

    with torch.device("meta"):
        bare = Bare()
    try:
        zero_ref.initialize(bare, zero_ref.ZeroConfig(stage=3))
    except ValueError as err:
        out["bare"] = str(err)
    dist.barrier()
    return out


@pytest.mark.timeout(300)
def test_meta_model_initialises_sharded_and_trains_like_the_eager_one():
    results = spawn(construct, 4, timeout=280)
    for rank, out in enumerate(results):
        psi = out.pop("psi")
        largest = out.pop("largest_module_bytes")
        assert "no reset_parameters" in out.pop("bare")
        for stage in (2, 3):
            eager_losses, eager_state, eager_peak, _ = out[stage, "eager"]
            for how in ("meta", "meta-other-seeds"):   # reset_parameters(), the eager model's RNG stream
                losses, state, _, _ = out[stage, how]
                assert losses == eager_losses, (stage, how)
                assert all(torch.equal(state[k], eager_state[k]) for k in eager_state), (stage, how)
            losses, state, _, _ = out[stage, "meta-state-dict"]   # the fp32 state dict, piece by piece
            assert losses == eager_losses and all(torch.equal(state[k], eager_state[k]) for k in eager_state)
            init_fn_state = out[stage, "meta-init-fn"][1]
            assert all(torch.equal(init_fn_state[k], results[0][stage, "meta-init-fn"][1][k]) for k in init_fn_state)
        # stage 3 at world 4: the rank's model states are 16Ψ/4 (bf16). Built eagerly, the whole fp32
        # model (4Ψ, whatever Nd is) exists beside the first shards; from the meta device the peak is
        # the states plus one module's fp32 values and one unit's bf16 buffer
        states = 16 * psi / 4
        _, _, eager_peak, _ = out[3, "eager"]
        _, _, meta_peak, report = out[3, "meta"]
        assert eager_peak >= 4 * psi + 2 * psi / 4, (rank, eager_peak, psi)
        assert meta_peak <= states * 1.02 + largest + 4096 * 2, (rank, meta_peak / states, largest / states)
        assert sum(report[k] for k in ("params", "grads", "optimizer_states")) <= states * 1.02
        print(f"rank {rank}: peak at init / (16 psi / Nd): eager {eager_peak / states:.3f}, meta {meta_peak / states:.3f}")
