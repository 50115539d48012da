"""Bad input fails early with a message that names what is wrong."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero_ref
from zero_ref.launch import spawn

BAD_FIELDS = [
    ("stage", 4), ("stage", "2"), ("stage", True), ("dtype", "fp8"), ("dtype", torch.bfloat16),
    ("lr", -1.0), ("lr", float("nan")), ("betas", (0.9,)), ("betas", (0.9, 1.0)), ("eps", 0.0),
    ("weight_decay", -0.1), ("grad_clip", 0.0), ("grad_clip", float("inf")), ("grad_accum_steps", 0),
    ("grad_accum_steps", 1.5), ("bucket_numel", 0), ("overlap", 1), ("prefetch", -1),
    ("kernels", "cuda"), ("broadcast_buffers", "yes"), ("initial_loss_scale", 0.0),
    ("loss_scale_growth_interval", 0), ("min_loss_scale", 2.0**20),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS)
def test_invalid_config_field_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ZeroConfig\.{field} = .* expected"):
        zero_ref.ZeroConfig(**{field: value})


WRONG_TYPES = [["fp32"], {}, {"stage": 1}, {0.9}, torch.tensor([0.0, 1.0])]
"""Values of no field's type: they used to crash a dict lookup (unhashable) or an `in` on a tuple
(a tensor's == is elementwise) instead of naming the field."""


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(zero_ref.ZeroConfig)])
def test_a_value_of_the_wrong_type_names_the_field(field):
    for value in WRONG_TYPES:
        with pytest.raises(ValueError, match=rf"ZeroConfig\.{field} = .* expected"):
            zero_ref.ZeroConfig(**{field: value})


BEYOND_FLOATS = [(field, value) for field in ("lr", "eps", "weight_decay", "grad_clip", "comm_timeout_s",
                                             "initial_loss_scale", "min_loss_scale")
                 for value in (10**400, -10**400)] + [("betas", (0.9, 10**400))]
"""Ints no float holds: they used to raise OverflowError from math.isfinite."""


@pytest.mark.parametrize("field,value", BEYOND_FLOATS)
def test_an_int_beyond_the_floats_range_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ZeroConfig\.{field} = .* expected"):
        zero_ref.ZeroConfig(**{field: value})


def test_valid_config_and_replace():
    cfg = zero_ref.ZeroConfig(stage=2, dtype="bf16", lr=1e-3, weight_decay=0.0, grad_clip=1.0, bucket_numel=2**22)
    assert cfg.torch_dtype == torch.bfloat16 and cfg.replace(stage=3).stage == 3
    with pytest.raises(ValueError, match="stage"):
        cfg.replace(stage=7)


def test_uninitialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        zero_ref.initialize(nn.Linear(2, 2), zero_ref.ZeroConfig())


def test_wrong_argument_types():
    with pytest.raises(TypeError, match="ZeroConfig"):
        zero_ref.initialize(nn.Linear(2, 2), {"stage": 1})


def _mismatched(rank, world_size):
    width = 5 if rank == 1 else 4
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4 if rank != 1 else width, 2))
    if rank == 1:
        model[1] = nn.Linear(width, 2)
    try:
        zero_ref.initialize(model, zero_ref.ZeroConfig(stage=1, kernels="torch"))
    except ValueError as err:
        return str(err)
    return None


def _backward_needs_scalar(rank, world_size):
    engine = zero_ref.initialize(nn.Linear(3, 2), zero_ref.ZeroConfig(kernels="torch"))
    out = engine(torch.ones(4, 3))
    try:
        engine.backward(out)
    except ValueError as err:
        return str(err)


def test_models_that_differ_across_ranks_and_bad_backward():
    messages = spawn(_mismatched, 2)
    for message in messages:   # every rank fails, none hangs
        assert message is not None and "1.weight" in message and "rank 1" in message
    (message,) = spawn(_backward_needs_scalar, 1)
    assert "scalar" in message


def _given_differently(rank, world_size):
    """initialize with a config or param_groups that differ on rank 1, then one that agrees."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    base = dict(stage=2, kernels="torch", bucket_numel=8)
    weights = [model[0].weight, model[1].weight]
    biases = [model[0].bias, model[1].bias]
    cases = {
        "bucket_numel": (dict(base, bucket_numel=9 if rank == 1 else 8), None),
        "stage": (dict(base, stage=3 if rank == 1 else 2), None),
        "members": (base, [{"params": weights + biases[:1]}, {"params": biases[1:], "weight_decay": 0.0}]
                    if rank == 1 else [{"params": weights}, {"params": biases, "weight_decay": 0.0}]),
        "values": (base, [{"params": weights}, {"params": biases, "lr": 0.5 if rank == 1 else 0.1}]),
        "refused on one rank": (base, [{"params": weights}, {"params": biases, "momentum": 0.9}]
                                if rank == 1 else [{"params": weights + biases}]),
    }
    out = {}
    for name, (config, groups) in cases.items():
        try:
            zero_ref.initialize(model, zero_ref.ZeroConfig(**config), param_groups=groups).close()
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    # refused by initialize's own checks on rank 1 only (the others waited for it until the timeout),
    # or built another way there (a buffer left on the meta device: sharded construction on rank 1 alone)
    compiled, meta_buffer = copy.deepcopy(model), copy.deepcopy(model)
    if rank == 1:
        compiled.compile()   # stage 3 refuses a compiled model
        meta_buffer.register_buffer("scale", torch.ones(1, device="meta"))
    for name, (other, config) in {"compiled on one rank": (compiled, dict(base, stage=3)),
                                  "meta on one rank": (meta_buffer, base)}.items():
        try:
            zero_ref.initialize(other, zero_ref.ZeroConfig(**config)).close()
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    with zero_ref.initialize(model, zero_ref.ZeroConfig(**base)) as engine:   # nothing was left half-built
        engine.backward(engine(torch.ones(2, 3)).sum())
        out["then"] = engine.step()
    return out


def test_configs_or_param_groups_that_differ_across_ranks_are_refused_on_every_rank():
    """Another bucket size or stage lays out or issues other collectives, another grouping updates
    a shard with other hyper-parameters: each would pair the ranks' collectives wrongly or train a
    mix. initialize compares them across the ranks and raises ValueError on every rank."""
    expected = {"bucket_numel": "bucket_numel=8 on rank 0 but 9 on rank 1", "stage": "stage=2 on rank 0 but 3",
                "members": "group 0 holds ['0.bias'] on rank 1 but not on rank 0", "values": "lr=0.1 on rank 0 but 0.5 on rank 1"}
    for rank, out in enumerate(spawn(_given_differently, 2)):
        for name, fragment in expected.items():
            assert out[name] is not None and fragment in out[name], (rank, name, out[name])
        for name, own in (("refused on one rank", "momentum"), ("compiled on one rank", "compiled")):
            refused = out[name]
            assert refused is not None and (own in refused if rank == 1 else "refused on rank(s) 1" in refused), \
                (rank, name, refused)
        assert "rank(s) 1 built theirs on the meta device" in (out["meta on one rank"] or ""), out["meta on one rank"]
        assert out["then"] is True
