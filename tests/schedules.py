"""Training as users train: parameter groups (no weight decay for biases and norms, a group with its
own lr and betas) and a per-group warmup + cosine learning-rate schedule driven by torch's own
LambdaLR, for the engine (run inside spawned ranks) and for its single-process torch reference."""

from __future__ import annotations

import math

import torch
from torch import nn

from awkward import AwkwardNet, loss_fn

LR, STEPS, SAVE_AT = 1e-2, 12, 5


def groups_of(model: nn.Module) -> list[dict]:
    """Three groups: 2-D weights with decay 0.1; the MLP's 2-D weights with their own lr, betas and
    decay; every 1-D parameter (biases, norms) without weight decay."""
    mlp = {id(p) for p in model.mlp.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2 and id(p) not in mlp], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() >= 2 and id(p) in mlp], "weight_decay": 0.05,
             "lr": 5e-3, "betas": (0.8, 0.99)},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def scheduler_for(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A different schedule per group: warmup 3 + cosine over 12 steps, warmup 1 + cosine over 8, and
    a constant rate."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [warmup_cosine(3, STEPS), warmup_cosine(1, 8),
                                                         lambda step: 1.0])


def reference(batches) -> tuple[dict, list[float], list[float]]:
    """torch.optim.AdamW with the same groups and schedule, single process: state, losses, lrs."""
    model = AwkwardNet()
    optimizer = torch.optim.AdamW(groups_of(model), lr=LR)
    scheduler = scheduler_for(optimizer)
    losses, lrs = [], []
    for (tokens,) in batches:
        loss = loss_fn(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        lrs.append(optimizer.param_groups[1]["lr"])
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, losses, lrs


def engine_run(rank: int, world_size: int, stages: list[int], batches, folder: str) -> list[dict]:
    """Per stage: train SAVE_AT steps, save (with the scheduler), train to the end; then a new engine
    at the next stage loads that checkpoint and its scheduler and trains the same remaining steps."""
    import torch.distributed as dist

    import zero_ref

    def build(stage):
        model = AwkwardNet()
        engine = zero_ref.initialize(model, zero_ref.ZeroConfig(stage=stage, lr=LR, kernels="torch", bucket_numel=50),
                                     param_groups=groups_of(model))
        return engine, scheduler_for(engine.optimizer)

    def train(engine, scheduler, steps):
        losses, lrs = [], []
        for (tokens,) in steps:
            local = tokens.chunk(world_size)[rank]
            loss = loss_fn(engine(local), local)
            engine.backward(loss)
            engine.optimizer.step() if len(losses) % 2 else engine.step()   # both spellings
            scheduler.step()
            total = loss.detach().clone()
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
            losses.append(total.item())
            lrs.append(engine.optimizer.param_groups[1]["lr"])
        return losses, lrs

    results = []
    for stage in stages:
        engine, scheduler = build(stage)
        losses, lrs = train(engine, scheduler, batches[:SAVE_AT])
        engine.save_checkpoint(f"{folder}/stage{stage}", lr_scheduler=scheduler)
        more, more_lrs = train(engine, scheduler, batches[SAVE_AT:])
        state = engine.full_state_dict()
        engine.close()
        resumed, resumed_scheduler = build((stage + 1) % 4)
        resumed.load_checkpoint(f"{folder}/stage{stage}", lr_scheduler=resumed_scheduler)
        after, after_lrs = train(resumed, resumed_scheduler, batches[SAVE_AT:])
        results.append({"losses": losses + more, "lrs": lrs + more_lrs, "state": state,
                        "resumed_losses": after, "resumed_lrs": after_lrs, "resumed_state": resumed.full_state_dict()})
        resumed.close()
    return results


def disagreement_run(rank: int, world_size: int, batches, folder: str) -> dict:
    """Hyper-parameters that differ across ranks, or are invalid on one rank, raise on every rank
    before anything changes; once they agree again the step goes through. A checkpoint with other
    groups, or without a scheduler when one is to be restored, is refused on every rank."""
    import zero_ref

    model = AwkwardNet()
    engine = zero_ref.initialize(model, zero_ref.ZeroConfig(stage=2, lr=LR, kernels="torch", bucket_numel=50),
                                 param_groups=groups_of(model))
    tokens = batches[0][0].chunk(world_size)[rank]
    engine.backward(loss_fn(engine(tokens), tokens))
    before = engine.full_state_dict()
    errors = []
    for bad in ({1: 2e-3}, {0: float("nan")}):
        if rank in bad:
            engine.optimizer.param_groups[0]["lr"] = bad[rank]
        try:
            engine.step()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
        engine.optimizer.param_groups[0]["lr"] = LR
    unchanged = all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    stepped = engine.step()
    engine.save_checkpoint(f"{folder}/plain")
    refused = []
    other = AwkwardNet()
    regrouped = zero_ref.initialize(other, zero_ref.ZeroConfig(stage=1, lr=LR, kernels="torch"),
                                    param_groups=[{"params": [p for p in other.parameters() if p.requires_grad]}])
    for load in (lambda: regrouped.load_checkpoint(f"{folder}/plain"),
                 lambda: engine.load_checkpoint(f"{folder}/plain",
                                                lr_scheduler=scheduler_for(engine.optimizer))):
        try:
            load()
            refused.append(None)
        except zero_ref.io.checkpoint.CheckpointError as err:
            refused.append(str(err))
    return {"errors": errors, "unchanged": unchanged, "stepped": stepped, "refused": refused}
