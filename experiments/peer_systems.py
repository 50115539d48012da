"""The contenders of the peers study (experiments/peers.py) and what runs inside their ranks.

Every contender trains the same model (``tiny_gpt2`` with one seed, fp32), with the same AdamW
hyper-parameters and the same batches, in its own processes (one ``zero_ref.launch.RankPool`` each,
its own gloo process group). What each one is:

=========================  =====  ========================================================================
contender                  stage  what runs
=========================  =====  ========================================================================
ddp                        0      DistributedDataParallel (bucket_cap_mb = bucket_numel fp32) + torch AdamW
zero-redundancy-optimizer  1      the same DDP + torch's ZeroRedundancyOptimizer(optimizer_class=AdamW)
fsdp2-no-reshard           2      FSDP2 ``fully_shard`` per GPT-2 block and the root, reshard_after_forward=False
fsdp2-reshard              3      the same with reshard_after_forward=True (FSDP2's default)
deepspeed-1, -2, -3        1-3    DeepSpeed ZeRO at its defaults, torch's AdamW as its client optimizer
deepspeed-1-reduce, -2-..  1-2    + ``use_multi_rank_bucket_allreduce: false``: each bucket slice is reduced
                                  to its owner (``dist.reduce``) instead of all buckets all-reduced
deepspeed-3-release        3      + ``stage3_max_live_parameters``, ``stage3_max_reuse_distance`` and
                                  ``stage3_param_persistence_threshold`` 0 (release every parameter after
                                  use, keep none whole), ``reduce_bucket_size`` and
                                  ``stage3_prefetch_bucket_size`` = bucket_numel (its default: 5e8 and 5e7)
zero-ref-0 .. zero-ref-3   0-3    ``zero_ref.initialize(model, ZeroConfig(stage, "fp32", kernels="torch"))``
=========================  =====  ========================================================================

The optimizer is ``torch.optim.AdamW(foreach=True)`` everywhere but zero-ref, which applies the same
update operation for operation on its flat shards (zero_ref/optim.py). DeepSpeed gets torch's
AdamW as a client optimizer (``zero_allow_untested_optimizer``) and runs it on its flat fp32
partitions, so the maths is torch's; every DeepSpeed variant also gets ``gradient_clipping: 0``
(DeepSpeed's default clips the gradient norm to 1.0, which no other contender does: the losses then
part by 1e-4 within four steps). Its shared-memory all-reduce kernel is not JIT-compiled (see
``_deepspeed_engine``).

What a rank measures (``PeerRank``), the same way for every contender:

* time: each step after a barrier, ``time.perf_counter`` around forward + loss, backward and the
  optimizer step (gradients cleared), on every rank; the driver takes the slowest rank's.
* elements moved: ``zero_ref.analysis.collective_count.CountCollectives``, a TorchDispatchMode that sees
  every c10d op whoever issued it (DDP's C++ reducer, FSDP2, DeepSpeed's comm layer, zero-ref) and
  counts floating-point elements per rank the paper's way, including the forms only the peers use
  (``reduce`` to one rank: n, a reduce-scatter piece; list and coalesced forms). Counted on one warm-up
  step (a dispatch mode slows every op), never on a timed one.
* live bytes: every tensor storage the contender allocates from building the model on (before the
  data, which is made first and not counted) is recorded as in ``zero_ref.analysis.alloc_trace`` (a dispatch
  mode sees each op's output storage, a weak reference its free, ``UntypedStorage.resize_`` is
  patched) until the end of the warm-up; the storage inside a tensor subclass (FSDP2's DTensor) is
  the one counted. Read on the measured warm-up step: at its start (at rest), after backward
  (before the optimizer step: parameters, gradients and optimizer states all alive: the moment the
  paper's formula describes) and its peak (with the activations, the same for every contender).
  What is not a tensor (gloo's own buffers, Python objects) is not counted.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from zero_ref.analysis.alloc_trace import AllocationTrace, _Recorder
from zero_ref.analysis.collective_count import CountCollectives
from zero_ref.models import lm_loss, tiny_gpt2, token_batches


# --- the study's fixed inputs -------------------------------------------------------------------
def block_numel(hidden: int) -> int:
    """Elements of one GPT-2 block of width `hidden`: 12 h² + 13 h (attention 4 h² + 4 h, MLP 8 h² + 5 h,
    two LayerNorms 4 h). The timed runs' bucket_numel: one block is one bucket and one reduction (at
    12 h², a few elements short of it, each block's reduce-scatter split off a second collective of
    13 h / Nd columns), and at stage 3 one unit."""
    return 12 * hidden**2 + 13 * hidden


@dataclass(frozen=True)
class Setup:
    """Model, data and optimizer, the same for every contender (pickled to the ranks)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 8192
    seq: int = 128
    batch: int = 16                  # global batch (sequences), split evenly over the ranks
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    seed: int = 0
    bucket_numel: int = block_numel(256)  # zero-ref's bucket_numel, DDP's bucket, DeepSpeed release buckets
    steps: int = 22                  # every step the contender will run (warm-up included)

    def model(self) -> torch.nn.Module:
        return tiny_gpt2(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads, vocab_size=self.vocab,
                         n_positions=self.seq, seed=self.seed)


def unique_numel(model: torch.nn.Module) -> int:
    """Ψ: elements of the model's trainable parameters, each shared tensor once (lm_head is wte)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)   # parameters() dedups


# --- the contenders -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Contender:
    name: str
    stage: int                        # the ZeRO stage whose formulas it is compared with
    library: str                      # "torch", "deepspeed" or "zero_ref"
    what: str                         # one line for the table
    settings: dict = field(default_factory=dict)   # what we set beyond the library's defaults

    def missing(self) -> str | None:
        """Why this contender cannot run here (None: it can)."""
        if self.library == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            return 'deepspeed is not installed (pip install -e ".[peers]")'
        if self.name.startswith("fsdp2"):
            try:
                from torch.distributed.fsdp import fully_shard  # noqa: F401
            except ImportError:
                return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2)"
        return None


_DS_REDUCE = {"use_multi_rank_bucket_allreduce": False}
_DS_RELEASE = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
               "stage3_param_persistence_threshold": 0, "reduce_bucket_size": "bucket_numel",
               "stage3_prefetch_bucket_size": "bucket_numel"}

CONTENDERS = {c.name: c for c in [
    Contender("ddp", 0, "torch", "DistributedDataParallel + AdamW(foreach)", {"bucket_cap_mb": "bucket_numel"}),
    Contender("zero-ref-0", 0, "zero_ref", "zero_ref stage 0", {"bucket_numel": "bucket_numel"}),
    Contender("zero-redundancy-optimizer", 1, "torch", "DDP + ZeroRedundancyOptimizer(AdamW)",
              {"bucket_cap_mb": "bucket_numel"}),
    Contender("deepspeed-1", 1, "deepspeed", "DeepSpeed ZeRO-1, defaults"),
    Contender("deepspeed-1-reduce", 1, "deepspeed", "DeepSpeed ZeRO-1, reduce to owner", _DS_REDUCE),
    Contender("zero-ref-1", 1, "zero_ref", "zero_ref stage 1", {"bucket_numel": "bucket_numel"}),
    Contender("fsdp2-no-reshard", 2, "torch", "FSDP2, reshard_after_forward=False",
              {"reshard_after_forward": False}),
    Contender("deepspeed-2", 2, "deepspeed", "DeepSpeed ZeRO-2, defaults"),
    Contender("deepspeed-2-reduce", 2, "deepspeed", "DeepSpeed ZeRO-2, reduce to owner", _DS_REDUCE),
    Contender("zero-ref-2", 2, "zero_ref", "zero_ref stage 2", {"bucket_numel": "bucket_numel"}),
    Contender("fsdp2-reshard", 3, "torch", "FSDP2, reshard_after_forward=True", {"reshard_after_forward": True}),
    Contender("deepspeed-3", 3, "deepspeed", "DeepSpeed ZeRO-3, defaults"),
    Contender("deepspeed-3-release", 3, "deepspeed", "DeepSpeed ZeRO-3, release after use", _DS_RELEASE),
    Contender("zero-ref-3", 3, "zero_ref", "zero_ref stage 3", {"bucket_numel": "bucket_numel"}),
]}
"""name -> Contender, in table order (by stage). "bucket_numel" in settings: Setup.bucket_numel."""


def resolved_settings(contender: Contender, setup: Setup) -> dict:
    """The contender's settings with "bucket_numel" replaced by the number (DDP: in MB)."""
    out = {}
    for key, value in contender.settings.items():
        if value == "bucket_numel":
            value = setup.bucket_numel * 4 / 2**20 if key == "bucket_cap_mb" else setup.bucket_numel
        out[key] = value
    return out


# --- the systems: forward, backward, step --------------------------------------------------------
def _adamw(params, setup: Setup) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=setup.lr, betas=setup.betas, eps=setup.eps,
                             weight_decay=setup.weight_decay, foreach=True)


class TorchSystem:
    """A module and a torch optimizer: DDP, DDP + ZeroRedundancyOptimizer, FSDP2."""

    def __init__(self, module, optimizer):
        self.module, self.optimizer = module, optimizer

    def forward(self, tokens):
        return self.module(tokens)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class EngineSystem:
    """An engine with forward, backward(loss) and step(): zero_ref's and DeepSpeed's."""

    def __init__(self, engine):
        self.engine = engine

    def forward(self, tokens):
        return self.engine(tokens)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()


def build(contender: Contender, model: torch.nn.Module, setup: Setup, world_size: int):
    """Wrap `model` (already on every rank with the same values) as `contender`."""
    settings = resolved_settings(contender, setup)
    name = contender.name
    if name in ("ddp", "zero-redundancy-optimizer"):
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model, bucket_cap_mb=settings["bucket_cap_mb"])
        if name == "ddp":
            return TorchSystem(module, _adamw(module.parameters(), setup))
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, lr=setup.lr,
                                            betas=setup.betas, eps=setup.eps, weight_decay=setup.weight_decay,
                                            foreach=True)
        return TorchSystem(module, optimizer)
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=settings["reshard_after_forward"])
        fully_shard(model, mesh=mesh, reshard_after_forward=settings["reshard_after_forward"])
        return TorchSystem(model, _adamw(model.parameters(), setup))
    if contender.library == "deepspeed":
        return EngineSystem(_deepspeed_engine(model, contender.stage, settings, setup, world_size))
    if contender.library == "zero_ref":
        import zero_ref

        config = zero_ref.ZeroConfig(stage=contender.stage, dtype="fp32", kernels="torch", lr=setup.lr,
                                     betas=setup.betas, eps=setup.eps, weight_decay=setup.weight_decay,
                                     bucket_numel=settings["bucket_numel"])
        return EngineSystem(zero_ref.initialize(model, config))
    raise ValueError(f"unknown contender {name!r}")


def deepspeed_config(stage: int, settings: dict, setup: Setup, world_size: int) -> dict:
    """The config dict handed to deepspeed.initialize. DeepSpeed clips the gradient norm to 1.0 by
    default (``gradient_clipping``); no other contender clips, so it is set to 0 (off)."""
    return {"train_micro_batch_size_per_gpu": setup.batch // world_size, "gradient_accumulation_steps": 1,
            "train_batch_size": setup.batch, "zero_optimization": {"stage": stage, **settings},
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False}


def _deepspeed_engine(model, stage: int, settings: dict, setup: Setup, world_size: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401  (the module; deepspeed.comm.torch is the torch package)
    from deepspeed.utils import logger

    # On CPU, DeepSpeed's comm backend JIT-compiles a shared-memory all-reduce kernel (ninja and a
    # C++ compiler, minutes on first use) that only its tensor-parallel inference layers call; the
    # training step talks through torch.distributed without it, so it is not built.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model.parameters(), setup),
                                      config=deepspeed_config(stage, settings, setup, world_size))
    return engine


def versions() -> dict:
    """torch's and each peer library's version (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for package in ("deepspeed", "transformers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


# --- what is alive -------------------------------------------------------------------------------
def _inner_tensors(tensor: torch.Tensor):
    """The plain tensors that hold a tensor's storage: itself, or a subclass's inner tensors
    (a DTensor's local shard)."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _inner_tensors(inner)
    else:
        yield tensor


class _LiveRecorder(_Recorder):
    """zero_ref.analysis.alloc_trace's recorder, also seeing the storage inside tensor subclasses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for tensor in _inner_tensors(leaf):
                    if tensor.device.type != "meta":
                        self.see(tensor.untyped_storage())
        return out


class LiveBytes:
    """Records every storage allocated and freed from `start()` to `stop()`; `live()` is the bytes
    allocated and not freed now, `peak_since(mark)` the most that were alive since `mark()`."""

    def __init__(self):
        self.trace = AllocationTrace()
        self.recorder = _LiveRecorder(self.trace, None)
        self.original_resize = None

    def start(self, already_alive=()) -> None:
        """Start recording; the storages of `already_alive` (tensors made before) are never counted."""
        self.recorder.already_alive(already_alive)
        self.original_resize = original = torch.UntypedStorage.resize_
        recorder = self.recorder

        def resize_(storage, size):
            old = storage.nbytes()
            result = original(storage, size)
            recorder.resized(storage, old)
            return result

        torch.UntypedStorage.resize_ = resize_
        self.recorder.__enter__()

    def stop(self) -> None:
        if self.original_resize is not None:
            self.recorder.__exit__(None, None, None)
            torch.UntypedStorage.resize_ = self.original_resize
            self.recorder.recording = False
            self.original_resize = None

    def live(self) -> int:
        return sum(nbytes for _, nbytes in self.trace.events)

    def mark(self) -> int:
        return len(self.trace.events)

    def peak_since(self, mark: int) -> int:
        live = sum(nbytes for _, nbytes in self.trace.events[:mark])
        peak = live
        for _, nbytes in self.trace.events[mark:]:
            live += nbytes
            peak = max(peak, live)
        return peak


# --- what each rank runs -------------------------------------------------------------------------
class PeerRank:
    """One rank of one contender (the RankPool factory): builds the model and the system under the
    allocation recorder, then runs steps on request. Step i always trains on batch i."""

    def __init__(self, rank: int, world_size: int, name: str, setup: Setup):
        self.rank, self.world_size, self.setup = rank, world_size, setup
        # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor; the peers still call the old names
        warnings.filterwarnings("ignore", message=r".*is deprecated. Please use `torch.distributed", category=FutureWarning)
        self.contender = CONTENDERS[name]
        batches = token_batches(setup.vocab, setup.batch, setup.seq, rank, world_size, seed=setup.seed + 1)
        self.batches = [next(batches)[1] for _ in range(setup.steps)]   # made first: not counted
        # the contender from the initial weights, every allocation recorded from here on
        self.live = LiveBytes()
        self.live.start(already_alive=self.batches)   # the data is the harness's, not the contender's
        model = setup.model()
        self.psi = unique_numel(model)
        self.system = build(self.contender, model, setup, world_size)
        dist.barrier()
        self.built_bytes = self.live.live()

    def step(self, i: int, measure: bool = False) -> dict:
        """Train on batch i; time forward (incl. loss), backward and the optimizer step. With
        `measure`: also count the collectives and read live bytes (a slower step: not for timing)."""
        tokens = self.batches[i]
        dist.barrier()
        counter = CountCollectives() if measure else contextlib.nullcontext()
        if measure:
            gc.collect()   # storages held only by dead reference cycles are freed now, not at random
        at_rest, mark = (self.live.live(), self.live.mark()) if measure else (None, None)
        with counter:
            t0 = time.perf_counter()
            loss = lm_loss(self.system.forward(tokens).logits, tokens)
            t1 = time.perf_counter()
            self.system.backward(loss)
            t2 = time.perf_counter()
            if measure:
                gc.collect()
            # minus the loss this harness holds until .item() below (every contender alike)
            after_backward = self.live.live() - loss.untyped_storage().nbytes() if measure else None
            self.system.step()
            t3 = time.perf_counter()
        value = loss.item()
        del loss
        out = {"step": i, "loss": value, "step_s": t3 - t0, "forward_s": t1 - t0, "backward_s": t2 - t1,
               "optimizer_s": t3 - t2}
        if measure:
            out.update(moved=dict(counter.moved), calls=dict(counter.calls), psi=self.psi, at_rest_bytes=at_rest,
                       after_backward_bytes=after_backward, peak_bytes=self.live.peak_since(mark),
                       after_step_bytes=self.live.live(), built_bytes=self.built_bytes)
        return out

    def stop_recording(self) -> None:
        """End the allocation record (after the measured step), so timed steps run at full speed."""
        self.live.stop()

    def threads(self) -> int:
        return torch.get_num_threads()

