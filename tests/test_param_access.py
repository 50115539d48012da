"""Reading and writing parameters from outside the engine: exact answers or clear errors, never a
read past a freed storage (which crashed the process, or returned garbage) or a write that the
next step silently undoes.

- Inside the forward, any operation on another unit's parameter gathers it (here a penalty on the
  embedding, `weight.pow(2).sum()`, in the parent's forward), and a model whose output is a
  dataclass gets its units gathered for backward: both exact against torch.optim.AdamW.
- Outside the forward a parameter has no values at stage 3: reading one raises FreedParameterError
  naming it, metadata still works.
- A model belongs to one open engine; a stage-3 engine leaves it without values, even closed; a
  parameter frozen at initialize and made trainable later is refused at the step.
- `engine.load_state_dict` writes new values at every stage and precision; in bf16, values written
  into the parameters in place (`model.load_state_dict`) are adopted by the fp32 master the step
  reads (they used to be overwritten from it), and a write on one rank only is refused.
- Writes inside the forward: the same on every rank (a weight clamped in place) is exact at stages
  0-2; one that depends on each rank's batch (`nn.Embedding(max_norm=...)`) is refused on every
  rank, as is any at stage 3 (its gathered buffer is freed, the write with it); in fp32 too, where
  a write on one rank only used to leave the ranks training different models.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from torch import nn

from scenarios import ATOL, LR, cfg, local, lm_loss, state_error, token_batches
from zero_ref.launch import spawn

STEPS, BATCH, PENALTY = 4, 6, 1e-3


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    penalty: torch.Tensor


class Penalised(nn.Module):
    """Returns a dataclass; its forward reads the embedding's weight outside the embedding."""

    def __init__(self, dim: int = 16, vocab: int = 23):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> Output:
        return Output(self.head(self.body(self.embed(tokens))), self.embed.weight.pow(2).sum())


def _loss(out: Output, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(out.logits, tokens) + PENALTY * out.penalty


def _reference(batches, world: int) -> dict:
    model = Penalised()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for tokens in batches:
        (sum(_loss(model(part), part) for part in tokens.chunk(world)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ranks(rank: int, world: int) -> dict:
    import zero_ref
    from zero_ref.guard.sharded_param import FreedParameterError

    out = {}
    for stage in range(4):
        with zero_ref.initialize(Penalised(), cfg(stage)) as engine:
            for tokens in token_batches(STEPS, BATCH):
                part = local(tokens, rank, world)
                engine.backward(_loss(engine(part), part))
                engine.step()
            out["trained", stage] = engine.full_state_dict()
            weight = engine.module.head.weight
            reads = {}
            for name, read in {"sum": lambda: weight.sum(), "data": lambda: weight.data.copy_(weight.data),
                               "state_dict": lambda: engine.module.state_dict()["head.weight"].clone(),
                               "print": lambda: repr(weight)}.items():
                try:
                    read()
                    reads[name] = None
                except FreedParameterError as err:
                    reads[name] = str(err)
            out["reads", stage] = reads, tuple(weight.shape), tuple(torch.zeros_like(weight).shape)

        # a parameter frozen at initialize, made trainable after it: step refuses on every rank
        model = Penalised()
        model.head.bias.requires_grad_(False)
        with zero_ref.initialize(model, cfg(stage)) as engine:
            model.head.bias.requires_grad_(True)
            part = local(token_batches(1, BATCH)[0], rank, world)
            engine.backward(_loss(engine(part), part))
            try:
                engine.step()
                out["unfrozen", stage] = None
            except RuntimeError as err:
                out["unfrozen", stage] = str(err)

        model = Penalised()
        first = zero_ref.initialize(model, cfg(stage))
        errors = []
        for _ in range(2):
            try:
                zero_ref.initialize(model, cfg(stage)).close()
                errors.append(None)
            except ValueError as err:
                errors.append(str(err))
            first.close()
        out["again", stage] = errors
    return out


@pytest.mark.parametrize("world", [2])
def test_stage3_parameters_between_gathers_and_a_model_taken_twice(world):
    results = spawn(_ranks, world, timeout=300)
    expected = _reference(token_batches(STEPS, BATCH), world)
    for out in results:
        for stage in range(4):
            assert state_error(out["trained", stage], expected) <= ATOL, stage
            reads, shape, like = out["reads", stage]
            assert shape == like == (23, 16)
            if stage == 3:
                assert all(err and "full_state_dict" in err for err in reads.values()), reads
                assert "parameter head.weight is sharded" in reads["sum"]
                assert "parameter embed.weight is sharded" in reads["state_dict"]   # its first parameter
            else:
                assert reads == dict.fromkeys(reads), reads
            assert "frozen at initialize were made trainable after it ('head.bias'" in out["unfrozen", stage]
            open_engine, closed = out["again", stage]
            assert "already belongs to a zero-ref engine that is not closed" in open_engine
            if stage == 3:
                assert "has no values: a stage-3 engine sharded it" in closed
            else:
                assert closed is None


def _load(rank: int, world: int) -> dict:
    import zero_ref

    out = {}
    new = {k: torch.randn_like(v) for k, v in Penalised().state_dict().items()}
    for stage in range(4):
        with zero_ref.initialize(Penalised(), cfg(stage, dtype="bf16", lr=0.0, weight_decay=0.0)) as engine:
            part = local(token_batches(1, BATCH)[0], rank, world)
            engine.backward(_loss(engine(part), part))
            engine.step()
            engine.load_state_dict(new)
            loaded = engine.full_state_dict()
            engine.backward(_loss(engine(part), part))   # lr 0: a step changes nothing
            engine.step()
            errors = []
            for bad in ({**new, "extra": torch.zeros(1)}, {k: v for k, v in new.items() if k != "head.bias"},
                        {**new, "head.bias": torch.zeros(2)},
                        {k: v for k, v in new.items() if rank == 0 or k != "head.bias"},   # refused on rank 1 only
                        {**new, "head.bias": new["head.bias"] + rank}):                   # other values on rank 1
                try:
                    engine.load_state_dict(bad)
                except ValueError as err:
                    errors.append(str(err))
            out[stage] = loaded, engine.full_state_dict(), errors
        if stage == 3:
            continue
        # in place, as torch users do: the step adopts the rounded values on every rank alike...
        with zero_ref.initialize(Penalised(), cfg(stage, dtype="bf16", lr=0.0, weight_decay=0.0)) as engine:
            engine.module.load_state_dict(new)
            engine.backward(_loss(engine(part), part))
            engine.step()
            adopted = engine.full_state_dict()
            # ...and refuses a write made on one rank only, changing nothing anywhere
            if rank == 0:
                with torch.no_grad():
                    engine.module.head.bias.zero_()
            engine.backward(_loss(engine(part), part))
            try:
                engine.step()
                one_rank = None
            except ValueError as err:
                one_rank = str(err)
            out["in place", stage] = adopted, one_rank
    return out, new


def test_load_state_dict_writes_the_master_at_every_stage_in_bf16():
    """engine.load_state_dict at every stage in bf16; refused, changing nothing, for a bad state dict
    on every rank, on one rank only (every rank raises) or with other values on one rank."""
    for rank, (out, new) in enumerate(spawn(_load, 2, timeout=300)):
        rounded = {k: v.to(torch.bfloat16).float() for k, v in new.items()}
        for stage in range(3):
            adopted, one_rank = out.pop(("in place", stage))
            assert state_error(adopted, rounded) == 0.0, stage
            assert "written from outside the engine (in place" in one_rank and "on 1 of 2 ranks" in one_rank
        for stage, (loaded, stepped, errors) in out.items():
            assert state_error(loaded, new) == 0.0 and state_error(stepped, new) == 0.0, stage
            assert "unknown key 'extra'" in errors[0] and "missing 'head.bias'" in errors[1]
            assert "'head.bias' has shape (2,), the model's is (23,)" in errors[2] and len(errors) == 5
            assert "missing 'head.bias'" in errors[3] if rank == 1 else "refused on rank(s) 1" in errors[3]
            assert f"other values on rank(s) {1 - rank} than on rank {rank}" in errors[4]


def _load_awkward(rank: int, world: int) -> dict:
    import zero_ref
    from awkward import AwkwardNet

    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in AwkwardNet().state_dict().items()}
    new["head.weight"] = new["embed.weight"]                 # one tied parameter under two names
    out = {}
    for stage in range(4):
        with zero_ref.initialize(AwkwardNet(), cfg(stage, bucket_numel=37)) as engine:
            try:
                engine.load_state_dict({**new, "head.weight": new["embed.weight"] + 1})
            except ValueError as err:
                out["tied", stage] = str(err)
            engine.load_state_dict(new)
            out[stage] = engine.full_state_dict()
    return out, new


def test_load_state_dict_at_an_odd_world_size_with_tied_and_frozen_parameters():
    for out, new in spawn(_load_awkward, 3, timeout=300):
        for stage in range(4):
            assert state_error(out[stage], new) == 0.0, stage
            assert "'embed.weight' and 'head.weight' are one tied parameter but differ" in out["tied", stage]


class Clamped(nn.Module):
    """Clamps a weight in place in every forward: the same write on every rank."""

    def __init__(self, dim: int = 16, vocab: int = 23):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.body.weight.clamp_(-0.2, 0.2)
        return self.head(torch.tanh(self.body(self.embed(tokens))))


class Renormed(nn.Module):
    """nn.Embedding(max_norm=1) renormalises, in place, the rows each rank's batch looks up."""

    def __init__(self, dim: int = 16, vocab: int = 23):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim, max_norm=1.0)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def _writes_in_forward(rank: int, world: int) -> dict:
    import zero_ref

    out = {}
    batches = token_batches(3, 2 * world)
    for stage, make, dtype in itertools.product(range(4), (Clamped, Renormed), ("fp32", "bf16")):
        with zero_ref.initialize(make(), cfg(stage, dtype=dtype)) as engine:
            try:
                for tokens in batches:
                    part = local(tokens, rank, world)
                    engine.backward(lm_loss(engine(part), part))
                    engine.step()
                out[stage, make.__name__, dtype] = engine.full_state_dict()
            except ValueError as err:
                out[stage, make.__name__, dtype] = str(err)
    for stage in range(3):   # fp32, a write on one rank only: stage 0 trained on with the ranks apart
        with zero_ref.initialize(Penalised(), cfg(stage)) as engine:
            part = local(batches[0], rank, world)
            engine.backward(_loss(engine(part), part))
            if rank == 0:
                with torch.no_grad():
                    engine.module.head.bias.zero_()
            try:
                engine.step()
                out["one rank", stage] = None
            except ValueError as err:
                out["one rank", stage] = str(err)
    return out


def test_writes_inside_the_forward_are_adopted_when_every_rank_makes_them_alike_and_refused_otherwise():
    """Before: Renormed was silently wrong at every stage (up to 3.3 from torch's weights), and a write
    on one rank in fp32 went unseen."""
    batches = token_batches(3, 4)
    reference = Clamped()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    for tokens in batches:
        for part in tokens.chunk(2):   # one backward each: the next forward's clamp_ is an in-place write
            (lm_loss(reference(part), part) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, out in enumerate(spawn(_writes_in_forward, 2, timeout=300)):
        for stage in range(4):
            clamped, renormed = out[stage, "Clamped", "fp32"], out[stage, "Renormed", "fp32"]
            if stage == 3:
                for refused in (clamped, renormed, out[3, "Clamped", "bf16"], out[3, "Renormed", "bf16"]):
                    assert "stage 3: a parameter was written in place while its unit was gathered on 2 of 2 " \
                           "ranks" in refused, refused
                continue
            assert state_error(clamped, reference.state_dict()) < ATOL, stage
            assert isinstance(out[stage, "Clamped", "bf16"], dict), out[stage, "Clamped", "bf16"]
            for refused in (renormed, out[stage, "Renormed", "bf16"]):
                assert f"rank(s) {1 - rank} hold other values than rank {rank}" in refused, refused
            assert "written from outside the engine (in place: load_state_dict, nn.init, copy_) on 1 of 2 " \
                   "ranks" in out["one rank", stage], out["one rank", stage]


def test_the_value_digest_takes_any_dtype_and_tells_other_values_apart():
    """The digest ranks compare (load_state_dict's values, parameters written in place): bool and
    integer buffers included, a change of one element anywhere is another value, a sum in another
    order is not."""
    from zero_ref.guard.same_everywhere import ranks_with_other_values, value_digest

    torch.manual_seed(0)
    values = [torch.tensor([True, False, True]), torch.arange(5), torch.randn(7).bfloat16(), torch.zeros(0),
              torch.randn(1000) * 1e-3]
    mine = value_digest(values)
    reordered = [v.flip(0) if v.ndim else v for v in values]   # the same values summed in another order
    changed = [v.clone() for v in values]
    changed[4][500] += 1e-6
    flipped = [v.clone() for v in values]
    flipped[0][1] = True
    everyone = [mine, value_digest(reordered), value_digest(changed), value_digest(flipped), mine[:-1]]
    assert ranks_with_other_values(everyone, mine) == [2, 3, 4]


def test_the_value_digest_holds_nan_and_inf_the_same_on_every_rank():
    """NaN equals nothing, not even itself: the same NaN or inf on every rank is still the same
    value (it used to read as ranks disagreeing), while a NaN or inf in another place or a finite
    element beside one that differs is another value."""
    from zero_ref.guard.same_everywhere import ranks_with_other_values, value_digest

    nan, inf = float("nan"), float("inf")
    values = [torch.tensor([nan, 1.0, inf]), torch.tensor([-inf, 2.0]).bfloat16()]
    mine = value_digest(values)
    beside_nan = [torch.tensor([nan, 1.5, inf]), values[1]]
    no_nan = [torch.tensor([0.0, 1.0, inf]), values[1]]
    other_sign = [values[0], torch.tensor([inf, 2.0]).bfloat16()]
    everyone = [mine, value_digest([v.clone() for v in values]), value_digest(beside_nan), value_digest(no_nan),
                value_digest(other_sign)]
    assert ranks_with_other_values(everyone, mine) == [2, 3, 4]


def _same_nan(rank: int, world: int) -> dict:
    import zero_ref

    out = {}
    with zero_ref.initialize(Penalised(), cfg(1, nonfinite="skip")) as engine:
        given = engine.full_state_dict()
        given["head.bias"][0] = float("nan")   # the same on every rank
        engine.load_state_dict(given)
        out["loaded"] = engine.full_state_dict()["head.bias"][0].item()
        try:
            finite_on_rank_1 = given["head.bias"].nan_to_num() if rank else given["head.bias"]
            engine.load_state_dict({**given, "head.bias": finite_on_rank_1})
        except ValueError as err:
            out["one rank"] = str(err)
    with zero_ref.initialize(Penalised(), cfg(1, nonfinite="skip")) as engine:
        with torch.no_grad():
            engine.module.body[0].weight[1, 2] = float("inf")   # in place, the same on every rank
        part = local(token_batches(1, BATCH)[0], rank, world)
        engine.backward(_loss(engine(part), part))
        out["stepped"] = engine.step()   # adopted: no longer "other values"; its gradients skip the step
        out["adopted"] = engine.full_state_dict()["body.0.weight"][1, 2].item()
    return out


def test_the_same_nan_on_every_rank_is_loaded_and_adopted():
    """A NaN (or inf) that every rank writes alike is what the user asked for: load_state_dict
    loads it, as torch's would, and an in-place write of it is adopted; a NaN on one rank only is
    still refused on every rank."""
    for rank, out in enumerate(spawn(_same_nan, 2, timeout=300)):
        assert math.isnan(out["loaded"]) and out["adopted"] == math.inf and out["stepped"] is False, out
        assert f"other values on rank(s) {1 - rank} than on rank {rank}" in out["one rank"], out
