"""Parameter groups and learning-rate schedules (zero_ref/param_groups.py): exact against torch's
AdamW with the same groups and torch's LambdaLR at every stage and world sizes 1-3, saved and
restored by checkpoints (into another stage), and refused clearly when they are wrong."""

import tempfile

import pytest
import torch
from torch import nn

import zero_ref
from awkward import AwkwardNet, global_batches
from schedules import LR, SAVE_AT, STEPS, disagreement_run, engine_run, groups_of, reference
from zero_ref.launch import spawn
from zero_ref.io.manifest import CheckpointError

TOL = 1e-5   # fp32 round-off of sharded sums over 12 steps, as in test_engine_exact


def _error(state, ref):
    return max((state[k] - ref[k]).abs().max().item() for k in ref)


@pytest.mark.parametrize("world_size", [3])   # an odd world size; world 2: test_convergence, exact vs DDP with groups
def test_groups_and_schedule_match_torch_and_resume_exactly(world_size, tmp_path):
    batches = global_batches(STEPS, 1, 12)
    ref_state, ref_losses, ref_lrs = reference(batches)
    assert len(set(ref_lrs)) > 5   # the schedule really changes the rate every step
    ranks = spawn(engine_run, world_size, [0, 1, 2, 3], batches, str(tmp_path), timeout=240)
    for stage, result in enumerate(ranks[0]):
        assert result["lrs"] == ref_lrs, stage                       # the scheduler saw the same steps
        assert result["losses"] == pytest.approx(ref_losses, abs=TOL), stage
        assert _error(result["state"], ref_state) < TOL, stage
        # resumed at step SAVE_AT in the next stage, with the scheduler: the same rates and numbers
        assert result["resumed_lrs"] == ref_lrs[SAVE_AT:], stage
        assert result["resumed_losses"] == pytest.approx(ref_losses[SAVE_AT:], abs=TOL), stage
        assert _error(result["resumed_state"], ref_state) < TOL, stage
        for other in ranks[1:]:
            assert all(torch.equal(other[stage]["state"][k], v) for k, v in result["state"].items())


@pytest.fixture(scope="module")
def world1():
    """One rank: the groups refused at initialize, the optimizer's refusals, and a plain run."""
    return spawn(_world1, 1, global_batches(STEPS, 1, 12), timeout=120)[0]


def test_without_groups_weight_decay_would_differ(world1):
    """The exactness check above can fail: the same run with one group (decay everywhere) ends elsewhere."""
    ref_state, _, _ = reference(global_batches(STEPS, 1, 12))
    assert _error(world1["plain_state"], ref_state) > 100 * TOL


def test_ranks_that_disagree_fail_together(tmp_path):
    batches = global_batches(1, 1, 12)
    results = spawn(disagreement_run, 2, batches, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        different, invalid = result["errors"]
        assert different and "different hyper-parameters" in different, rank
        assert invalid and ("param_groups[0]['lr']" in invalid if rank == 0 else "1 of 2 ranks" in invalid), rank
        assert result["unchanged"] and result["stepped"], rank
        regrouped, no_scheduler = result["refused"]
        assert regrouped and "parameter groups differ" in regrouped, rank
        assert no_scheduler and "holds none" in no_scheduler, rank


def _world1(rank, world_size, batches):
    from awkward import loss_fn

    model = AwkwardNet()
    trainable = [p for p in model.parameters() if p.requires_grad]
    cases = {
        "twice": [{"params": trainable}, {"params": trainable[:1]}],
        "missing": [{"params": trainable[1:]}],
        "unknown": [{"params": trainable, "momentum": 0.9}],
        "frozen": [{"params": trainable + [model.frozen.weight]}],
        "stranger": [{"params": trainable + [nn.Parameter(torch.zeros(2))]}],
        "bad_lr": [{"params": trainable, "lr": -1.0}],
        "bad_betas": [{"params": trainable, "betas": (0.9, 1.5)}],
        "dict": {"params": trainable},
    }
    messages = {}
    for name, spec in cases.items():
        try:
            zero_ref.initialize(model, zero_ref.ZeroConfig(), param_groups=spec)
            messages[name] = None
        except (ValueError, TypeError) as err:
            messages[name] = f"{type(err).__name__}: {err}"
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig())
    for name, call in (("state_dict", engine.optimizer.state_dict),
                       ("add_param_group", lambda: engine.optimizer.add_param_group({"params": []})),
                       ("closure", lambda: engine.optimizer.step(lambda: 0.0))):
        try:
            call()
            messages[name] = None
        except (RuntimeError, ValueError) as err:
            messages[name] = str(err)
    messages["is_optimizer"] = isinstance(engine.optimizer, torch.optim.Optimizer)
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=3, lr=1e-2, kernels="torch"))
    for (tokens,) in batches:
        engine.backward(loss_fn(engine(tokens), tokens))
        engine.step()
    messages["plain_state"] = engine.full_state_dict()
    with tempfile.TemporaryDirectory() as folder:   # a scheduler of another kind is refused on load
        engine.save_checkpoint(folder, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0))
        other = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=3, lr=1e-2, kernels="torch"))
        try:
            other.load_checkpoint(folder, lr_scheduler=torch.optim.lr_scheduler.StepLR(other.optimizer, 3))
            messages["other_scheduler"] = None
        except CheckpointError as err:
            messages["other_scheduler"] = str(err)
    return messages


def test_bad_groups_are_refused_with_the_reason(world1):
    m = world1
    assert "each parameter belongs to one group" in m["twice"]
    assert "in no param group" in m["missing"]
    assert "unknown keys ['momentum']" in m["unknown"]
    assert "frozen" in m["frozen"]
    assert "not a parameter of the model" in m["stranger"]
    assert "param_groups[0]['lr'] = -1.0" in m["bad_lr"]
    assert "param_groups[0]['betas']" in m["bad_betas"]
    assert m["dict"].startswith("TypeError") and "list of dicts" in m["dict"]
    assert "engine.save_checkpoint" in m["state_dict"]
    assert "fixed when it is built" in m["add_param_group"]
    assert "no closure" in m["closure"]
    assert m["is_optimizer"]
    assert groups_of(AwkwardNet())   # the groups used above are not empty
    assert "does not fit StepLR" in m["other_scheduler"] and "lr_lambdas" in m["other_scheduler"]


def _edited_by_hand(rank, world_size, batches):
    """Edits of engine.optimizer.param_groups that the update would ignore, each made before one
    step (every rank alike but the last) and undone after; then options at torch's defaults and the
    keys torch's schedulers add, which the step takes."""
    from awkward import loss_fn

    model = AwkwardNet()
    engine = zero_ref.initialize(model, zero_ref.ZeroConfig(stage=1, lr=LR, kernels="torch", bucket_numel=50),
                                 param_groups=groups_of(model))
    groups = engine.optimizer.param_groups

    def step(tokens) -> bool:
        part = tokens.chunk(world_size)[rank]
        engine.backward(loss_fn(engine(part), part))
        return engine.step()

    def refusal(edit) -> str:
        originals, saved = list(groups), [dict(g, params=list(g["params"])) for g in groups]
        edit(groups)
        try:
            return f"not refused: step() returned {step(batches[0][0])}"
        except ValueError as err:
            return str(err)
        finally:
            groups[:] = originals
            for group, kept in zip(originals, saved):
                group.clear()
                group.update(kept)
            engine.zero_grad()

    before = engine.full_state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    out = {"moved_name": names[id(groups[2]["params"][-1])], "lost_name": names[id(groups[1]["params"][-1])]}
    edits = {"moved": lambda g: g[0]["params"].append(g[2]["params"].pop()),
             "removed": lambda g: g[1]["params"].pop(),
             "added": lambda g: g.append({**g[2], "params": []}),
             "maximize": lambda g: g[0].update(maximize=True),
             "amsgrad": lambda g: g[1].update(amsgrad=True),
             "one rank": lambda g: g[0].update(maximize=True) if rank == 1 else None}
    out.update({name: refusal(edit) for name, edit in edits.items()})
    out["unchanged"] = engine.global_step == 0 and all(torch.equal(before[k], v)
                                                       for k, v in engine.full_state_dict().items())
    groups[0].update(amsgrad=False, maximize=False, foreach=True)   # torch's defaults, an implementation choice
    out["stepped"] = [step(batches[0][0])]
    schedulers = torch.optim.lr_scheduler
    for make in (lambda o: schedulers.OneCycleLR(o, max_lr=LR, total_steps=4, cycle_momentum=True),
                 lambda o: schedulers.CosineAnnealingLR(o, T_max=4),
                 lambda o: schedulers.SequentialLR(o, [schedulers.LinearLR(o, 0.5, total_iters=1),
                                                       schedulers.ExponentialLR(o, 0.9)], milestones=[1])):
        scheduler = make(engine.optimizer)
        for (tokens,) in batches[1:3]:
            out["stepped"].append(step(tokens))
            scheduler.step()
    out["keys"] = sorted(groups[0])
    return out


def test_edits_the_update_would_ignore_are_refused_on_every_rank():
    """Moving a parameter to another group by hand, removing one or adding a group, or setting an
    AdamW option zero-ref does not implement (maximize, amsgrad) was silently ignored: now the step
    raises on every rank, naming the group and the key, and changes nothing. Options at torch's
    defaults and the keys of torch's schedulers (OneCycleLR, which sets betas, CosineAnnealingLR,
    SequentialLR) still step."""
    for rank, out in enumerate(spawn(_edited_by_hand, 2, global_batches(3, 1, 12), timeout=180)):
        regroup = "pass param_groups to zero_ref.initialize for another grouping"
        assert f"param_groups[0]['params'] was changed after initialize (it now holds '{out['moved_name']}')" \
               in out["moved"] and regroup in out["moved"], out["moved"]
        assert f"param_groups[1]['params'] was changed after initialize (it no longer holds " \
               f"'{out['lost_name']}')" in out["removed"], out["removed"]
        assert "holds 4 groups, the engine was built with 3" in out["added"] and regroup in out["added"]
        assert "param_groups[0]['maximize'] = True is not supported" in out["maximize"], out["maximize"]
        assert "param_groups[1]['amsgrad'] = True is not supported" in out["amsgrad"], out["amsgrad"]
        assert ("['maximize'] = True is not supported" if rank == 1 else "1 of 2 ranks") in out["one rank"]
        assert out["unchanged"], rank
        assert out["stepped"] == [True] * 7, out["stepped"]
        assert {"initial_lr", "max_momentum", "amsgrad", "foreach"} <= set(out["keys"]), out["keys"]


def test_the_adamw_options_refused_are_all_that_change_torchs_update():
    """ADAMW_FIXED holds every torch.optim.AdamW option beyond lr, betas, eps and weight_decay, at
    torch's default, but those that choose how torch computes: a new one in torch shows here."""
    from zero_ref.param_groups import ADAMW_FIXED, HYPER_KEYS

    defaults = torch.optim.AdamW([nn.Parameter(torch.zeros(1))]).defaults
    how = ("foreach", "fused", "capturable", "differentiable")
    assert ADAMW_FIXED == {k: v for k, v in defaults.items() if k not in (*HYPER_KEYS, *how)}
