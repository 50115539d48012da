"""Sharded checkpoints: exact resume, resharding across world sizes and stages, crash safety,
consolidation (with a Hugging Face round trip), and clear errors for bad input."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from awkward import global_batches, zero_phases
from zero_ref.io.checkpoint import read_manifest, resolve
from zero_ref.launch import spawn

BATCH, LR = 12, 1e-2
HERE = Path(__file__).resolve().parent


def _cfg(stage, dtype="fp32", **kw):
    return dict(stage=stage, dtype=dtype, lr=LR, bucket_numel=200, kernels="torch", **kw)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_is_bit_exact_for_every_stage(tmp_path):
    batches = global_batches(10, 1, BATCH)
    jobs, resume = [], []
    for dtype in ("fp32", "bf16"):
        for stage in range(4):
            folder = str(tmp_path / f"{dtype}-{stage}")
            jobs += [dict(config=_cfg(stage, dtype), batches=batches),
                     dict(config=_cfg(stage, dtype), batches=batches[:5], save=folder)]
            resume.append(dict(config=_cfg(stage, dtype), load=folder, batches=batches[5:]))
    first = spawn(zero_phases, 2, jobs, timeout=300)
    second = spawn(zero_phases, 2, resume, timeout=300)   # new processes
    for i in range(8):
        straight, half, resumed = first[0][2 * i], first[0][2 * i + 1], second[0][i]
        assert resumed["loaded_step"] == 5
        assert _equal(resumed["loaded_state"], half["saved_state"])
        assert resumed["losses"] == straight["losses"][5:], i   # bit-equal
        assert _equal(resumed["state"], straight["state"]), i


def test_reshard_across_world_sizes_and_stages(tmp_path):
    batches = global_batches(8, 1, BATCH)
    w4s3, w2s1 = str(tmp_path / "w4s3"), str(tmp_path / "w2s1")
    first_half, second_half = batches[:5], batches[5:]
    (w2,) = [spawn(zero_phases, 2, [dict(config=_cfg(1), batches=first_half, save=w2s1,
                                          continue_batches=second_half)], timeout=300)[0]]
    w4 = spawn(zero_phases, 4, [dict(config=_cfg(3), batches=first_half, save=w4s3, continue_batches=second_half),
                                dict(config=_cfg(3), load=w2s1, batches=second_half)], timeout=300)[0]
    w2_from_w4 = spawn(zero_phases, 2, [dict(config=_cfg(1), load=w4s3, batches=second_half)], timeout=300)[0]
    w3_from_w4 = spawn(zero_phases, 3, [dict(config=_cfg(2), load=w4s3, batches=second_half)], timeout=300)[0]

    straight_w4, w4_from_w2 = w4
    for loaded, source in ((w2_from_w4[0], straight_w4), (w3_from_w4[0], straight_w4), (w4_from_w2, w2[0])):
        assert _equal(loaded["loaded_state"], source["saved_state"])
        assert loaded["losses"] == pytest.approx(source["more_losses"], abs=1e-5)
        for key in source["state"]:
            assert torch.allclose(loaded["state"][key], source["state"][key], atol=1e-5), key


def _gpt2_save(rank, world_size, folder):
    import zero_ref
    from zero_ref.models import lm_loss, tiny_gpt2, token_batches

    engine = zero_ref.initialize(tiny_gpt2(n_layer=1, n_embd=32, vocab_size=100),
                                 zero_ref.ZeroConfig(stage=3, lr=1e-2, bucket_numel=5000, kernels="torch"))
    batches = token_batches(100, 4, 16, rank, world_size)
    for _ in range(3):
        _, tokens = next(batches)
        engine.backward(lm_loss(engine(tokens).logits, tokens))
        engine.step()
    engine.save_checkpoint(folder)
    probe = torch.arange(16).remainder(100)[None]
    with torch.no_grad():
        logits = engine(probe).logits
    return engine.full_state_dict(), logits


def test_consolidate_and_hugging_face_round_trip(tmp_path):
    from zero_ref.cli import main

    (state, logits), _ = spawn(_gpt2_save, 2, str(tmp_path / "ckpt"), timeout=300)
    # the command's own code, here rather than in a new interpreter importing torch and transformers
    # again (`python -m zero_ref.cli` as a process: test_cluster_launch); its errors are SystemExit
    main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert _equal(written, state)   # the tied lm_head.weight included, equal to wte
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "out" / "hf")).eval()
    with torch.no_grad():
        reloaded = model(torch.arange(16).remainder(100)[None]).logits
    assert torch.allclose(reloaded, logits, atol=1e-5)


KILLED_SAVE = r"""
import sys, time, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
import zero_ref, zero_ref.io.checkpoint as ck
from zero_ref.launch import init_from_env
from awkward import AwkwardNet, global_batches, _train_steps
init_from_env("gloo")
engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=2, lr=1e-2, kernels="torch"))
_train_steps(engine, global_batches(2, 1, 12), 0, 1)
engine.save_checkpoint({root!r})
_train_steps(engine, global_batches(2, 1, 12, seed=3), 0, 1)
real_save = ck.save_file
def slow_save(tensors, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"partial")
        f.flush()
    print("WRITING", flush=True)
    time.sleep(120)
ck.save_file = slow_save
engine.save_checkpoint({root!r})
"""


def _load_one(rank, world_size, root):
    import zero_ref
    from awkward import AwkwardNet

    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=1, lr=1e-2, kernels="torch"))
    engine.load_checkpoint(root)
    return engine.global_step, engine.full_state_dict()


def test_save_killed_part_way_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    env.pop("MASTER_PORT", None)
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE.format(tests=str(HERE), root=str(root))],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "WRITING"
    first_tag = (root / "latest").read_text()
    child.kill()
    child.wait(timeout=30)
    partial = [p for p in root.rglob(".*.tmp")]
    assert partial, "the save was not killed part-way"
    assert (root / "latest").read_text() == first_tag
    (step, state), = spawn(_load_one, 1, str(root))
    assert step == 2
    manifest = read_manifest(resolve(root))
    assert manifest["global_step"] == 2 and manifest["stage"] == 2


def _save_refused_somewhere(rank, world_size, folder):
    """save_checkpoint where rank 1 is mid-step, then with another folder on rank 1, then as it should."""
    import zero_ref
    from awkward import AwkwardNet, loss_fn
    from zero_ref.io.checkpoint import CheckpointError

    (tokens,) = global_batches(1, 1, BATCH)[0]
    part = tokens.chunk(world_size)[rank]
    errors = []
    # stage 1, 2 micro-batches a step, buffers not broadcast: once the first backward has agreed on the
    # bucket order, a step's first micro-batch communicates nothing, so one rank may run it alone
    config = zero_ref.ZeroConfig(**_cfg(1, grad_accum_steps=2, broadcast_buffers=False, comm_timeout_s=30))
    with zero_ref.initialize(AwkwardNet(), config) as engine:
        for _ in range(2):
            engine.backward(loss_fn(engine(part), part))
        engine.step()
        if rank == 1:
            engine.backward(loss_fn(engine(part), part))
        for attempt, where in enumerate((folder, folder if rank == 0 else folder + "-other")):
            try:
                engine.save_checkpoint(where)
            except CheckpointError as err:
                errors.append(str(err))
            if attempt == 0:   # in step again: rank 0 runs the step's first micro-batch too, then both
                for _ in range(2 - rank):   # finish the step together (zero_grad would keep rank 1 ahead)
                    engine.backward(loss_fn(engine(part), part))
                engine.step()
        saved = engine.save_checkpoint(folder)
    return errors, str(saved), sorted(os.listdir(folder))


def test_a_save_refused_on_one_rank_is_refused_on_every_rank(tmp_path):
    """A rank mid-step, or a rank told another folder, used to leave the others waiting (or write a
    checkpoint in two halves): now every rank raises CheckpointError before anything is written."""
    folder = str(tmp_path / "ckpt")
    for rank, (errors, saved, listed) in enumerate(spawn(_save_refused_somewhere, 2, folder, timeout=120)):
        assert len(errors) == 2, errors
        assert ("between steps" if rank == 1 else "refused on rank(s) 1") in errors[0], errors[0]
        assert "on rank 1 but" in errors[1] and "every rank must name the same folder" in errors[1], errors[1]
        assert listed == sorted([Path(saved).name, "latest"]), listed    # only the good save wrote anything
    assert not (tmp_path / "ckpt-other").exists()


def _freeze_then_save_and_load(rank, world_size, folder):
    """At every stage: train, freeze one parameter after initialize (requires_grad_(False), as
    fine-tuning does mid-run), train on, save, train on, load, train the same batches again."""
    import zero_ref
    from scenarios import Layered, cfg, lm_loss, local, token_batches

    batches = token_batches(6, 6)
    out = []
    for stage in range(4):
        with zero_ref.initialize(Layered(layers=2), cfg(stage)) as engine:
            def train(some):
                for tokens in some:
                    part = local(tokens, rank, world_size)
                    engine.backward(lm_loss(engine(part), part))
                    engine.step()
            train(batches[:2])
            engine.module.layers[0].weight.requires_grad_(False)
            train(batches[2:4])
            engine.save_checkpoint(f"{folder}/stage{stage}")
            saved = engine.full_state_dict()
            train(batches[4:])
            engine.load_checkpoint(f"{folder}/stage{stage}")
            loaded = engine.full_state_dict()
            train(batches[4:])
            out.append((saved, loaded, engine.full_state_dict()))
    return out


def test_a_parameter_frozen_after_initialize_is_saved_loaded_and_left_alone(tmp_path):
    """The checkpoint describes the engine's parameters as initialize sharded them. It used to list
    the parameters that required grad when it was saved: with one frozen since, stages 0-2 failed
    writing the manifest (IndexError) and stage 3 wrote a checkpoint that no load accepted."""
    from scenarios import LR, Layered, lm_loss, token_batches

    model = Layered(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for i, tokens in enumerate(token_batches(6, 6)):
        if i == 2:
            model.layers[0].weight.requires_grad_(False)   # no gradient from here: AdamW skips it
        (sum(lm_loss(model(part), part) for part in tokens.chunk(2)) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    reference = model.state_dict()
    for stage, (saved, loaded, final) in enumerate(spawn(_freeze_then_save_and_load, 2, str(tmp_path), timeout=240)[0]):
        assert _equal(saved, loaded), stage
        assert max((final[k] - reference[k]).abs().max().item() for k in reference) < 1e-5, stage


def _load_after_a_failed_forward(rank, world_size, folder):
    """Rank 1's forward raises; every rank drops the batch and loads the last checkpoint; train on."""
    import zero_ref
    from scenarios import Layered, cfg, lm_loss, local, token_batches

    class RaisesOnRequest(Layered):
        fail = False

        def forward(self, tokens):
            if self.fail:
                raise RuntimeError("this batch cannot be run here")
            return super().forward(tokens)

    batches = token_batches(3, 6)
    out = []
    for stage in range(4):
        with zero_ref.initialize(RaisesOnRequest(layers=2), cfg(stage)) as engine:
            part = local(batches[0], rank, world_size)
            engine.backward(lm_loss(engine(part), part))
            engine.step()
            engine.save_checkpoint(f"{folder}/stage{stage}")
            engine.module.fail = rank == 1
            try:
                engine(local(batches[1], rank, world_size))   # no backward on any rank: the batch is dropped
            except RuntimeError:
                pass
            engine.module.fail = False
            engine.load_checkpoint(f"{folder}/stage{stage}")
            part = local(batches[2], rank, world_size)
            engine.backward(lm_loss(engine(part), part))
            out.append(engine.step())
    return out


def test_a_load_forgets_a_forward_that_raised_before_it(tmp_path):
    """A forward that raised with gradients enabled is recorded, so that the step can tell every rank
    that one rank may be a batch ahead (stages 0-2). load_checkpoint replaces the whole step, on every
    rank: the record used to outlive it and refuse the first step after a clean reload (ValueError
    on every rank)."""
    for rank, updated in enumerate(spawn(_load_after_a_failed_forward, 2, str(tmp_path), timeout=240)):
        assert updated == [True] * 4, (rank, updated)


# --- lr scheduler states and the loss scale across a save and a load ----------------------------
SCHEDULED_STEPS, SCHEDULER_SAVED_AT = 6, 3
PLATEAU_METRICS = [3.0, 2.0, 2.0, 2.0, 2.0, 2.0]   # patience 0: from the third step on, every step halves the lr


def _scheduler(kind: str, optimizer):
    """Schedulers whose state plain JSON does not keep: MultiStepLR's milestones are a Counter with int keys (alone
    and inside SequentialLR, whose milestone here falls after the save), ReduceLROnPlateau holds inf."""
    from torch.optim import lr_scheduler

    if kind == "sequential":
        return lr_scheduler.SequentialLR(optimizer, [lr_scheduler.LinearLR(optimizer, 0.5, total_iters=2),
                                                     lr_scheduler.MultiStepLR(optimizer, milestones=[3], gamma=0.5)],
                                         milestones=[2])
    if kind == "multistep":
        return lr_scheduler.MultiStepLR(optimizer, milestones=[1, 5], gamma=0.5)
    return lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)


def _resume_with_a_scheduler(rank, world_size, folder):
    """For each kind of `_scheduler`: train SCHEDULED_STEPS steps with it, saving it with the engine after
    SCHEDULER_SAVED_AT; then a new engine and scheduler load that checkpoint and train the same remaining steps.
    Returns {kind: (the lr after each step of both runs, both runs' final parameters, the scheduler's state as
    saved and as loaded)}."""
    import zero_ref
    from scenarios import Layered, cfg, token_batches, train

    batches = token_batches(SCHEDULED_STEPS, 6)

    def run(engine, scheduler, steps):
        lrs = []
        for n in steps:
            train(engine, batches[n:n + 1], rank, world_size)
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(PLATEAU_METRICS[n])
            else:
                scheduler.step()
            lrs.append(engine.optimizer.param_groups[0]["lr"])
        return lrs

    results = {}
    for kind in ("sequential", "multistep", "plateau"):
        with zero_ref.initialize(Layered(layers=2), cfg(2)) as engine:
            scheduler = _scheduler(kind, engine.optimizer)
            straight_lrs = run(engine, scheduler, range(SCHEDULER_SAVED_AT))
            engine.save_checkpoint(f"{folder}/{kind}", lr_scheduler=scheduler)
            saved = scheduler.state_dict()
            straight_lrs += run(engine, scheduler, range(SCHEDULER_SAVED_AT, SCHEDULED_STEPS))
            straight = engine.full_state_dict()
        with zero_ref.initialize(Layered(layers=2, seed=1), cfg(2)) as engine:
            scheduler = _scheduler(kind, engine.optimizer)
            engine.load_checkpoint(f"{folder}/{kind}", lr_scheduler=scheduler)
            loaded = scheduler.state_dict()
            resumed_lrs = run(engine, scheduler, range(SCHEDULER_SAVED_AT, SCHEDULED_STEPS))
            results[kind] = (straight_lrs, resumed_lrs, straight, engine.full_state_dict(), saved, loaded)
    return results


def test_a_resumed_lr_scheduler_goes_on_as_if_never_stopped(tmp_path):
    """The scheduler's state used to go through plain JSON: MultiStepLR's milestones (a Counter) came back with
    string keys, so inside SequentialLR the decay after the resume never fired (lr 0.01 for 0.005), alone the
    load was refused; ReduceLROnPlateau's inf could not be saved at all. Now it comes back exactly."""
    for results in spawn(_resume_with_a_scheduler, 2, str(tmp_path), timeout=120):
        for kind, (straight_lrs, resumed_lrs, straight, resumed, saved, loaded) in results.items():
            assert resumed_lrs == straight_lrs[SCHEDULER_SAVED_AT:], (kind, straight_lrs, resumed_lrs)
            assert len(set(straight_lrs[SCHEDULER_SAVED_AT:])) > 1, kind   # the lr changes after the save
            assert _equal(resumed, straight), kind
            assert repr(loaded) == repr(saved), kind   # the same values of the same types (a Counter, inf)


def test_scheduler_state_encoding_round_trips_exact_types():
    """Counters, dicts with int keys, tuples and non-finite floats come back as they were, nested too; a value no
    checkpoint can hold is refused naming where it is."""
    import json
    import math
    from collections import Counter

    from zero_ref.io.manifest import CheckpointError, from_json, to_json

    state = {"milestones": Counter({30: 1, 80: 2}), "by_step": {0: 1.5, 2: (1, 2.0)}, "betas": (0.9, 0.99),
             "best": float("inf"), "worst": -float("inf"), "nan": float("nan"), "plain": [1, "a", None, True, 0.1],
             "_schedulers": [{"milestones": Counter({2: 1}), "__zero_ref_type__": "float"}, {}]}
    back = from_json(json.loads(json.dumps(to_json(state, "state_dict()"), allow_nan=False)))
    assert math.isnan(back.pop("nan")) and math.isnan(state.pop("nan"))
    assert back == state and repr(back) == repr(state)   # repr: the types too (Counter, tuple, int keys)
    with pytest.raises(CheckpointError, match=r"state_dict\(\)\['_schedulers'\]\[1\]\['fn'\]"):
        to_json({"_schedulers": [{}, {"fn": len}]}, "state_dict()")


def _loss_scale_across_dtypes(rank, world_size, folder):
    """Save an fp32 and an fp16 checkpoint (the fp16 run's loss scale grown from 1024 to 4096), load each into new
    fp32, bf16 and fp16 engines, and train one step more. Returns {(saved dtype, loaded dtype): (the loss scale
    after the load, after the step)}."""
    import zero_ref
    from scenarios import Layered, cfg, token_batches, train

    batches = token_batches(3, 6)
    options = {"fp32": {}, "bf16": {}, "fp16": dict(initial_loss_scale=1024.0, loss_scale_growth_interval=1)}
    for dtype in ("fp32", "fp16"):
        with zero_ref.initialize(Layered(layers=2), cfg(1, dtype=dtype, **options[dtype])) as engine:
            train(engine, batches[:2], rank, world_size)
            engine.save_checkpoint(f"{folder}/{dtype}")
    scales = {}
    for saved in ("fp32", "fp16"):
        for dtype in ("fp32", "bf16", "fp16"):
            with zero_ref.initialize(Layered(layers=2), cfg(1, dtype=dtype, **options[dtype])) as engine:
                engine.load_checkpoint(f"{folder}/{saved}")
                after_load = engine.loss_scale
                train(engine, batches[2:], rank, world_size)
                scales[(saved, dtype)] = (after_load, engine.loss_scale)
    return scales


def test_the_loss_scale_is_restored_only_from_fp16_into_fp16(tmp_path):
    """The saved loss scale used to be restored whatever the dtypes: an fp32 checkpoint left an fp16 engine at scale
    1.0 (small gradients underflow), an fp16 one made an fp32 engine multiply its loss by 4096."""
    unscaled = {(saved, dtype): (1.0, 1.0) for saved in ("fp32", "fp16") for dtype in ("fp32", "bf16")}
    for scales in spawn(_loss_scale_across_dtypes, 2, str(tmp_path), timeout=120):
        # fp32 into fp16: the configured initial scale, growing as usual; fp16 into fp16: the saved scale
        assert scales == {**unscaled, ("fp32", "fp16"): (1024.0, 2048.0), ("fp16", "fp16"): (4096.0, 8192.0)}
