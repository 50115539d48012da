"""A deliberately awkward model and its unsharded reference training loop, shared by the tests.

AwkwardNet has a parameter count divisible by none of 2, 3 and 4, a tied weight (head = embed), a
frozen layer, a layer applied twice in one forward, a float buffer and a bias-free layer.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn import functional as F

VOCAB, DIM, HIDDEN, SEQ = 37, 13, 29, 6


class AwkwardNet(nn.Module):
    """`checkpointed=True` recomputes the MLP in backward (torch.utils.checkpoint, non-reentrant)."""

    def __init__(self, seed: int = 0, checkpointed: bool = False):
        super().__init__()
        self.checkpointed = checkpointed
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("gain", torch.linspace(0.9, 1.1, DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = self.frozen(x)
        x = x + self.shared(torch.tanh(self.shared(x)))
        if self.checkpointed:
            x = x + torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)
        else:
            x = x + self.mlp(x)
        return self.head(self.norm(x) * self.gain.to(x.dtype))   # the buffer keeps its own dtype


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def global_batches(steps: int, micro: int, batch: int, seed: int = 7) -> list[list[torch.Tensor]]:
    """steps x micro global micro-batches of `batch` sequences each (batch divisible by 1..4: 12)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(micro)] for _ in range(steps)]


def reference_train(batches, lr=1e-2, weight_decay=0.01, grad_clip=None, betas=(0.9, 0.999), eps=1e-8):
    """Single-process torch.optim.AdamW on the whole global batch: the ground truth."""
    model = AwkwardNet()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    losses = []
    for micro_batches in batches:
        total = 0.0
        for tokens in micro_batches:
            loss = loss_fn(model(tokens), tokens) / len(micro_batches)
            loss.backward()
            total += loss.item()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, losses


def zero_train(rank: int, world_size: int, jobs: list[tuple[dict, list]]) -> list[dict]:
    """Runs in each rank: for each (config kwargs, global batches) job, train AwkwardNet on this
    rank's slice of every global micro-batch; return per job the losses (global mean),
    full_state_dict, memory report and comm stats."""
    import torch.distributed as dist

    import zero_ref

    results = []
    for kwargs, batches in jobs:
        model_kwargs = kwargs.pop("model", {})
        engine = zero_ref.initialize(AwkwardNet(**model_kwargs), zero_ref.ZeroConfig(**kwargs))
        losses = []
        for micro_batches in batches:
            total = torch.zeros(())
            for tokens in micro_batches:
                local = tokens.chunk(world_size)[rank]
                loss = loss_fn(engine(local), local)
                engine.backward(loss)
                total += loss.detach().float() / len(micro_batches)
            memory_after_backward = engine.memory_report()
            engine.step()
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
            losses.append(total.item())
        results.append({"losses": losses, "state": engine.full_state_dict(),
                        "memory": engine.memory_report(), "memory_after_backward": memory_after_backward,
                        "param_storage_bytes": _param_storage_bytes(engine.module), "comm": engine.comm_stats(),
                        "skipped": engine.skipped_steps})
    return results


def _param_storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters (an independent census)."""
    storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def zero_fp16_overflow(rank: int, world_size: int, stages: list[int], batches) -> list[dict]:
    """fp16 training in which rank 1 (or 0 at world 1) poisons its loss with inf at step 2:
    that step must be skipped on every rank, the scale halved, and training must go on."""
    return [_fp16_overflow_run(rank, world_size, stage, batches) for stage in stages]


def _fp16_overflow_run(rank: int, world_size: int, stage: int, batches) -> dict:
    import zero_ref

    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=stage, dtype="fp16", lr=1e-2, initial_loss_scale=1024.0,
                                                                   bucket_numel=50, kernels="torch"))
    scales, updated, states = [], [], []
    for step, (tokens,) in enumerate(batches):
        local = tokens.chunk(world_size)[rank]
        loss = loss_fn(engine(local), local)
        if step == 2 and rank == min(1, world_size - 1):
            loss = loss * float("inf")
        engine.backward(loss)
        scales.append(engine.loss_scale)
        updated.append(engine.step())
        if step in (1, 2):
            states.append(engine.full_state_dict())
    return {"scales": scales + [engine.loss_scale], "updated": updated, "skipped": engine.skipped_steps,
            "global_step": engine.global_step, "states": states}


def zero_phases(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """Runs in each rank: for each job {config, batches, load?, save?, continue_batches?}: build an
    engine, optionally load a checkpoint, train on `batches`, optionally save and train on
    `continue_batches`; return losses and full_state_dicts along the way."""
    import zero_ref

    results = []
    for job in jobs:
        engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(**job["config"]))
        out = {}
        if job.get("load"):
            engine.load_checkpoint(job["load"])
            out["loaded_state"] = engine.full_state_dict()
            out["loaded_step"] = engine.global_step
        out["losses"] = _train_steps(engine, job.get("batches", []), rank, world_size)
        if job.get("save"):
            engine.save_checkpoint(job["save"])
            out["saved_state"] = engine.full_state_dict()
        out["more_losses"] = _train_steps(engine, job.get("continue_batches", []), rank, world_size)
        out["state"] = engine.full_state_dict()
        results.append(out)
    return results


def _train_steps(engine, batches, rank, world_size) -> list[float]:
    import torch.distributed as dist

    losses = []
    for (tokens,) in batches:
        local = tokens.chunk(world_size)[rank]
        loss = loss_fn(engine(local), local)
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    return losses
