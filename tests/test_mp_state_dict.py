"""One state dict for data x model parallelism: on MP=2 x DP=2 (4 gloo ranks), after a few steps
at stages 2 and 3, full_state_dict() is the unsplit model's (it loads strictly into ParallelGPT
built without a group, whose logits then match the model trained in one process), load_state_dict
takes it back (or each MP rank's slices), and `zero-ref consolidate` of the MP checkpoint writes
the same tensors with no process group."""

from __future__ import annotations

import pytest
import torch

from test_model_parallel import SHAPE, batches, mp_engine, reference, run_steps
from zero_ref.launch import spawn

STEPS = 3


def my_slices(full: dict[str, torch.Tensor], split_model) -> dict[str, torch.Tensor]:
    """`full` cut the way `split_model` (this MP rank's) holds it."""
    from zero_ref.tensor_parallel import group_rank, group_size, split_of

    size, rank = group_size(split_model.group), group_rank(split_model.group)
    params = dict(split_model.named_parameters())
    return {k: split_of(params[k]).cut(v, size, rank) if k in params and split_of(params[k]) else v
            for k, v in full.items()}


def export_and_reload(rank: int, world: int, folder: str):
    """Per stage: the exports at start and after STEPS steps (the latter also saved as a checkpoint
    in folder/stage<k>), what rank0_only returns, whether loading (unsplit, then as slices) leaves
    full_state_dict equal to what was loaded, and the error for a shape that fits neither."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "mp"))
    out = {}
    for stage in (2, 3):
        with mp_engine(stage, None, mesh) as engine:
            start = engine.full_state_dict()
            run_steps(engine, mesh.get_group("dp"), batches()[:STEPS])
            trained = engine.full_state_dict()
            only0 = engine.full_state_dict(rank0_only=True)
            engine.save_checkpoint(f"{folder}/stage{stage}")
            engine.load_state_dict(start)
            unsplit_loads = all(torch.equal(v, start[k]) for k, v in engine.full_state_dict().items())
            engine.load_state_dict(my_slices(trained, engine.module))
            slices_load = all(torch.equal(v, trained[k]) for k, v in engine.full_state_dict().items())
            bad = {**trained, "blocks.0.fc.weight": trained["blocks.0.fc.weight"][:-1]}
            try:
                engine.load_state_dict(bad)
                refusal = None
            except ValueError as err:
                refusal = str(err)
        same_keys = list(only0) == list(trained) and all(torch.equal(only0[k], trained[k]) for k in only0)
        out[stage] = {"start": start, "trained": trained, "rank0_only": same_keys if rank == 0 else only0,
                      "round_trip": (unsplit_loads, slices_load), "refusal": refusal}
    return out


@pytest.mark.timeout(120)
def test_mp_full_state_dict_is_the_unsplit_model_and_loads_and_consolidates(tmp_path):
    from zero_ref.cli import main
    from zero_ref.io.checkpoint import CheckpointError, consolidate
    from zero_ref.models import ParallelGPT

    results = spawn(export_and_reload, 4, str(tmp_path), timeout=100)
    _, ref_state = reference(STEPS)
    trained_in_one_process = ParallelGPT(**SHAPE)
    trained_in_one_process.load_state_dict(ref_state)
    tokens = batches()[STEPS]
    with torch.no_grad():
        expected = trained_in_one_process.logits(tokens)
    for stage in (2, 3):
        exported = results[0][stage]["trained"]
        for rank, result in enumerate(results):   # every rank returns the same unsplit model
            assert all(torch.equal(result[stage]["trained"][k], v) for k, v in exported.items()), (stage, rank)
            assert result[stage]["rank0_only"] == (True if rank == 0 else {}), (stage, rank)
            assert result[stage]["round_trip"] == (True, True), (stage, rank)
            assert "'blocks.0.fc.weight' has shape (127, 32), the model's is (64, 32) (this model-parallel " \
                   "rank's slice; unsplit (128, 32))" in result[stage]["refusal"], (stage, rank)
        twin = ParallelGPT(**SHAPE)   # the unsplit twin: the MP model's names, full shapes
        twin.load_state_dict(results[0][stage]["start"], strict=True)
        assert all(torch.equal(twin.state_dict()[k], v) for k, v in ParallelGPT(**SHAPE).state_dict().items())
        twin.load_state_dict(exported, strict=True)
        with torch.no_grad():
            logits_error = (twin.logits(tokens) - expected).abs().max().item()
        assert logits_error < 1e-5, (stage, logits_error)
        # offline: the two MP ranks' sub-checkpoints joined, the same tensors as full_state_dict
        root = tmp_path / f"stage{stage}"
        main(["consolidate", str(root), str(tmp_path / f"out{stage}")])
        consolidated = consolidate(root, tmp_path / f"again{stage}")
        assert list(consolidated) == list(exported)
        assert all(torch.equal(consolidated[k], v) for k, v in exported.items()), stage
    with pytest.raises(CheckpointError, match="model-parallel rank 1's slice of a model split over 2 ranks: "
                                              "consolidate the folder that holds mp0-of-2"):
        consolidate(tmp_path / "stage2" / "mp1-of-2", tmp_path / "lone")
