"""The call patterns and models that used to give silently wrong results or unclear crashes, at world
size 3 (odd: most flat groups padded; the data picks different module orders on different ranks, as
it does at world 2), every stage, through the public API only: each must now give single-process
torch.optim.AdamW's exact answer or a clear error on every rank.

1. step() twice with no backward in between; 2. two backwards before one step; 3. a forward whose
module order depends on the data (differs between ranks); 4. a parameter used outside the module
that owns it; 5. a checkpoint corrupted on one rank only; plus a bare loss.backward(), a model with
unused parameters, a parameter whose .data is replaced on one rank, buckets that follow the
order gradients arrive in, parameters of odd shape (no elements, 0-d, non-contiguous) and steps
with two forwards and a no_grad forward between a forward and its backward.
"""

import functools
from pathlib import Path

import pytest
import torch

from scenarios import (ATOL, LR, DataDependentOrder, ExternalUse, Layered, OddShapes, WithUnused, cfg, local,
                       lm_loss, reference, state_error, token_batches, train)
from zero_ref.launch import spawn

STEPS, BATCH = 3, 12   # three steps: every scenario steps again after the one its call pattern disturbs
STAGES = range(4)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hardening(rank: int, world: int, folder: str) -> dict:
    """Every scenario of this file on one rank; returns what the tests assert on."""
    import torch.distributed as dist

    import zero_ref
    from awkward import AwkwardNet, global_batches, loss_fn
    from zero_ref.io.checkpoint import CheckpointError

    batches = token_batches(STEPS, BATCH)
    out = {}
    for stage in STAGES:
        # 1 + 3: a second step() changes nothing; the data picks the module order on each rank
        with zero_ref.initialize(DataDependentOrder(), cfg(stage, bucket_numel=100)) as engine:
            second = []
            for tokens in batches:
                part = local(tokens, rank, world)
                engine.backward(lm_loss(engine(part), part))
                engine.step()
                before = engine.full_state_dict()
                second.append((engine.step(), _equal(before, engine.full_state_dict())))
            out["step_twice", stage] = second, engine.full_state_dict()

        # 2: two backwards before one step sum their gradients, as torch does
        with zero_ref.initialize(DataDependentOrder(), cfg(stage)) as engine:
            train(engine, batches, rank, world, backwards_per_step=2)
            out["two_backwards", stage] = engine.full_state_dict()

        # 4: F.linear(h, self.embed.weight) in the parent's forward
        with zero_ref.initialize(ExternalUse(), cfg(stage, bucket_numel=100)) as engine:
            train(engine, batches, rank, world)
            out["external", stage] = engine.full_state_dict()

        # unused parameters: one layer never used, one only by some batches on some ranks
        with zero_ref.initialize(WithUnused(), cfg(stage)) as engine:
            train(engine, batches, rank, world)
            out["unused", stage] = engine.full_state_dict()

        # a bare loss.backward() raises; the engine refuses to step until zero_grad()
        with zero_ref.initialize(Layered(layers=3), cfg(stage)) as engine:
            train(engine, batches[:2], rank, world)
            part = local(batches[2], rank, world)
            loss = lm_loss(engine(part), part)
            bare = refused = None
            try:
                loss.backward()
            except RuntimeError as err:
                bare = str(err)
            try:
                engine.step()
            except RuntimeError as err:
                refused = str(err)
            engine.zero_grad()
            train(engine, batches[2:], rank, world)
            out["bare", stage] = bare, refused, engine.full_state_dict()

        # a parameter's .data replaced on the last rank only (as Module.to(dtype) does): step refuses
        with zero_ref.initialize(Layered(layers=3), cfg(stage)) as engine:
            train(engine, batches[:2], rank, world)
            if rank == world - 1:
                engine.module.layers[1].weight.data = torch.zeros_like(engine.module.layers[1].weight)
            part = local(batches[2], rank, world)
            engine.backward(lm_loss(engine(part), part))
            before, error = engine.full_state_dict(), None
            try:
                engine.step()
            except RuntimeError as err:
                error = str(err)
            out["replaced", stage] = error, _equal(before, engine.full_state_dict())

        # 5: a checkpoint whose shard is corrupted on the last rank only
        with zero_ref.initialize(AwkwardNet(), cfg(stage)) as engine:
            micro = global_batches(3, 1, BATCH)
            for (tokens,) in micro[:2]:
                part = local(tokens, rank, world)
                engine.backward(loss_fn(engine(part), part))
                engine.step()
            saved = engine.save_checkpoint(Path(folder) / f"stage{stage}")
            dist.barrier()
            if rank == world - 1:
                shard = saved / f"rank{rank:05d}.safetensors"
                data = bytearray(shard.read_bytes())
                data[-8] ^= 0xFF
                shard.write_bytes(bytes(data))
            dist.barrier()
            part = local(micro[2][0], rank, world)
            engine.backward(loss_fn(engine(part), part))
            engine.step()
            before = engine.full_state_dict()
            try:
                engine.load_checkpoint(saved)
                error = None
            except CheckpointError as err:
                error = str(err)
            out["corrupt", stage] = error, _equal(before, engine.full_state_dict())

    # buckets follow the order gradients arrive in: a model run backwards holds as few buckets
    layer = 16 * 16 + 16
    for reverse in (False, True):
        for stage in (0, 1, 2):
            with zero_ref.initialize(Layered(reverse=reverse), cfg(stage, bucket_numel=layer)) as engine:
                train(engine, batches, rank, world)
                out["layered", reverse, stage] = engine.full_state_dict(), engine.memory_report()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario at world 3. (They also ran at world 2: the same scenarios and assertions again,
    none of them about an even world size; world 2 is trained in test_engine_exact, test_torch_habits,
    test_call_sequences and others.)"""
    world = 3
    return world, spawn(hardening, world, str(tmp_path_factory.mktemp(f"hardening{world}")), timeout=280)


@functools.cache
def _references(world: int) -> dict:
    batches = token_batches(STEPS, BATCH)
    return {name: reference(make, batches, world, **kw) for name, make, kw in (
        ("order", DataDependentOrder, {}), ("two_backwards", DataDependentOrder, {"backwards_per_step": 2}),
        ("external", ExternalUse, {}), ("unused", WithUnused, {}), ("layered3", lambda: Layered(layers=3), {}),
        ("layered", Layered, {}), ("reversed", lambda: Layered(reverse=True), {}))}


@pytest.mark.parametrize("world", [2, 3])
def test_the_data_chose_different_module_orders_on_different_ranks(world):
    """At world 2 too, as scenarios.token_batches promises: other modules train DataDependentOrder
    at world 2."""
    batches = token_batches(STEPS, BATCH)
    orders = [[int(local(t, r, world)[:, 0].sum()) % 2 for r in range(world)] for t in batches]
    uses_c = [[int(local(t, r, world)[0, 1]) % 3 == 0 for r in range(world)] for t in batches]
    assert any(len(set(step)) > 1 for step in orders)   # the module order really differs between ranks
    assert any(len(set(step)) > 1 for step in uses_c)   # so does whether a block is used at all
    assert any(not any(step) for step in uses_c)        # and some steps use it on no rank


def test_step_twice_is_a_no_op_and_data_dependent_order_is_exact(runs):
    world, ranks = runs
    ref = _references(world)["order"]
    for stage in STAGES:
        for rank_out in ranks:
            second, state = rank_out["step_twice", stage]
            assert second == [(False, True)] * STEPS, stage
            assert state_error(state, ref) < ATOL, stage


@pytest.mark.parametrize("scenario,ref_name", [("two_backwards", "two_backwards"), ("external", "external"),
                                               ("unused", "unused")])
def test_matches_adamw_on_every_rank(runs, scenario, ref_name):
    world, ranks = runs
    ref = _references(world)[ref_name]
    for stage in STAGES:
        for rank, rank_out in enumerate(ranks):
            assert state_error(rank_out[scenario, stage], ref) < ATOL, (scenario, stage, rank)


def test_bare_backward_raises_everywhere_and_zero_grad_recovers(runs):
    world, ranks = runs
    ref = _references(world)["layered3"]   # the discarded micro-batch never reached the optimizer
    for stage in STAGES:
        for rank_out in ranks:
            bare, refused, state = rank_out["bare", stage]
            assert bare is not None and "engine.backward(loss)" in bare, stage
            assert refused is not None and "zero_grad" in refused, stage
            assert state_error(state, ref) < ATOL, stage


def test_a_parameter_replaced_on_one_rank_stops_the_step_on_every_rank(runs):
    """The model would read the replacement while the optimizer updates the engine's storage:
    silently wrong from then on. Every rank refuses the step, updates nothing and says why."""
    world, ranks = runs
    for stage in STAGES:
        for rank, rank_out in enumerate(ranks):
            error, unchanged = rank_out["replaced", stage]
            assert error is not None and "replaced after initialize" in error, (stage, rank)
            assert unchanged, (stage, rank)
            if rank == world - 1:
                assert "on this rank: 'layers.1.weight' (now float32, storage of its own)" in error, stage
            else:
                assert "on another rank" in error, (stage, rank)


def test_checkpoint_corrupted_on_one_rank_changes_nothing_anywhere(runs):
    world, ranks = runs
    for stage in STAGES:
        for rank_out in ranks:
            error, unchanged = rank_out["corrupt", stage]
            assert error is not None and f"rank {world - 1}" in error and "nothing was changed" in error, (stage, error)
            assert unchanged, stage


def test_buckets_follow_gradient_arrival_order(runs):
    world, ranks = runs
    refs = _references(world)
    layer_bytes = 4 * (16 * 16 + 16 + world)   # one bucket, padded
    for rank_out in ranks:
        for stage in (0, 1, 2):
            forward, forward_memory = rank_out["layered", False, stage]
            backward, backward_memory = rank_out["layered", True, stage]
            assert state_error(forward, refs["layered"]) < ATOL
            assert state_error(backward, refs["reversed"]) < ATOL
        # stage 2's gradient buckets: the pool holds what was alive at once during backward
        assert backward_memory["comm_buffers"] <= forward_memory["comm_buffers"] + 2 * layer_bytes
        assert backward_memory["grads"] == forward_memory["grads"]


class _SlowBackward(torch.autograd.Function):
    """Identity forward; a backward that takes 20 ms, so a reduction started before it has finished."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(0.02)
        return grad


class _SlowChain(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = _SlowBackward.apply(torch.tanh(layer(x)))
        return x


def _stage3_buckets(rank, world_size):
    import zero_ref

    torch.manual_seed(0)
    model = _SlowChain()
    engine = zero_ref.initialize(model, zero_ref.ZeroConfig(stage=3, kernels="torch", bucket_numel=1000))
    for step in range(2):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x).square().mean())
        engine.step()
    return len(engine.stage.groups), len(engine.stage.buckets.pool.buffers)


def test_stage3_on_gloo_reuses_finished_buckets_during_backward():
    """Stage 3 on gloo never blocks on a reduction during backward (a peer may first need a gather
    from this rank), so it reuses a bucket only once its reduce-scatter is known to be done; gloo
    reports that only to a waiter, hence the background waits. With reductions long finished by
    the next unit's backward, a few buckets serve all eight units (each its own group): the
    constant-size buffers of the paper, not one bucket per unit."""
    for groups, buckets in spawn(_stage3_buckets, 2):
        assert groups >= 8 and buckets <= 3, (groups, buckets)


def _bucket_buffer_sizes(rank, world_size, stage):
    import zero_ref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 20), torch.nn.Linear(20, 20), torch.nn.Linear(20, 300))
    engine = zero_ref.initialize(model, zero_ref.ZeroConfig(stage=stage, kernels="torch", bucket_numel=1000))
    for step in range(2):
        tokens = torch.randint(0, 300, (4, 8), generator=torch.Generator().manual_seed(10 * step + rank))
        logits = engine(tokens)
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 300), tokens.reshape(-1)))
        engine.step()
    largest_group = max(group.padded_numel for group in engine.stage.groups)
    return largest_group, [buffer.numel() for buffer in engine.stage.buckets.pool.buffers]


@pytest.mark.parametrize("stage", [2, 3])
def test_groups_larger_than_a_bucket_are_reduced_in_bucket_size_pieces(stage):
    """The paper's CB: gradient buffers keep one constant size whatever the model. A 6,000-element
    embedding and a 6,300-element head (stage 2: groups of their own; stage 3: units) are reduced
    in pieces of at most one bucket of 1,000 elements (rounded up to a multiple of Nd = 3), so no
    buffer grows to a group's size. Exactness of the pieces: test_engine_exact (AwkwardNet's
    embedding and MLP exceed its 50-element buckets)."""
    for largest_group, sizes in spawn(_bucket_buffer_sizes, 3, stage):
        assert largest_group >= 6000 and sizes, (largest_group, sizes)
        assert max(sizes) <= 1002, sizes
        if stage == 2:       # may block: one buffer fills while the previous one reduces
            assert len(sizes) == 2, sizes


class _RaiseInBackward(torch.autograd.Function):
    """Identity forward; a backward that raises (an error part-way through backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


class _FailsMidBackward(Layered):
    """Layered run backwards (so the first backward's arrival order makes stages 0-2 repack their
    buckets), but with `fail` set its backward raises after the last four layers' gradients are in:
    some buckets reduced, some in flight, one partly filled, the arrival order half learned (with
    `fail="forward"` its forward raises half-way)."""

    def __init__(self):
        super().__init__(reverse=True)
        self.fail = False

    def forward(self, tokens):
        x = self.embed(tokens)
        for k, layer in enumerate(reversed(self.layers)):
            if k == 4 and self.fail == "forward":
                raise RuntimeError("injected failure in forward")
            if k == 4 and self.fail:
                x = _RaiseInBackward.apply(x)
            x = x + torch.tanh(layer(x))
        return self.head(x)


def _retried_after_failed_backward(rank, world_size, fail_at, accum):
    import zero_ref

    batches = token_batches(3, BATCH)
    out = {}
    for stage in STAGES:
        model = _FailsMidBackward()
        with zero_ref.initialize(model, cfg(stage, grad_accum_steps=accum)) as engine:
            for step, tokens in enumerate(batches):
                part = local(tokens, rank, world_size)
                if step in fail_at:
                    model.fail = True
                    try:
                        engine.backward(lm_loss(engine(part), part))
                    except RuntimeError as err:
                        assert "injected failure" in str(err), err
                    else:
                        raise AssertionError("the injected failure did not raise")
                    model.fail = False
                    engine.zero_grad()
                for _ in range(accum):
                    engine.backward(lm_loss(engine(part), part))
                engine.step()
            out[stage] = engine.full_state_dict(), _model_state_bytes(engine)
        with zero_ref.initialize(_FailsMidBackward(), cfg(stage, grad_accum_steps=accum)) as engine:   # never fails
            train(engine, batches, rank, world_size, backwards_per_step=accum)
            out["unfailed", stage] = _model_state_bytes(engine)
    return out


def _model_state_bytes(engine) -> dict:
    return {k: v for k, v in engine.memory_report().items() if k in ("params", "grads", "optimizer_states")}


@pytest.mark.parametrize("fail_at, accum", [((0,), 1), ((1, 2), 1), ((1,), 2)],
                         ids=["first backward", "later backwards", "first micro-batch of 2"])
def test_a_backward_that_raises_then_zero_grad_then_retry_is_exact(fail_at, accum):
    """A backward that raises on every rank part-way (buckets reduced, in flight and half filled;
    on the first backward, the arrival order half learned; with accumulation, before the step's
    last micro-batch, whose collectives every rank then issues in place of it), then
    engine.zero_grad() and the same micro-batch again: the same numbers as if the failure never
    happened, at every stage, and the same layout (a half-learned bucket order must not lay a
    parameter out twice)."""
    ref = reference(_FailsMidBackward, token_batches(3, BATCH), 3, backwards_per_step=accum)
    for rank_out in spawn(_retried_after_failed_backward, 3, fail_at, accum):
        for stage in STAGES:
            state, state_bytes = rank_out[stage]
            assert state_error(state, ref) < ATOL, stage
            assert state_bytes == rank_out["unfailed", stage], stage


def odd_calls(rank: int, world: int) -> dict:
    """OddShapes at every stage: trained plainly, and with two forwards per step (their losses
    averaged) and a no_grad forward between a forward and its backward."""
    import zero_ref

    batches = token_batches(STEPS, BATCH)
    out = {}
    for stage in STAGES:
        with zero_ref.initialize(OddShapes(), cfg(stage, bucket_numel=40)) as engine:
            train(engine, batches, rank, world)
            out["plain", stage] = engine.full_state_dict()
        with zero_ref.initialize(OddShapes(), cfg(stage, bucket_numel=40)) as engine:
            for tokens in batches:
                part = local(tokens, rank, world)
                first = engine(part)
                with torch.no_grad():
                    engine(part.flip(1))          # an evaluation in between: no gradients, no hooks left behind
                other = part.roll(1, dims=1)           # other tokens: another loss
                loss = (lm_loss(first, part) + lm_loss(engine(other), other)) / 2
                engine.backward(loss)
                engine.step()
            out["twice", stage] = engine.full_state_dict()
    return out


def test_odd_shapes_and_repeated_forwards_match_adamw():
    """A parameter with no elements, a 0-d one and a non-contiguous one, at world 3 (no shard size
    divides evenly); and a step with two forwards and a no_grad forward between forward and
    backward: every stage gives AdamW's answer on every rank."""
    world = 3
    batches = token_batches(STEPS, BATCH)
    plain = reference(OddShapes, batches, world)
    model = OddShapes()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for tokens in batches:
        pairs = [(p, p.roll(1, dims=1)) for p in tokens.chunk(world)]
        loss = sum(lm_loss(model(p), p) + lm_loss(model(q), q) for p, q in pairs) / (2 * world)
        loss.backward()
        opt.step()
        opt.zero_grad()
    twice = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    assert state_error(twice, plain) > 100 * ATOL      # the two checks below tell the patterns apart
    for rank, out in enumerate(spawn(odd_calls, world, timeout=300)):
        for stage in STAGES:
            assert out["plain", stage]["empty"].shape == (0,) and out["plain", stage]["gain"].shape == ()
            assert state_error(out["plain", stage], plain) < ATOL, (rank, stage)
            assert state_error(out["twice", stage], twice) < ATOL, (rank, stage)


ONE_RANK_FAILS = {   # name: (where its backward raises, grad_accum_steps, backwards per step, step, which backward)
    "at the loss, step 1": ("loss", 1, 1, 1, 0),
    "mid-backward, first backward": ("mid", 1, 1, 0, 0),
    "mid-backward, first micro-batch of 2": ("mid", 2, 2, 1, 0),
    "at the loss, last micro-batch of 2": ("loss", 2, 2, 1, 1),
    # two losses, each its own backward, one step: the others go on past the boundary the failing rank stopped at
    "at the loss, first of 2 backwards at grad_accum_steps=1": ("loss", 1, 2, 1, 0),
}


def _one_rank_fails(rank: int, world: int) -> dict:
    """Rank 1's backward raises, the others' do not: at the loss (before any reduction, as an OOM
    there would) or part-way (some buckets reduced, stage 3 half gathered), on the first backward
    or at either micro-batch of an accumulated step. Every rank's training loop catches what the
    engine raises, discards the step with zero_grad and goes on with the next batch."""
    import zero_ref

    batches = token_batches(4, BATCH)
    out = {}
    for name, (where, accum, backwards, fail_step, fail_micro) in ONE_RANK_FAILS.items():
        for stage in STAGES:
            model = _FailsMidBackward()
            with zero_ref.initialize(model, cfg(stage, grad_accum_steps=accum, comm_timeout_s=60)) as engine:
                errors = []
                for step, tokens in enumerate(batches):
                    part = local(tokens, rank, world)
                    try:
                        for micro in range(backwards):
                            fails = rank == 1 and (step, micro) == (fail_step, fail_micro)
                            model.fail = fails and where == "mid"
                            logits = engine(part)
                            if fails and where == "loss":
                                logits.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory")))
                            engine.backward(lm_loss(logits, part))
                        engine.step()
                    except ValueError as err:
                        errors.append((step, type(err.__cause__).__name__, str(err)))
                        engine.zero_grad()
                out[name, stage] = errors, engine.full_state_dict()
    return out


def test_a_backward_that_raises_on_one_rank_only_raises_on_every_rank_and_the_next_steps_are_exact():
    """The failing rank issues the collectives the others issue until the step's statistics (the
    rest of the backward's, the step's other micro-batches'), so the ranks' collectives keep pairing
    up: every rank raises ValueError at that step (the failing one from engine.backward, chained to
    its error; the others from step), nothing is updated, and after zero_grad on every rank the
    training goes on exactly as AdamW over the other batches. Before, the failing rank's collectives
    paired with the wrong ones: gloo aborted on the size mismatch, or a skipped batch paired with
    the others' next one silently. With two backwards per step, where the others go on past the
    boundary at which the failing rank sent the statistics, they send them too before their next
    micro-batch's first collective (the statistics used to meet a gradient bucket: SIGABRT)."""
    batches = token_batches(4, BATCH)
    for rank, result in enumerate(spawn(_one_rank_fails, 3, timeout=600)):
        for name, (_, _, backwards, fail_step, _) in ONE_RANK_FAILS.items():
            kept = [tokens for step, tokens in enumerate(batches) if step != fail_step]
            ref = reference(_FailsMidBackward, kept, 3, backwards_per_step=backwards)
            for stage in STAGES:
                errors, state = result[name, stage]
                assert [(step, cause) for step, cause, _ in errors] == \
                    [(fail_step, "RuntimeError" if rank == 1 else "NoneType")], (rank, name, stage, errors)
                assert "a backward raised on some ranks and not on the others" in errors[0][2]
                assert state_error(state, ref) < ATOL, (rank, name, stage)


def _one_rank_skips_after_its_forward_raised(rank: int, world: int) -> dict:
    """Rank 1's forward raises at the second batch; every rank's loop skips a batch whose forward
    raised and stops at an error from step."""
    import zero_ref

    batches = token_batches(3, BATCH)
    out = {}
    for stage in STAGES:
        model = _FailsMidBackward()
        with zero_ref.initialize(model, cfg(stage)) as engine:
            errors, first = [], None
            for step, tokens in enumerate(batches):
                part = local(tokens, rank, world)
                model.fail = "forward" if (rank, step) == (1, 1) else False
                try:
                    engine.backward(lm_loss(engine(part), part))
                    engine.step()
                except RuntimeError as err:
                    errors.append(("forward", step, str(err)))
                    engine.zero_grad()
                    continue
                except ValueError as err:
                    errors.append(("step", step, str(err)))
                    break
                first = first or engine.full_state_dict()
            out[stage] = errors, _equal(first, engine.full_state_dict()), engine.full_state_dict()
    return out


def test_a_forward_that_raises_on_one_rank_only_never_pairs_a_batch_with_another():
    """Stages 0-2 run no collective in forward: the other ranks train on, and rank 1, skipping its
    batch, would pair its next one with their current one silently. The forward's failure rides in
    the step's statistics, so every rank raises at that step and nothing is updated. Stage 3 gathers
    in forward: the schedule's last round tells every rank that rank 1's forward raised, every
    rank's forward raises with it, and skipping the batch everywhere trains exactly as AdamW
    without it."""
    batches = token_batches(3, BATCH)
    ref = reference(_FailsMidBackward, [batches[0], batches[2]], 3)
    for rank, result in enumerate(spawn(_one_rank_skips_after_its_forward_raised, 3)):
        for stage, (errors, unchanged, state) in result.items():
            where = [(kind, step) for kind, step, _ in errors]
            if stage == 3:
                assert where == [("forward", 1)], (rank, errors)
                assert ("injected failure" if rank == 1 else "the forward raised on rank(s) 1") in errors[0][2]
                assert state_error(state, ref) < ATOL, rank
                continue
            assert where == ([("forward", 1), ("step", 2)] if rank == 1 else [("step", 1)]), (rank, stage, errors)
            assert "or a forward did" in errors[-1][2], (rank, stage, errors)
            assert unchanged, (rank, stage)


def _stage3_without_overlap(rank: int, world: int) -> dict:
    import zero_ref

    batches = token_batches(STEPS, BATCH)
    out = {}
    for make in (WithUnused, DataDependentOrder, ExternalUse):
        with zero_ref.initialize(make(), cfg(3, overlap=False, comm_timeout_s=60)) as engine:
            train(engine, batches, rank, world)
            out[make.__name__] = engine.full_state_dict()
    return out


def test_stage3_without_overlap_survives_data_that_leaves_a_unit_out_on_some_ranks():
    """overlap=False made stage 3's reduce-scatters wait without bound inside the launch: a rank
    whose data used a unit the others' did not waited there for them, while they waited for it in
    the backward's last gather round (a deadlock until comm_timeout_s, worlds 2-4). Reductions now
    always start asynchronously on gloo at stage 3 and are waited for, bounded, right after."""
    batches = token_batches(STEPS, BATCH)
    refs = {make.__name__: reference(make, batches, 3) for make in (WithUnused, DataDependentOrder, ExternalUse)}
    for rank, out in enumerate(spawn(_stage3_without_overlap, 3, timeout=240)):
        for name, state in out.items():
            assert state_error(state, refs[name]) < ATOL, (rank, name)


def _gan_parts():
    torch.manual_seed(1)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    torch.manual_seed(2)
    discriminator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return generator, discriminator


def _gan_batch(i: int, world: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(2 * world, 8, generator=g), torch.randn(2 * world, 4, generator=g)


def _gan_losses(generator, discriminator, real, noise):
    """The discriminator's loss (on a detached fake) and the generator's (through the discriminator)."""
    softplus = torch.nn.functional.softplus
    d_loss = lambda: softplus(-discriminator(real)).mean() + softplus(discriminator(generator(noise).detach())).mean()
    g_loss = lambda: softplus(-discriminator(generator(noise))).mean()
    return d_loss, g_loss


def _gan(rank: int, world: int) -> dict:
    """Two engines over the same ranks, as a GAN trains: the discriminator's step, then the
    generator's, whose loss runs through the discriminator with its parameters frozen."""
    import zero_ref

    out = {}
    for stage in STAGES:
        generator, discriminator = _gan_parts()
        config = cfg(stage)
        with zero_ref.initialize(generator, config) as g_engine, zero_ref.initialize(discriminator, config) as d_engine:
            try:
                for i in range(3):
                    real, noise = (t.chunk(world)[rank] for t in _gan_batch(i, world))
                    d_loss, g_loss = _gan_losses(g_engine, d_engine, real, noise)
                    d_engine.backward(d_loss())
                    d_engine.step()
                    discriminator.requires_grad_(False)
                    g_engine.backward(g_loss())
                    g_engine.step()
                    discriminator.requires_grad_(True)
                out[stage] = {**{f"g.{k}": v for k, v in g_engine.full_state_dict().items()},
                              **{f"d.{k}": v for k, v in d_engine.full_state_dict().items()}}
            except RuntimeError as err:
                out[stage] = str(err)
    return out


def test_two_engines_train_a_gan_or_say_why_not():
    """Stages 0-2: exact against two AdamWs. Stage 3 gathers the discriminator's parameters for any
    backward through it, which only its own engine.backward may run: a RuntimeError that names
    the case and the ways out, not a bare-backward message that blames loss.backward()."""
    world = 2
    generator, discriminator = _gan_parts()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01) for m in (generator, discriminator)]
    for i in range(3):
        real, noise = _gan_batch(i, world)
        parts = list(zip(real.chunk(world), noise.chunk(world)))
        losses = [_gan_losses(generator, discriminator, r, z) for r, z in parts]
        (sum(d() for d, _ in losses) / world).backward()
        optimizers[1].step()
        optimizers[1].zero_grad()
        discriminator.requires_grad_(False)
        (sum(g() for _, g in losses) / world).backward()
        optimizers[0].step()
        optimizers[0].zero_grad()
        discriminator.requires_grad_(True)
    reference = {**{f"g.{k}": v for k, v in generator.state_dict().items()},
                 **{f"d.{k}": v for k, v in discriminator.state_dict().items()}}
    for rank, result in enumerate(spawn(_gan, world, timeout=240)):
        for stage in range(3):
            assert not isinstance(result[stage], str), (rank, stage, result[stage])
            assert state_error(result[stage], reference) < ATOL, (rank, stage)
        assert isinstance(result[3], str) and "another engine" in result[3] and "GAN" in result[3], result[3]


def _others_do_not_step(rank: int, world: int) -> dict:
    """Rank 1's backward raises at the second batch; the others' succeeds, and at that boundary
    they call zero_grad or full_state_dict instead of step. Every loop drops the batch and goes on."""
    import zero_ref

    batches = token_batches(4, BATCH)
    out = {}
    for call in ("zero_grad", "full_state_dict"):
        for stage in STAGES:
            model = _FailsMidBackward()
            with zero_ref.initialize(model, cfg(stage, comm_timeout_s=60)) as engine:
                raised = []
                for step, tokens in enumerate(batches):
                    part = local(tokens, rank, world)
                    logits = engine(part)
                    if step == 1 and rank == 1:
                        logits.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory")))
                    try:
                        engine.backward(lm_loss(logits, part))
                        if step == 1:
                            getattr(engine, call)()
                            engine.zero_grad()
                            continue
                        engine.step()
                    except ValueError:
                        raised.append(step)
                        engine.zero_grad()
                out[call, stage] = raised, engine.full_state_dict()
    return out


def test_ranks_that_reach_the_boundary_and_do_not_step_still_learn_of_a_failure():
    """The failing rank sends the step's statistics at the boundary; the others send them too before
    their next collective, whatever it is: full_state_dict raises ValueError as a step would, and
    zero_grad (which drops the step anyway) just goes on. Before, the others' gathers or next
    reductions waited for the failing rank until comm_timeout_s, or paired with its next ones."""
    batches = token_batches(4, BATCH)
    ref = reference(_FailsMidBackward, [t for step, t in enumerate(batches) if step != 1], 3)
    for rank, result in enumerate(spawn(_others_do_not_step, 3, timeout=600)):
        for (call, stage), (raised, state) in result.items():
            expected = [1] if rank == 1 or call == "full_state_dict" else []
            assert raised == expected, (rank, call, stage, raised)
            assert state_error(state, ref) < ATOL, (rank, call, stage)
