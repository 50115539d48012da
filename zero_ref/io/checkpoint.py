"""Sharded checkpoints: every rank writes its own shard, one manifest says how the pieces fit.

A checkpoint root directory holds:

    latest                           the tag of the newest complete checkpoint (replaced atomically)
    <tag>/manifest.json              format, world size, stage, dtype, parameters, which rank holds
                                     which piece of which parameter, files with sizes and sha256
    <tag>/rank00000.safetensors      that rank's pieces of the fp32 master and both Adam moments,
                                     its RNG state, and (rank 0) frozen parameters and buffers

State is stored per parameter piece (`master/<name>/<start>` holds elements [start, end) of the
flattened parameter), not per flat group, so a checkpoint can be read back at any world size and
any stage: each rank reads exactly the element ranges it now owns (resharding), and
`consolidate` glues the pieces into full tensors with no process group. The low-precision
parameters are not stored: they are the rounded masters, restored bit-exactly by rounding again.

Saving copies every piece to host memory first (pinned on CUDA, so the device never holds a second
copy of the optimizer state). Stages 0-2 also record the bucket order they learned, so a resumed run
starts in it.

Crash safety: shard files and the manifest are written under temporary names, fsynced and renamed;
`latest` is replaced only after every rank's file and the manifest are complete. A save killed at
any point leaves `latest` on the previous checkpoint; a save that fails on one rank raises on every
rank. A load runs in three phases: every rank verifies the manifest (sealed by its own sha256, then
checked field by field) and the size and sha256 of every file it reads, and reads its pieces into
host memory; all ranks vote; only if every rank succeeded does any rank apply what it read (in
`_apply`, the one place that restores an engine's state). A failure anywhere changes nothing anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from .manifest import (STATE_KINDS, CheckpointError, build_manifest, canonical_names, check_groups_match,
                       check_matches_model, restore_groups, training_state,
                       persistent_buffers, piece_index, read_manifest, seal)
from ..core.optim import LossScaler
from ..guard.refusals import gather_refusals, refuse_together
from .model_parallel import join_sub_checkpoints, refuse_lone_slice, sub_checkpoints
from .state_dict import write_model_state

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "consolidate", "resolve", "read_manifest"]


# --- saving --------------------------------------------------------------------------------------
def save_checkpoint(engine, root: str | os.PathLike, keep: int = 2, lr_scheduler=None) -> Path:
    """Write this engine's state under `root` (collective: every rank calls it). Returns the new
    checkpoint's folder. Older complete checkpoints beyond the newest `keep` are removed. The
    parameter groups' hyper-parameters are saved, and `lr_scheduler`'s state when one is given."""
    comm, stage, optimizer = engine.comm, engine.stage, engine.stage.optimizer
    root = Path(root)
    names = canonical_names(engine.module)
    state, refusal = None, None
    try:   # checked on every rank, then told to every rank, before anything is written
        if engine.micro_step:
            raise CheckpointError(
                f"save_checkpoint must be called between steps: {engine.micro_step} backward(s) of this step (of "
                f"grad_accum_steps={engine.config.grad_accum_steps}) have run since the last update. Call step() at "
                "the step's boundary first (engine.zero_grad() discards the gradients but not the backwards' place "
                "in the step)")
        state = training_state(engine, names, lr_scheduler)
    except CheckpointError as err:
        refusal = err
    everyone = refuse_together(comm, refusal, (f"step{engine.global_step:08d}-{uuid.uuid4().hex[:8]}", str(root)),
                               what="save_checkpoint", error=CheckpointError, consequence="nothing was written")
    elsewhere = [rank for rank, (_, theirs) in enumerate(everyone) if theirs != everyone[0][1]]
    if elsewhere:
        raise CheckpointError(f"save_checkpoint was given {everyone[elsewhere[0]][1]!r} on rank {elsewhere[0]} but "
                              f"{everyone[0][1]!r} on rank 0: every rank must name the same folder (each writes its "
                              "own file into it); nothing was written")
    tag = everyone[0][0]
    folder = root / tag

    tensors, pieces = {}, []
    if not (stage.replicated and comm.rank != 0):
        for param, start, end, g, offset in stage.owned_pieces():
            name = names[id(param)]
            for kind, segments in zip(STATE_KINDS, (optimizer.masters, optimizer.exp_avgs, optimizer.exp_avg_sqs)):
                tensors[f"{kind}/{name}/{start}"] = _to_host(segments[g][offset:offset + end - start])
            pieces.append([name, start, end])
    if comm.rank == 0:
        for param in engine.frozen:
            tensors[f"frozen/{names[id(param)]}"] = _to_host(param.detach().float())
        for name, buffer in persistent_buffers(engine.module):
            tensors[f"buffer/{name}"] = _to_host(buffer.detach())
    tensors["rng/cpu"] = torch.get_rng_state()
    if stage.device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(stage.device)
        torch.cuda.synchronize(stage.device)   # the pinned copies above are asynchronous

    path = folder / f"rank{comm.rank:05d}.safetensors"

    def write() -> dict:
        folder.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"tag": tag, "rank": str(comm.rank)}))
        return {"rank": comm.rank, "file": path.name, "bytes": path.stat().st_size,
                "sha256": _sha256(path), "pieces": pieces}

    files = _together(comm, write, f"writing {path}")[1]
    order = stage.learned_order()

    def finish() -> None:
        if comm.rank == 0:
            manifest = build_manifest(engine, names, files, order, state)
            _atomic_write(folder / "manifest.json", lambda tmp: tmp.write_text(json.dumps(seal(manifest), indent=1)))
            _atomic_write(root / "latest", lambda tmp: tmp.write_text(tag))
            _prune(root, keep, tag)

    _together(comm, finish, "writing the manifest")   # nobody returns before `latest` names it
    return folder


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` with its own storage (pinned and asynchronous from CUDA)."""
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)
    return tensor.clone()


def _together(comm, work, what: str, summary=lambda result: result):
    """Run `work()` on every rank, then let all ranks see every outcome: (this rank's result, every
    rank's `summary(result)`), or a CheckpointError on every rank naming the rank that failed and why.
    Only the summaries travel (a load's tensors stay on the rank that read them)."""
    result, mine, refusal = None, None, None
    try:
        result = work()
        mine = summary(result)
    except Exception as err:   # noqa: BLE001 - reported to every rank below
        refusal = err
    refusals, summaries = gather_refusals(comm, refusal, mine)
    failed = [(rank, message) for rank, message in enumerate(refusals) if message]
    if failed:
        detail = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
        raise CheckpointError(f"{what} failed ({detail}); nothing was changed on any rank")
    return result, summaries


def _prune(root: Path, keep: int, newest: str) -> None:
    """Remove checkpoint folders other than the newest `keep` (incomplete ones from killed saves too)."""
    tags = sorted((p.name for p in root.iterdir() if p.is_dir() and re.match(r"^step\d{8}-[0-9a-f]{8}$", p.name)),
                  key=lambda t: (t == newest, (root / t / "manifest.json").exists(), (root / t).stat().st_mtime))
    for tag in tags[:-max(keep, 1)]:
        if tag != newest:
            shutil.rmtree(root / tag, ignore_errors=True)


# --- loading -------------------------------------------------------------------------------------
def load_checkpoint(engine, path: str | os.PathLike, lr_scheduler=None) -> None:
    """Load a checkpoint (a root with `latest`, or one checkpoint folder) into this engine, at any
    world size and stage (collective: every rank calls it), with the parameter groups'
    hyper-parameters and, when given, `lr_scheduler`'s state. Nothing in any rank's engine (or the
    scheduler) changes unless every rank has verified and read all it needs."""
    comm = engine.comm
    failure, read = None, None
    try:
        read, digests = _together(comm, lambda: _read(engine, path, lr_scheduler), f"loading checkpoint {path}",
                                  summary=lambda r: r["digest"])
        if len(set(digests)) > 1:
            raise CheckpointError(f"ranks read different checkpoints at {path} (was `latest` replaced during the "
                                  "load?); nothing was changed on any rank")
    except CheckpointError as err:
        failure = str(err)
    if engine.mp_comm is not None:   # model parallelism: the MP ranks' slices must all load, at one step
        votes = engine.mp_comm.all_gather_object((failure, read and read["manifest"]["global_step"]))
        failures = [f"model-parallel rank {r}: {f}" for r, (f, _) in enumerate(votes) if f]
        if not failures and len({step for _, step in votes}) > 1:
            failures = [f"the model-parallel slices under {path} are at different steps "
                        f"{[step for _, step in votes]}; nothing was changed on any rank"]
        failure = failures[0] if failures else None
    if failure:
        raise CheckpointError(failure)
    _apply(engine, read)
    restore_groups(read["manifest"], engine, lr_scheduler)


def _read(engine, path, lr_scheduler=None) -> dict:
    """Phase 1, on this rank only: verify and read everything this rank needs into host memory."""
    folder = resolve(path)
    manifest = read_manifest(folder)
    names = canonical_names(engine.module)
    check_matches_model(manifest, engine, names)
    check_groups_match(manifest, engine, names, lr_scheduler)
    comm, stage = engine.comm, engine.stage
    order = None
    if manifest["param_order"] is not None and stage.wants_order():
        index = {name: k for k, name in enumerate(names[id(p)] for p in stage.trainable)}
        order = [index[name] for name in manifest["param_order"]]   # validated: a permutation of them
    planned = list(stage.planned_pieces(order))

    where = piece_index(manifest)
    needed = {0} | ({comm.rank} if comm.rank < manifest["world_size"] else set())
    for param, start, end, _, _ in planned:
        needed.update(r for s, e, r in where[names[id(param)]] if s < end and e > start)
    handles = {r: _open_verified(folder, manifest["files"][r]) for r in sorted(needed)}
    try:
        pieces = {}   # (id(param), start) -> {kind: tensor of the piece [start, end)}
        for param, start, end, _, _ in planned:
            name = names[id(param)]
            parts = {kind: torch.empty(end - start, dtype=torch.float32) for kind in STATE_KINDS}
            for s, e, r in where[name]:
                lo, hi = max(start, s), min(end, e)
                if lo < hi:
                    for kind in STATE_KINDS:
                        parts[kind][lo - start:hi - start] = handles[r].get_slice(f"{kind}/{name}/{s}")[lo - s:hi - s]
            pieces[(id(param), start)] = parts
        frozen = [handles[0].get_tensor(f"frozen/{names[id(p)]}") for p in engine.frozen]
        buffers = [handles[0].get_tensor(f"buffer/{name}") for name, _ in persistent_buffers(engine.module)]
        own = handles.get(comm.rank) if comm.rank < manifest["world_size"] else None
        rng = {key: own.get_tensor(key) for key in own.keys() if key.startswith("rng/")} if own is not None else {}
    except Exception as err:   # a key or shape the verified manifest promised but the file lacks
        raise CheckpointError(f"checkpoint {folder} is inconsistent with its manifest: {err}") from err
    return {"manifest": manifest, "digest": manifest["sha256"], "order": order, "pieces": pieces,
            "frozen": frozen, "buffers": buffers, "rng": rng}


def _apply(engine, read: dict) -> None:
    """Phase 3, once every rank has read successfully: restore the engine's whole state."""
    stage, optimizer, manifest = engine.stage, engine.stage.optimizer, read["manifest"]
    if read["order"] is not None:
        stage.adopt_order(read["order"])
        optimizer = stage.optimizer
    segments = dict(zip(STATE_KINDS, (optimizer.masters, optimizer.exp_avgs, optimizer.exp_avg_sqs)))
    buffers = [buffer for _, buffer in persistent_buffers(engine.module)]
    whole = [*zip(engine.frozen, read["frozen"]), *zip(buffers, read["buffers"])]
    write_model_state(stage, segments, lambda param, start, end: read["pieces"][(id(param), start)], whole)
    with torch.no_grad():
        stage.zero_grads()
    if "rng/cpu" in read["rng"]:
        torch.set_rng_state(read["rng"]["rng/cpu"])
    if "rng/cuda" in read["rng"] and stage.device.type == "cuda":
        torch.cuda.set_rng_state(read["rng"]["rng/cuda"], stage.device)
    optimizer.step_count = manifest["optimizer_step"]
    optimizer.param_steps = list(manifest["param_steps"])
    engine.global_step = manifest["global_step"]
    engine.skipped_steps = manifest["skipped_steps"]
    engine.scaler.load_state_dict(_scaler_state(engine, manifest))
    engine.micro_step = 0
    stage.polluted = None


def _scaler_state(engine, manifest: dict) -> dict:
    """The loss scaler state a load leaves in `engine`: the checkpoint's when both it and the engine
    are fp16 (the scale the run learned for these gradients), else a fresh scaler's. An fp32 or bf16
    checkpoint's scale is 1.0, which would let an fp16 engine's small gradients underflow; and an
    engine that is not fp16 scales nothing, whatever the checkpoint's dtype."""
    if engine.scaler.enabled and manifest["dtype"] == "fp16":
        return manifest["scaler"]
    return LossScaler(engine.scaler.enabled, scale=engine.config.initial_loss_scale).state_dict()


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint folder that `path` names: itself if it holds a manifest, else `latest`'s."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    if (path / "latest").is_file():
        tag = (path / "latest").read_text().strip()
        if not re.match(r"^[\w.-]+$", tag) or not (path / tag / "manifest.json").is_file():
            raise CheckpointError(f"{path / 'latest'} names {tag!r}, which is not a complete checkpoint")
        return path / tag
    raise CheckpointError(f"no checkpoint at {path}: it holds neither manifest.json nor latest")


# --- consolidation -------------------------------------------------------------------------------
def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Offline, on CPU, with no process group: glue a checkpoint's pieces into a full fp32 state
    dict, write it to `out/model.safetensors`, and for a Hugging Face model also a
    `save_pretrained` folder `out/hf`. Returns the state dict. A checkpoint saved under model
    parallelism (`path` holds one sub-checkpoint per MP rank, `mp<r>-of-<Nm>`) is glued sub-checkpoint
    by sub-checkpoint, then each split parameter's slices are joined by the split its manifest
    records (model_parallel.py): `out` holds the unsplit model."""
    path = Path(path)
    subs = [] if (path / "manifest.json").is_file() or (path / "latest").is_file() else sub_checkpoints(path)
    if subs:
        glued = [_glue(resolve(sub)) for sub in subs]
        manifest, state = glued[0][0], join_sub_checkpoints(subs, glued)
    else:
        folder = resolve(path)
        manifest, state = _glue(folder)
        refuse_lone_slice(folder, manifest)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "model.safetensors",
                  lambda tmp: save_file({k: v.clone().contiguous() for k, v in state.items()}, str(tmp)))
    if manifest["hf"] is not None:
        _save_pretrained(manifest["hf"], state, out / "hf")
    return state


def _glue(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """One checkpoint folder's (manifest, full fp32 state dict in the model's state_dict order)."""
    manifest = read_manifest(folder)
    handles = {f["rank"]: _open_verified(folder, f) for f in manifest["files"]}
    where = piece_index(manifest)
    values: dict[str, torch.Tensor] = {}
    for p in manifest["params"]:
        full = torch.empty(p["numel"], dtype=torch.float32)
        for start, end, rank in where[p["name"]]:
            full[start:end] = handles[rank].get_tensor(f"master/{p['name']}/{start}")
        for name in [p["name"], *p["aliases"]]:
            values[name] = full.view(p["shape"])
    for p in manifest["frozen"]:
        values[p["name"]] = handles[0].get_tensor(f"frozen/{p['name']}")
    for b in manifest["buffers"]:
        tensor = handles[0].get_tensor(f"buffer/{b['name']}")
        values[b["name"]] = tensor.float() if tensor.is_floating_point() else tensor
    return manifest, {key: values[key] for key in manifest["state_keys"] if key in values}


def _save_pretrained(hf: dict, state: dict[str, torch.Tensor], folder: Path) -> None:
    import transformers

    model_class = getattr(transformers, hf["class"])
    config_class = model_class.config_class
    config = config_class.from_dict(hf["config"])
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        # transformers' save_pretrained writes nothing on a rank other than 0, silently
        raise CheckpointError("the Hugging Face export writes only on global rank 0 (transformers' rule): call "
                              "consolidate on rank 0, or in a process without torch.distributed")
    model = model_class(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint's tensors do not fit {hf['class']}: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    model.save_pretrained(folder)


# --- helpers -------------------------------------------------------------------------------------
def _open_verified(folder: Path, info: dict):
    path = folder / info["file"]
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    if path.stat().st_size != info["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated or altered: {path.stat().st_size} bytes, "
                              f"the manifest says {info['bytes']}")
    if _sha256(path) != info["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its sha256 does not match the manifest")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:
        raise CheckpointError(f"checkpoint file {path} cannot be opened: {err}") from err


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _atomic_write(path: Path, write) -> None:
    """write(tmp_path), fsync, then rename over `path`: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
