"""Stage 3: parameters read where their unit's own hooks do not see it, each exact against AdamW.

A stage-3 unit is gathered around its root's forward and again before its root's backward, and
freed once its gradients are in. Each model here reads a parameter outside that window, in a way
that crashed before (torch's "setStorage ... out of bounds for storage of size 0" in backward, or a
segmentation fault for elementwise kernels, on the ranks whose data took that path):

* after its root ran twice (so the unit was still gathered and the read was not seen as outside);
* through `param.detach()`, a view autograd does not track, inside the unit or in the parent before
  the unit ran, and as a gain read elementwise;
* through an output kept in an attribute rather than returned (its root's output hook never runs);
* in a tensor hook that fires during backward;
* on one rank only (the data decides), where the other rank had no reason to fail.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import zero_ref
from scenarios import ATOL, cfg, local, lm_loss, reference, state_error, token_batches, train
from zero_ref.launch import spawn

DIM, VOCAB = 16, 23


class Gain(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) * 0.2)
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(DIM))

    def forward(self, h):
        return torch.tanh(h @ self.weight) * self.gain


class ReusedThenRead(nn.Module):
    """A block run twice (on batches whose first token is even: rank-dependent at world 2), then its
    weight read by the parent through F.linear and its gain elementwise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Gain()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.block(self.embed(tokens))
        if int(tokens[0, 0]) % 2 == 0:
            h = self.block(h)
        h = h + 0.1 * F.linear(h, self.block.weight)
        return self.head(h * self.block.gain)


class Detached(nn.Module):
    """A stop-gradient read of a weight inside its own unit (matmul and elementwise), and one in the
    parent before the unit it belongs to has run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.a = Gain()
        self.b = Gain()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + torch.tanh(h @ self.b.weight.detach())          # b is not gathered yet
        h = self.a(h) + h * self.a.weight.detach()[0]            # elementwise, outside a's forward
        return self.head(self.b(h) + torch.tanh(h @ self.b.weight.detach()))


class KeepsOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.kept = None

    def forward(self, h):
        self.kept = torch.tanh(self.proj(h))   # the result the parent uses
        return h


class HiddenOutput(nn.Module):
    """A unit whose real output is kept in an attribute, and a tensor hook reading a parameter in
    backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.keeper = KeepsOutput()
        self.gate = nn.Linear(DIM, 1)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.keeper(self.embed(tokens))
        h = h + self.keeper.kept
        if torch.is_grad_enabled():
            h.register_hook(lambda grad: grad * (1.0 + 0.0 * self.gate.weight.detach().sum()))
        return self.head(h + self.gate(h))


MODELS = {"reused then read": ReusedThenRead, "detached": Detached, "hidden output": HiddenOutput}


def _ranks(rank: int, world: int) -> dict:
    batches = token_batches(4, 2 * world, VOCAB)
    errors = {}
    for name, make in MODELS.items():
        # units of one layer each, so that every read above crosses a unit boundary
        with zero_ref.initialize(make(), cfg(3, bucket_numel=2 * DIM)) as engine:
            assert len(engine.stage.groups) >= 3, name
            updated = train(engine, batches, rank, world)
            errors[name] = (updated, state_error(engine.full_state_dict(), reference(make, batches, world)))
    return errors, _twice(rank, world)


def test_parameters_read_outside_their_units_window_are_exact_at_stage_3():
    """And a loss backwarded twice (retain_graph): the second backward reads the detached view again."""
    batches = token_batches(4, 4, VOCAB)
    assert {int(local(t, r, 2)[0, 0]) % 2 for t in batches for r in range(2)} == {0, 1}   # both paths taken
    for rank, (errors, twice) in enumerate(spawn(_ranks, 2, timeout=300)):
        for name, (updated, error) in errors.items():
            assert updated == [True] * 4, (rank, name)
            assert error < ATOL, (rank, name, error)
        assert twice < ATOL, (rank, twice)


def _twice(rank: int, world: int) -> float:
    batches = token_batches(3, 2 * world, VOCAB)
    engine = zero_ref.initialize(Detached(), cfg(3, bucket_numel=2 * DIM))
    for tokens in batches:
        loss = lm_loss(engine(local(tokens, rank, world)), local(tokens, rank, world))
        engine.backward(loss, retain_graph=True)
        engine.backward(loss)
        engine.step()
    return state_error(engine.full_state_dict(), reference(Detached, batches, world, backwards_per_step=2))
