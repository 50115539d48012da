"""ZeRO-R beside model parallelism: MP=2 x DP=2 on 4 gloo ranks trains exactly like the unsplit
model in one process (torch.optim.AdamW on the global batch), at every stage, with plain, Pa and
Pa+cpu activation checkpoints; Pa keeps 1/Nm of the checkpoint bytes and moves one
batch x seq x hidden all-gather per block against Megatron's 12 (all-reduces counted as 2n)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zero_ref.launch import spawn

SHAPE = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "n_positions": 16}
STEPS, SAVE_AT, GLOBAL_BATCH, SEQ = 6, 3, 8, 12
# lr 1e-3: attention's key weights have directions of (near) zero gradient (softmax ignores a shift),
# where AdamW turns rounding noise into lr-sized steps; at 1e-2 that noise alone reaches 1e-5 in 10 steps
LR, CLIP = 1e-3, 0.5


def batches():
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, SHAPE["vocab_size"], (GLOBAL_BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def reference(steps: int = STEPS):
    """The unsplit model, one process, torch.optim.AdamW on the first `steps` global batches: losses
    and weights."""
    from zero_ref.models import ParallelGPT

    model = ParallelGPT(**SHAPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for tokens in batches()[:steps]:
        loss = model(tokens)
        loss.backward()
        if CLIP is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unwrap(name: str) -> str:
    return name.replace(".block.", ".")


def mp_engine(stage: int, mode, mesh):
    import zero_ref
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.models import ParallelGPT

    model = ParallelGPT(**SHAPE, group=mesh.get_group("mp"))
    if mode:
        mode, md, _ = mode.partition("+md")
        checkpoint_blocks(model.blocks, mode, mesh.get_group("mp"), contiguous=bool(md))
    cfg = zero_ref.ZeroConfig(stage=stage, lr=LR, weight_decay=0.01, grad_clip=CLIP, kernels="torch",
                              bucket_numel=1000)
    return zero_ref.initialize(model, cfg, mesh=mesh)


def run_steps(engine, dp, steps):
    """Train on `steps` of the global batches; the global mean loss of each step and the memory
    report taken after the first forward (checkpoints alive), with the MD arena's buffers made
    and misses so far when there is one."""
    from zero_ref.core.activations import model_checkpoints

    losses, reports = [], []
    for tokens in steps:
        loss = engine(tokens.chunk(2)[dist.get_rank(dp)])
        reports.append(engine.memory_report())
        engine.backward(loss)
        engine.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp)
        losses.append(global_loss.item() / 2)
    arenas = [c.arena for c in model_checkpoints(engine.module) if c.arena is not None]
    reports[0]["arena"] = [(a.allocations, a.misses) for a in arenas]
    return losses, reports[0]


def train_mp(rank: int, world: int, modes, stages, folder):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "mp"))
    dp = mesh.get_group("dp")
    ref_losses, expected = reference()   # full_state_dict is the unsplit model's under MP too
    out = {}
    for stage in stages:
        for mode in modes:
            with mp_engine(stage, mode, mesh) as engine:
                losses, report = run_steps(engine, dp, batches()[:SAVE_AT])
                if stage == 2 and mode == "pa":
                    engine.save_checkpoint(folder)
                losses += run_steps(engine, dp, batches()[SAVE_AT:])[0]
                state = {_unwrap(k): v for k, v in engine.full_state_dict().items()}
            loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
            weight_error = max((state[k] - expected[k]).abs().max().item() for k in expected)
            out[stage, mode] = loss_error, weight_error, report
    # resume: the MP=2 x DP=2 checkpoint taken after step SAVE_AT (stage 2, Pa) loaded into stage 3
    for stage in (2, 3):
        with mp_engine(stage, "pa", mesh) as engine:
            engine.load_checkpoint(folder)
            losses = run_steps(engine, dp, batches()[SAVE_AT:])[0]
            state = {_unwrap(k): v for k, v in engine.full_state_dict().items()}
        out["resumed", stage] = (max(abs(a - b) for a, b in zip(losses, ref_losses[SAVE_AT:])),
                                 max((state[k] - expected[k]).abs().max().item() for k in expected))
    return out


@pytest.mark.timeout(300)
def test_mp2_dp2_matches_unsplit_model_every_stage_and_checkpoint_mode(tmp_path):
    modes = (None, "plain", "pa", "pa_cpu", "plain+md", "pa+md", "pa_cpu+md")
    results = spawn(train_mp, 4, modes, (1, 2, 3), str(tmp_path), timeout=280)
    for rank_results in results:
        errors = {key: value[:2] for key, value in rank_results.items()}
        assert all(e < 1e-5 for pair in errors.values() for e in pair), errors
    # checkpoint bytes per rank: Pa keeps 1/Nm = 1/2 of plain; Pa+cpu keeps none on the device
    for rank_results in results:
        plain = rank_results[1, "plain"][2]
        pa = rank_results[1, "pa"][2]
        pa_cpu = rank_results[1, "pa_cpu"][2]
        local_batch, blocks = GLOBAL_BATCH // 2, SHAPE["n_layer"]
        assert plain["activation_checkpoints"] == blocks * local_batch * SEQ * SHAPE["n_embd"] * 4
        assert pa["activation_checkpoints"] * 2 == plain["activation_checkpoints"]
        assert pa_cpu["activation_checkpoints"] == 0
        assert pa_cpu["activation_checkpoints_host"] == pa["activation_checkpoints"]
        # MD: the same bytes, in one arena made on the first forward and reused by every step
        for stage in (1, 2, 3):
            for mode in ("plain", "pa", "pa_cpu"):
                md = rank_results[stage, mode + "+md"][2]
                assert md["arena"] == [(1, 0)], (stage, mode, md["arena"])
                assert (md["activation_checkpoints"], md["activation_checkpoints_host"]) == \
                    (rank_results[1, mode][2]["activation_checkpoints"], rank_results[1, mode][2]["activation_checkpoints_host"])


def meta_and_eager(rank: int, world: int):
    """Stage 3 on MP=2 x DP=2, the model built on the meta device (values given layer by layer by
    initialize) and built eagerly: losses and weights after 3 steps, and the weights at start."""
    from torch.distributed.device_mesh import init_device_mesh

    import zero_ref
    from zero_ref.models import ParallelGPT

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "mp"))
    out = {}
    for how in ("meta", "eager"):
        with torch.device("meta" if how == "meta" else "cpu"):
            model = ParallelGPT(**SHAPE, group=mesh.get_group("mp"))
        cfg = zero_ref.ZeroConfig(stage=3, lr=LR, kernels="torch", bucket_numel=1000)
        with zero_ref.initialize(model, cfg, mesh=mesh) as engine:
            start = engine.full_state_dict()
            losses = run_steps(engine, mesh.get_group("dp"), batches()[:3])[0]
            out[how] = start, losses, engine.full_state_dict()
    return out


@pytest.mark.timeout(120)
def test_model_parallel_model_built_on_meta_trains_like_the_eager_one():
    for result in spawn(meta_and_eager, 4, timeout=100):
        (meta_start, meta_losses, meta_end), (eager_start, eager_losses, eager_end) = result["meta"], result["eager"]
        assert all(torch.equal(meta_start[k], eager_start[k]) for k in eager_start)
        assert meta_losses == eager_losses
        assert all(torch.equal(meta_end[k], eager_end[k]) for k in eager_end)


def replaced_on_one_rank(rank: int, world: int):
    """Stages 1 and 3 on MP=2 x DP=2: one step, then global rank 3 alone (DP rank 1, MP rank 1)
    replaces a weight's .data; what the next step() raises on each rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "mp"))
    out = {}
    for stage in (1, 3):
        with mp_engine(stage, None, mesh) as engine:
            run_steps(engine, mesh.get_group("dp"), batches()[:1])
            if rank == 3:
                weight = engine.module.blocks[0].fc.weight
                weight.data = torch.zeros_like(weight)
            loss = engine(batches()[1].chunk(2)[dist.get_rank(mesh.get_group("dp"))])
            engine.backward(loss)
            try:
                engine.step()
                out[stage] = None
            except RuntimeError as err:
                out[stage] = str(err)
    return out


@pytest.mark.timeout(120)
def test_a_parameter_replaced_on_one_model_parallel_rank_stops_every_rank():
    """The count of replaced parameters is summed over the MP ranks too: the other MP rank's DP
    group, which found nothing, must not update alone."""
    for rank, result in enumerate(spawn(replaced_on_one_rank, 4, timeout=100)):
        for stage, error in result.items():
            assert error and "replaced after initialize" in error, (rank, stage)
            assert ("on this rank: 'blocks.0.fc.weight'" in error) == (rank == 3), (rank, stage, error)


def count_and_errors(rank: int, world: int):
    """Elements moved per block (the ZeRO-R study's count, at the dispatcher, MP = 2) and what
    initialize says about meshes it cannot use."""
    from experiments.zero_r_study import count_per_block

    return count_per_block(rank, world), mesh_errors()


def mesh_errors() -> list[str]:
    """What initialize says about a mesh it cannot use (world 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    import zero_ref
    from zero_ref.models import ParallelGPT

    errors = []
    for names, group in ((("a", "b"), None), (("dp", "mp"), dist.group.WORLD)):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=names)
        try:
            zero_ref.initialize(ParallelGPT(**SHAPE), zero_ref.ZeroConfig(), group, mesh=mesh)
        except ValueError as err:
            errors.append(str(err))
    return errors


@pytest.mark.timeout(120)
def test_pa_moves_one_twelfth_of_megatron_per_block():
    rows, errors = spawn(count_and_errors, 2, timeout=100)[0]
    assert {(r["early_stop"], r["mode"]) for r in rows} == {(e, m) for e in (False, True) for m in ("plain", "pa")}
    for r in rows:
        # Megatron (the paper's count): 2 all-reduces in forward, 2 again in recomputation, 2 in
        # backward, 2n each. torch's early stop ends the recomputation before the MLP's output
        # all-reduce, whose result nothing saved for backward needs: 5 all-reduces, 10n.
        assert r["all_reduce"] == (10 if r["early_stop"] else 12) * r["block_elements"], r
        assert r["all_gather"] == (r["block_elements"] if r["mode"] == "pa" else 0), r
        assert r["gathered_by_pa"] == r["all_gather"], r
    wrong_names, both = errors
    assert "dimensions named 'dp' and 'mp'" in wrong_names and "('a', 'b')" in wrong_names
    assert "not both" in both


def test_bad_layouts_are_refused_with_the_reason():
    from zero_ref.core.activations import checkpoint_blocks
    from zero_ref.models import ParallelGPT

    with pytest.raises(ValueError, match="mode = 'pa-cpu' is not allowed.*'pa_cpu'"):
        checkpoint_blocks(ParallelGPT(**SHAPE).blocks, "pa-cpu")
    model = ParallelGPT(**SHAPE)
    checkpoint_blocks(model.blocks, "plain")
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_blocks(model.blocks, "pa")


def test_paper_configs_are_table_3():
    import zero_ref

    table3 = {name: (p.stage, p.checkpoints) for name, p in zero_ref.PAPER_CONFIGS.items()}
    assert table3 == {"C1": (1, "plain"), "C2": (1, "pa"), "C3": (2, "plain"), "C4": (2, "pa"), "C5": (2, "pa_cpu")}
    config = zero_ref.PAPER_CONFIGS["C4"].zero_config(dtype="bf16", bucket_numel=1024)
    assert (config.stage, config.dtype, config.bucket_numel) == (2, "bf16", 1024)
