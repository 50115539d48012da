"""Checkpoints that are damaged, for another model, missing, or whose manifest was fuzzed (hypothesis):
each is refused with a CheckpointError naming what is wrong, and nothing changes. In this process,
with a world-1 gloo group. (Apart from test_failures.py, whose ranks import that module: hypothesis
would cost each of them its import.)"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import zero_ref
from awkward import AwkwardNet, global_batches, loss_fn
from zero_ref.io.checkpoint import CheckpointError, consolidate
from zero_ref.io.manifest import seal
from zero_ref.launch import free_port


# --- checkpoint input errors, in this process with a world-1 gloo group -------------------------
@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    folder = tmp_path_factory.mktemp("ckpt")
    engine = zero_ref.initialize(AwkwardNet(), zero_ref.ZeroConfig(stage=3, bucket_numel=100, kernels="torch"))
    for (tokens,) in global_batches(2, 1, 12):
        engine.backward(loss_fn(engine(tokens), tokens))
        engine.step()
    saved = engine.save_checkpoint(folder)
    yield saved, engine.full_state_dict()
    dist.destroy_process_group()


def _fresh_engine():
    return zero_ref.initialize(AwkwardNet(seed=5), zero_ref.ZeroConfig(stage=2, bucket_numel=100, kernels="torch"))


def test_checkpoint_for_another_model_names_the_parameter(world1):
    saved, _ = world1
    other = zero_ref.initialize(nn.Sequential(nn.Linear(3, 4)), zero_ref.ZeroConfig(kernels="torch"))
    with pytest.raises(CheckpointError, match=r"trainable parameter #0: checkpoint has \('embed.weight'"):
        other.load_checkpoint(saved)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_shard_names_the_file_and_changes_nothing(world1, tmp_path, damage):
    saved, _ = world1
    copy = tmp_path / saved.name
    copy.mkdir()
    for f in saved.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = copy / "rank00000.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    engine = _fresh_engine()
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match="rank00000.safetensors"):
        engine.load_checkpoint(copy)
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_missing_checkpoint(tmp_path, world1):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        _fresh_engine().load_checkpoint(tmp_path)


def _mutations():
    leaf = st.one_of(st.integers(-3, 10**6), st.text(max_size=8), st.none(), st.booleans(),
                     st.floats(allow_nan=True), st.lists(st.integers(-2, 50), max_size=3))
    return st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), leaf, st.booleans())


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations())
def test_fuzzed_manifest_never_loads_silently_wrong(world1, tmp_path_factory, mutation):
    saved, expected = world1
    pick, _, value, reseal = mutation
    manifest = json.loads((saved / "manifest.json").read_text())
    paths = [p for p in _paths(manifest) if p and p[0] != "sha256"]
    path = paths[pick % len(paths)]
    node = manifest
    for key in path[:-1]:
        node = node[key]
    if node[path[-1]] == value:
        return
    node[path[-1]] = value
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    manifest = seal(body) if reseal else manifest   # resealed: the field checks must catch it
    copy = tmp_path_factory.mktemp("fuzz")
    for f in saved.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "manifest.json").write_text(json.dumps(manifest))
    engine = _fresh_engine()
    try:
        engine.load_checkpoint(copy)
    except CheckpointError:
        return
    assert reseal, "an unsealed edit was accepted"
    state = engine.full_state_dict()   # accepted: then the weights must be exactly the saved ones
    assert all(torch.equal(state[k], expected[k]) for k in expected), path


def test_consolidate_handles_padding_ties_frozen_and_buffers(world1, tmp_path):
    """Offline consolidation of a stage-3 AwkwardNet checkpoint (padded units, a tied weight, a
    frozen layer, a buffer) equals the engine's full_state_dict exactly."""
    saved, expected = world1
    state = consolidate(saved, tmp_path / "out")
    assert list(state) == list(expected)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert torch.equal(state["head.weight"], state["embed.weight"])
