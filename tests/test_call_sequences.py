"""Random call sequences through the public API against a mirrored single-process reference.

Every rank draws the same sequence of calls (a seeded RNG): forward and backward of a micro-batch,
step (at a boundary or not), zero_grad, a forward under no_grad, full_state_dict, save_checkpoint
(refused mid-step), load_checkpoint (mid-step too: it drops the step), load_state_dict, and
freezing or unfreezing a parameter after initialize. A torch.optim.AdamW on the unsplit model
mirrors each call by the contract in zero_ref/engine.py, and every value read on the way (outputs,
full_state_dict) and at the end must match it. Sequences like these found that a parameter frozen
after initialize broke checkpoints."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from scenarios import LR, DataDependentOrder, WithUnused, cfg, lm_loss
from zero_ref.launch import spawn

CALLS = ["micro"] * 9 + ["step"] * 6 + ["zero_grad", "no_grad", "full_state_dict", "save", "save", "load", "load",
                                        "load_state_dict", "freeze", "freeze"]
LETTERS = {"micro": "m", "Step": "S", "step": "s", "zero_grad": "z", "no_grad": "n", "full_state_dict": "r",
           "save": "w", "load": "L", "load_state_dict": "D", "freeze": "F"}
LENGTH, ATOL = 40, 2e-5


def _groups(model, kind: int):
    if kind != 1:
        return None
    named = dict(model.named_parameters())
    return [{"params": [p for p in named.values() if p.ndim >= 2]},
            {"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0, "lr": 2 * LR}]


def _error(state: dict, reference: dict) -> float:
    return max(((state[k].float() - reference[k].float()).abs().max().item() for k in reference), default=0.0)


def _sequence(rank: int, world: int, make, stage: int, seed: int, folder: str) -> tuple[str, float]:
    """Run one sequence; returns (what was called, one letter a call; the largest error seen)."""
    import zero_ref
    from zero_ref.io.manifest import CheckpointError

    # kind 0: plain; 1: two groups, clipping and a LambdaLR; 2: 17-element buckets (every tensor but the
    # 16-element biases reduced in pieces, padded at world 3), overlap off, no prefetch
    accum, kind = 1 + seed % 2, seed % 3
    rng, data = random.Random(seed), torch.Generator().manual_seed(seed)
    reference = make()
    optimizer = torch.optim.AdamW(_groups(reference, kind) or reference.parameters(), lr=LR, weight_decay=0.01)
    model = make()
    extra = {1: dict(grad_clip=0.5), 2: dict(bucket_numel=17, overlap=False, prefetch=0)}.get(kind, {})
    engine = zero_ref.initialize(model, cfg(stage, grad_accum_steps=accum, **extra), param_groups=_groups(model, kind))
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + 0.3 * s))
                 for o in (engine.optimizer, optimizer)] if kind == 1 else [None, None]
    micro, saved, log, worst = 0, None, [], 0.0
    current = lambda: {k: v.detach() for k, v in reference.state_dict().items()}
    for i in range(LENGTH):
        call = rng.choice(CALLS)
        tokens = torch.randint(0, 23, (2 * world, 6), generator=data)
        part = tokens.chunk(world)[rank]
        if call == "micro":
            engine.backward(lm_loss(engine(part), part))
            (sum(lm_loss(reference(p), p) for p in tokens.chunk(world)) / world / accum).backward()
            micro += 1
        elif call == "step":
            due = micro > 0 and micro % accum == 0
            assert engine.step() == due, (i, micro)
            if due:
                if kind == 1:
                    torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.grad is not None], 0.5)
                optimizer.step()
                optimizer.zero_grad()
                micro = 0
                for schedule in schedules:
                    if schedule is not None:
                        schedule.step()
            call = "Step" if due else call
        elif call == "zero_grad":
            engine.zero_grad()
            optimizer.zero_grad()
            micro %= accum   # the gradients go, their place in the step stays
        elif call == "no_grad":
            with torch.no_grad():
                worst = max(worst, (engine(part).float() - reference(part).float()).abs().max().item())
        elif call == "full_state_dict":
            worst = max(worst, _error(engine.full_state_dict(), current()))
        elif call == "save":
            try:
                engine.save_checkpoint(folder, lr_scheduler=schedules[0])
                saved = copy.deepcopy((reference.state_dict(), optimizer.state_dict(),
                                       schedules[1] and schedules[1].state_dict()))
                assert micro == 0, "saved mid-step"
            except CheckpointError:
                assert micro > 0, "refused between steps"
        elif call == "load" and saved is not None:
            engine.load_checkpoint(folder, lr_scheduler=schedules[0])   # mid-step too: the step is dropped
            # a copy each time: torch's load_state_dict keeps the given step and moment tensors, which
            # the next step updates in place, so a second load of the same dict would restore those
            reference.load_state_dict(saved[0])
            optimizer.load_state_dict(copy.deepcopy(saved[1]))
            if schedules[1] is not None:
                schedules[1].load_state_dict(copy.deepcopy(saved[2]))
            optimizer.zero_grad()
            micro = 0
        elif call == "load_state_dict" and micro == 0:
            noise = torch.Generator().manual_seed(i)
            new = {k: v + 0.01 * torch.randn(v.shape, generator=noise) for k, v in current().items()}
            engine.load_state_dict(new)
            reference.load_state_dict(new)
        elif call == "freeze":
            k = rng.randrange(len(list(reference.parameters())))
            name = list(dict(reference.named_parameters()))[k]
            if name.startswith("head"):   # every rank's loss keeps a gradient
                continue
            for each in (reference, model):
                param = dict(each.named_parameters())[name]
                param.requires_grad_(not param.requires_grad)
        else:
            continue
        log.append(LETTERS[call])
    worst = max(worst, _error(engine.full_state_dict(), current()))
    engine.close()
    return "".join(log), worst


def _all_sequences(rank: int, world: int, seeds: list[int], folder: str) -> dict:
    return {(name, stage, seed): _sequence(rank, world, make, stage, seed, f"{folder}/{name}-{stage}-{seed}")
            for seed in seeds for name, make in (("DataDependentOrder", DataDependentOrder), ("WithUnused", WithUnused))
            for stage in range(4)}


@pytest.mark.parametrize("world, seeds", [(3, [3, 4, 5]), (2, [26])])   # each variant, accumulating or not
def test_random_call_sequences_match_adamw(tmp_path, world, seeds):
    results = spawn(_all_sequences, world, seeds, str(tmp_path), timeout=600)
    calls = {letter for result in results for log, _ in result.values() for letter in log}
    assert {"S", "L", "r", "z", "F"} <= calls, calls   # they step, load, read, discard and freeze
    for rank, result in enumerate(results):
        for key, (log, worst) in result.items():
            assert worst < ATOL, (rank, key, log, worst)
