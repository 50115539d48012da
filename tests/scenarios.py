"""Models and call patterns real users produce, each with its single-process reference, shared by the
engine-hardening tests. Every scenario runs inside spawned gloo ranks through the public API only."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import zero_ref

LR = 1e-2
ATOL = 1e-5


def cfg(stage: int, **kw) -> zero_ref.ZeroConfig:
    return zero_ref.ZeroConfig(**{"stage": stage, "lr": LR, "kernels": "torch", "bucket_numel": 50, **kw})


def state_error(state: dict, reference: dict) -> float:
    assert state.keys() == reference.keys(), (sorted(state), sorted(reference))
    assert all(state[k].shape == reference[k].shape for k in reference)
    return max(((state[k].float() - reference[k].float()).abs().max().item() for k in reference
                if reference[k].numel()), default=0.0)


def local(tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return tokens.chunk(world)[rank]


# --- models --------------------------------------------------------------------------------------
class DataDependentOrder(nn.Module):
    """Two equal blocks whose call order depends on the data (so differs between ranks) and a third
    block that only some batches use (through a zero factor, so the reference is exact)."""

    def __init__(self, dim: int = 16, vocab: int = 23, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.a = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.b = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.c = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if int(tokens[:, 0].sum()) % 2:
            a = self.a(x)
            y = self.b(x) + a
        else:
            y = self.b(x)
            y = self.a(x) + y
        if int(tokens[0, 1]) % 3 == 0:
            y = y + 0.0 * self.c(y)
        return self.head(y)


class ExternalUse(nn.Module):
    """The output layer reuses the embedding's weight through F.linear in the parent's forward: a
    parameter used outside the module that owns it (as many language models do)."""

    def __init__(self, dim: int = 16, vocab: int = 23, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return F.linear(h, self.embed.weight)


class Layered(nn.Module):
    """`layers` equal residual layers registered in order, run in order or (reverse=True) backwards."""

    def __init__(self, layers: int = 8, dim: int = 16, vocab: int = 23, reverse: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.reverse = reverse
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in (reversed(self.layers) if self.reverse else self.layers):
            x = x + torch.tanh(layer(x))
        return self.head(x)


class WithUnused(nn.Module):
    """A layer no forward ever uses, and one used only by batches whose first token is even."""

    def __init__(self, dim: int = 16, vocab: int = 23, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.never = nn.Linear(dim, dim)
        self.sometimes = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if int(tokens[0, 0]) % 2 == 0:
            x = x + 0.0 * self.sometimes(x)
        return self.head(x)


class OddShapes(nn.Module):
    """Parameters of awkward shape: one with no elements, a 0-d scalar, and a non-contiguous one
    (the transpose of a 5 x 16 tensor, as `nn.Parameter(w.t())` leaves it)."""

    def __init__(self, dim: int = 16, vocab: int = 23, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.empty = nn.Parameter(torch.zeros(0))
        self.gain = nn.Parameter(torch.tensor(0.5))
        self.mix = nn.Parameter(torch.randn(5, dim).t())
        self.head = nn.Linear(5, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = (self.embed(tokens) * self.gain) @ self.mix + self.empty.sum()
        return self.head(torch.tanh(x))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def token_batches(steps: int, batch: int, vocab: int = 23, seq: int = 6, seed: int = 7) -> list[torch.Tensor]:
    """Seed 7 makes the data-dependent models diverge between ranks at world 2 and 3 (checked by a test)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


# --- reference and engine loops ------------------------------------------------------------------
def reference(make, batches, world: int, backwards_per_step: int = 1, weight_decay: float = 0.01,
              grad_clip=None) -> dict:
    """Single-process torch.optim.AdamW. Each global batch is split the way the ranks split it, and
    the loss of each rank's slice averaged, so models whose forward branches on the data see the
    same branches as the ranks do. `backwards_per_step` backwards of the same batch are summed."""
    model = make()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=weight_decay)
    for tokens in batches:
        for _ in range(backwards_per_step):
            loss = sum(lm_loss(model(part), part) for part in tokens.chunk(world)) / world
            loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], grad_clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def train(engine, batches, rank: int, world: int, backwards_per_step: int = 1) -> list[bool]:
    updated = []
    for tokens in batches:
        part = local(tokens, rank, world)
        for _ in range(backwards_per_step):
            engine.backward(lm_loss(engine(part), part))
        updated.append(engine.step())
    return updated
