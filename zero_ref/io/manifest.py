"""What a checkpoint says about itself (manifest.json), and the checks that it says it correctly.

The manifest records the format, world size, stage and dtype, every trainable parameter (its
name, aliases, shape), its AdamW step count, the parameter groups (names and hyper-parameters, as a
learning-rate schedule left them) and, when given, the lr scheduler's state (in a JSON form that
keeps its Python types: `to_json`), the bucket order stages 0-2 learned, the frozen parameters and
buffers, which rank's file holds which piece of which parameter, each file's size and sha256,
and under model parallelism this rank's place in the MP group and how each split parameter is cut
("model_parallel": {"rank", "size", "splits": {name: [dim, parts]}}, tensor_parallel.Split), so that
`consolidate` can join the MP ranks' sub-checkpoints with no process group. It is sealed with its
own sha256, so any edit is caught; `validate_manifest` then checks every field (a resealed edit
must still describe a consistent checkpoint), and `check_matches_model` that it describes the
model being loaded into.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections import Counter
from pathlib import Path

import torch

from ..config import DTYPES
from ..param_groups import check_hyper
from ..tensor_parallel import split_of

FORMAT_VERSION = 2
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
_FILE_RE = re.compile(r"^rank\d{5}\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read back as it should (the message says why)."""


# --- writing --------------------------------------------------------------------------------------
def training_state(engine, names: dict[int, str], lr_scheduler=None) -> dict:
    """The parameter groups (each group's parameter names and hyper-parameters) and the lr scheduler's
    state (through `to_json`), as JSON values; CheckpointError when a value cannot be written as JSON."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.tolist()
        return list(value) if isinstance(value, tuple) else value

    groups = [{"params": [names[id(p)] for p in group["params"]],
               "hyper": {k: plain(v) for k, v in group.items() if k != "params"}}
              for group in engine.optimizer.param_groups]
    try:
        json.dumps(groups, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"the parameter groups cannot be saved as JSON: {err}") from err
    return {"param_groups": groups,
            "lr_scheduler": None if lr_scheduler is None else to_json(lr_scheduler.state_dict(), "state_dict()")}


# --- lr scheduler states as JSON --------------------------------------------------------------------
_TAG = "__zero_ref_type__"
_MAPPINGS = {"dict": dict, "Counter": Counter}


def to_json(value, where: str):
    """`value` (an lr scheduler's state, or a part of it at the key path `where`) as JSON values that
    `from_json` turns back into equal values of the same types. Plain JSON would not: MultiStepLR's
    milestones are a Counter with int keys (JSON keeps string keys), ReduceLROnPlateau holds inf (not
    JSON); so Counters, dicts with other keys than strings, tuples and non-finite floats are written
    as tagged objects {_TAG: kind, "value": ...}. CheckpointError names the key path of a value that
    is none of these, nor None, a bool, an int, a string or a list."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {_TAG: "float", "value": repr(value)}
    if type(value) in (list, tuple):
        items = [to_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
        return items if type(value) is list else {_TAG: "tuple", "value": items}
    if _is_state(value) and _TAG not in value:
        return {key: to_json(item, f"{where}[{key!r}]") for key, item in value.items()}
    if type(value) in _MAPPINGS.values():
        return {_TAG: type(value).__name__, "value": [
            [to_json(key, f"{where} key {key!r}"), to_json(item, f"{where}[{key!r}]")] for key, item in value.items()]}
    raise CheckpointError(f"the lr scheduler's {where} = {value!r:.80} cannot be saved: a checkpoint holds None, "
                          "bools, ints, floats, strings, and lists, tuples, dicts and Counters of these (keep other "
                          "values, such as tensors or numpy numbers, out of the scheduler's state_dict)")


def _is_state(value) -> bool:
    """Whether `value` is a dict with string keys (as a scheduler's state is), so JSON keeps it as it is."""
    return type(value) is dict and all(isinstance(key, str) for key in value)


def from_json(value):
    """The value that `to_json` wrote as `value`; ValueError or TypeError when it holds a tagged object
    that `to_json` does not write."""
    if isinstance(value, list):
        return [from_json(item) for item in value]
    if not isinstance(value, dict):
        return value
    if _TAG not in value:
        return {key: from_json(item) for key, item in value.items()}
    kind, body = value[_TAG], value.get("value")
    if kind == "float" and body in ("inf", "-inf", "nan"):
        return float(body)
    if kind == "tuple" and isinstance(body, list):
        return tuple(from_json(body))
    if kind in _MAPPINGS and isinstance(body, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in body):
        return _MAPPINGS[kind]({from_json(key): from_json(item) for key, item in body})
    raise ValueError(f"{value!r:.80} is not a value that to_json writes")


def _shape_differences(ours, theirs, where: str) -> list[str]:
    """The key paths where the state `theirs` differs in shape from `ours`: an entry only one holds, or
    a value of another type. Dicts with string keys (a state, and the child states of SequentialLR and
    ChainedScheduler) are compared entry by entry, lists of them item by item; other values, such as
    MultiStepLR's milestones, by type only (their contents are what a load restores)."""
    if type(ours) is not type(theirs):
        return [where]
    if _is_state(ours) and _is_state(theirs):
        return [f"{where}[{key!r}]" for key in sorted(set(ours) ^ set(theirs))] + [
            difference for key in ours if key in theirs
            for difference in _shape_differences(ours[key], theirs[key], f"{where}[{key!r}]")]
    if type(ours) is list and any(_is_state(item) for item in ours + theirs):
        if len(ours) != len(theirs):
            return [where]
        return [difference for i, (mine, saved) in enumerate(zip(ours, theirs))
                for difference in _shape_differences(mine, saved, f"{where}[{i}]")]
    return []


def build_manifest(engine, names: dict[int, str], files: list[dict], order: list[int] | None,
                   state: dict) -> dict:
    """The manifest of a checkpoint of `engine` whose rank files are `files` (names: canonical_names;
    state: training_state)."""
    aliases: dict[str, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if name != names[id(param)]:
            aliases.setdefault(names[id(param)], []).append(name)
    trainable = engine.stage.trainable   # as at initialize: requires_grad may have been switched off since
    hf = None
    config = getattr(engine.module, "config", None)
    if hasattr(config, "to_json_string") and hasattr(engine.module, "save_pretrained"):
        hf = {"class": type(engine.module).__name__, "config": json.loads(config.to_json_string())}
    return {
        "format_version": FORMAT_VERSION,
        "world_size": engine.comm.world_size, "stage": engine.config.stage, "dtype": engine.config.dtype,
        "global_step": engine.global_step, "optimizer_step": engine.stage.optimizer.step_count,
        "param_steps": list(engine.stage.optimizer.param_steps),
        "skipped_steps": engine.skipped_steps, "scaler": engine.scaler.state_dict(),
        "config": {k: v for k, v in dataclasses.asdict(engine.config).items()},
        "params": [{"name": names[id(p)], "aliases": aliases.get(names[id(p)], []),
                    "shape": list(p.shape), "numel": p.numel()} for p in trainable],
        "frozen": [{"name": names[id(p)], "shape": list(p.shape)} for p in engine.frozen],
        "buffers": [{"name": n, "shape": list(b.shape)} for n, b in persistent_buffers(engine.module)],
        "state_keys": list(engine.module.state_dict(keep_vars=True).keys()),
        "param_order": None if order is None else [names[id(trainable[k])] for k in order],
        "files": files, "hf": hf, "model_parallel": _model_parallel(engine), **state,
    }


def _model_parallel(engine) -> dict | None:
    """The manifest's "model_parallel" field: None without model parallelism."""
    if engine.mp_comm is None:
        return None
    splits = {name: [split.dim, split.parts] for name, param in engine.module.named_parameters(remove_duplicate=False)
              if (split := split_of(param)) is not None}
    return {"rank": engine.mp_comm.rank, "size": engine.mp_comm.world_size, "splits": splits}


def digest(manifest: dict) -> str:
    """The sha256 of the manifest without its seal."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(manifest: dict) -> dict:
    """The manifest with its own sha256 added (so any edit or corruption is detected on load)."""
    return {**manifest, "sha256": digest(manifest)}


# --- reading ---------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict:
    """Parse, unseal and validate a checkpoint folder's manifest."""
    path = Path(folder) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("sha256") != digest(manifest):
        raise CheckpointError(f"{path} is corrupted: its content does not match its sha256 seal")
    try:
        validate_manifest(manifest)
    except (TypeError, KeyError, AttributeError, IndexError) as err:   # a shape no field check foresaw
        raise CheckpointError(f"{path} is malformed: {err!r}") from err
    return manifest


def validate_manifest(m: dict) -> None:
    """Check every field of a manifest; raise CheckpointError naming the first bad one."""
    def need(ok: bool, field: str) -> None:
        if not ok:
            raise CheckpointError(f"manifest field {field!r} is missing or invalid")

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    need(m.get("format_version") == FORMAT_VERSION, "format_version")
    need(count(m.get("world_size")) and m["world_size"] >= 1, "world_size")
    need(m.get("stage") in (0, 1, 2, 3) and not isinstance(m.get("stage"), bool), "stage")
    need(isinstance(m.get("dtype"), str) and m["dtype"] in DTYPES, "dtype")
    for key in ("global_step", "optimizer_step", "skipped_steps"):
        need(count(m.get(key)), key)
    scaler = m.get("scaler")
    need(isinstance(scaler, dict) and isinstance(scaler.get("scale"), (int, float))
         and math.isfinite(scaler["scale"]) and scaler["scale"] > 0 and count(scaler.get("clean_steps")), "scaler")
    need(isinstance(m.get("params"), list), "params")
    numels = {}
    for p in m["params"]:
        need(isinstance(p, dict) and isinstance(p.get("name"), str) and p["name"] not in numels
             and isinstance(p.get("aliases"), list) and all(isinstance(a, str) for a in p["aliases"])
             and isinstance(p.get("shape"), list) and all(count(d) for d in p["shape"])
             and p.get("numel") == math.prod(p["shape"]), "params")
        numels[p["name"]] = p["numel"]
    for key in ("frozen", "buffers"):
        need(isinstance(m.get(key), list) and all(
            isinstance(x, dict) and isinstance(x.get("name"), str) and isinstance(x.get("shape"), list)
            and all(count(d) for d in x["shape"]) for x in m[key]), key)
    need(isinstance(m.get("state_keys"), list) and all(isinstance(k, str) for k in m["state_keys"]), "state_keys")
    steps = m.get("param_steps")
    need(isinstance(steps, list) and len(steps) == len(numels) and all(count(n) for n in steps), "param_steps")
    order = m.get("param_order", "missing")
    need(order is None or (isinstance(order, list) and all(isinstance(n, str) for n in order)
                           and sorted(order) == sorted(numels)), "param_order")
    groups = m.get("param_groups")   # absent in checkpoints written before parameter groups existed
    listed = [name for g in groups for name in g.get("params", ())] if isinstance(groups, list) and all(
        isinstance(g, dict) for g in groups) else None
    need(groups is None or (listed is not None and sorted(listed) == sorted(numels) and all(
        isinstance(g.get("hyper"), dict) and _valid_hyper(g["hyper"]) for g in groups)), "param_groups")
    need(m.get("lr_scheduler") is None or _decodes_to_dict(m["lr_scheduler"]), "lr_scheduler")
    shapes = {name: p["shape"] for p in m["params"] for name in [p["name"], *p["aliases"]]}
    shapes.update({x["name"]: x["shape"] for x in m["frozen"]})
    mp = m.get("model_parallel")   # absent in checkpoints written before it was recorded
    need(mp is None or (isinstance(mp, dict) and count(mp.get("size")) and count(mp.get("rank"))
                        and mp["rank"] < mp["size"] and isinstance(mp.get("splits"), dict)
                        and all(name in shapes and _valid_split(split, shapes[name], count)
                                for name, split in mp["splits"].items())), "model_parallel")
    files = m.get("files")
    need(isinstance(files, list) and len(files) == m["world_size"], "files")
    covered = {name: [] for name in numels}
    for rank, f in enumerate(files):
        need(isinstance(f, dict) and f.get("rank") == rank and isinstance(f.get("file"), str)
             and _FILE_RE.match(f["file"]) is not None and count(f.get("bytes"))
             and isinstance(f.get("sha256"), str) and _HEX64.match(f["sha256"]) is not None
             and isinstance(f.get("pieces"), list), f"files[{rank}]")
        for piece in f["pieces"]:
            need(isinstance(piece, list) and len(piece) == 3 and isinstance(piece[0], str)
                 and piece[0] in numels and count(piece[1])
                 and count(piece[2]) and piece[1] < piece[2] <= numels[piece[0]], f"files[{rank}].pieces")
            covered[piece[0]].append((piece[1], piece[2]))
    for name, ranges in covered.items():   # the pieces of every parameter tile it exactly
        position = 0
        for start, end in sorted(ranges):
            need(start == position, f"pieces of {name}")
            position = end
        need(position == numels[name], f"pieces of {name}")


def check_matches_model(manifest: dict, engine, names: dict[int, str]) -> None:
    """Raise CheckpointError at the first parameter, frozen parameter or buffer that differs."""
    trainable = [(names[id(p)], list(p.shape)) for p in engine.stage.trainable]   # as at initialize
    saved = [(p["name"], p["shape"]) for p in manifest["params"]]
    for i in range(max(len(trainable), len(saved))):
        ours = trainable[i] if i < len(trainable) else None
        theirs = saved[i] if i < len(saved) else None
        if ours != theirs:
            raise CheckpointError(f"checkpoint does not match the model at trainable parameter #{i}: "
                                  f"checkpoint has {theirs}, model has {ours}")
    frozen = [(names[id(p)], list(p.shape)) for p in engine.frozen]
    buffers = [(n, list(b.shape)) for n, b in persistent_buffers(engine.module)]
    for kind, ours, theirs in (("frozen parameter", frozen, manifest["frozen"]),
                               ("buffer", buffers, manifest["buffers"])):
        theirs = [(x["name"], x["shape"]) for x in theirs]
        if ours != theirs:
            first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise CheckpointError(f"checkpoint does not match the model at {kind} #{first}: checkpoint has "
                                  f"{theirs[first] if first < len(theirs) else None}, model has "
                                  f"{ours[first] if first < len(ours) else None}")


def _valid_hyper(hyper: dict) -> bool:
    """Whether a saved group's hyper-parameters are values a group may hold (param_groups.check_hyper)."""
    try:
        check_hyper("hyper", hyper)
    except (ValueError, TypeError, KeyError):
        return False
    return True


def _valid_split(split, shape: list[int], count) -> bool:
    """Whether a saved [dim, parts] can cut a slice of `shape`: a dimension it has, in equal blocks."""
    return (isinstance(split, list) and len(split) == 2 and all(count(v) for v in split)
            and split[0] < len(shape) and split[1] >= 1 and shape[split[0]] % split[1] == 0)


def _decodes_to_dict(saved) -> bool:
    """Whether a saved lr scheduler state is one that `to_json` wrote for a state dict."""
    try:
        return isinstance(from_json(saved), dict)
    except (ValueError, TypeError):
        return False


def check_groups_match(manifest: dict, engine, names: dict[int, str], lr_scheduler) -> None:
    """Raise CheckpointError when the checkpoint's parameter groups are not the engine's (the same
    parameters in the same groups), or a scheduler is to be restored from a checkpoint without one."""
    saved = manifest.get("param_groups")
    if saved is not None:
        ours = [[names[id(p)] for p in group["params"]] for group in engine.optimizer.param_groups]
        theirs = [group["params"] for group in saved]
        if [sorted(g) for g in ours] != [sorted(g) for g in theirs]:
            raise CheckpointError(f"the checkpoint's parameter groups differ from this engine's: it has "
                                  f"{len(theirs)} groups of {[len(g) for g in theirs]} parameters, the engine "
                                  f"{len(ours)} of {[len(g) for g in ours]} (pass the same param_groups to initialize)")
    if lr_scheduler is not None and manifest.get("lr_scheduler") is None:
        raise CheckpointError("an lr scheduler was passed to load_checkpoint, but this checkpoint holds none "
                              "(pass it to save_checkpoint too)")
    if lr_scheduler is not None:   # the same kind of scheduler: the same entries, each of the same type
        differ = _shape_differences(lr_scheduler.state_dict(), from_json(manifest["lr_scheduler"]), "state_dict()")
        if differ:
            raise CheckpointError(f"the checkpoint's lr scheduler state does not fit {type(lr_scheduler).__name__}: "
                                  f"entries {differ[:5]} are missing, extra or of another type (pass a scheduler "
                                  "of the kind that was saved)")


def restore_groups(manifest: dict, engine, lr_scheduler) -> None:
    """Set the groups' hyper-parameters, then the scheduler's state, as the checkpoint saved them."""
    for group, record in zip(engine.optimizer.param_groups, manifest.get("param_groups") or ()):
        group.update({k: tuple(v) if k == "betas" else v for k, v in record["hyper"].items()})
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(from_json(manifest["lr_scheduler"]))


# --- names -----------------------------------------------------------------------------------------
def canonical_names(model) -> dict[int, str]:
    """The first name of every parameter (a tied weight is stored once, under its first name)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def persistent_buffers(model):
    """(name, buffer) for the buffers the model's state dict holds."""
    keys = set(model.state_dict(keep_vars=True).keys())
    return [(name, buffer) for name, buffer in model.named_buffers() if name in keys]


def piece_index(manifest: dict) -> dict[str, list[tuple[int, int, int]]]:
    """{parameter name: sorted (start, end, rank) of its pieces}."""
    where: dict[str, list[tuple[int, int, int]]] = {p["name"]: [] for p in manifest["params"]}
    for f in manifest["files"]:
        for name, start, end in f["pieces"]:
            where[name].append((start, end, f["rank"]))
    return {name: sorted(pieces) for name, pieces in where.items()}
