"""initialize() and ZeroEngine: forward, backward and step for any stage.

Vocabulary (every file uses these words exactly so):

    parameter  a trainable nn.Parameter of the model (frozen ones stay whole on every rank)
    group      parameters laid back to back in one flat buffer, padded to a multiple of Nd: what is
               sharded and communicated as one piece. Stages 0-2 call their groups buckets,
               stage 3 calls them units:
    bucket     (stages 0-2) a group of at most `bucket_numel` elements, packed in the order
               backward produces gradients: the paper's constant-size buffer (CB), reduced as soon
               as its gradients are complete
    unit       (stage 3) the parameters of one module subtree, gathered before it runs and freed
               after
    shard      rank r's 1/Nd of a group's flat buffer
    segment    what this rank's optimizer updates of one group: its shard (stages 1-3) or the whole
               group (stage 0); masters, moments and gradient segments are aligned lists
    piece      the part of one parameter inside one segment (checkpoints store pieces)

The engine is the only place that knows the order of a training step; the stage files know what is
sharded and what moves. The step contract:

    out = engine(batch)      the model's forward (floating inputs cast to the model dtype)
    engine.backward(loss)    backward of loss * loss_scale / grad_accum_steps; the stage reduces
                             gradients during it (stages 0-1: only on the step's last micro-batch)
    engine.step()            at a step boundary: gradient norm and overflow flag (one fused pass),
                             one small all-reduce of [sum of squares, flag, which parameters got a
                             gradient, how many left the stage's buffers] and one host sync, skip
                             on every rank alike if non-finite, clip, fused AdamW on this rank's
                             segments of the parameters that got a gradient, regather, clear
                             gradients. True when the parameters changed.

Phases are labelled for torch.profiler (record_function, made only while a profiler records:
labels.py): "zero_ref.forward", "zero_ref.backward",
"zero_ref.optimizer", "zero_ref.after_update" (the regather of stages 1-2) and, in comm.py,
"zero_ref.wait <kind>" wherever the host waits for a collective, so a profile splits a step into
compute and communication waits (experiments/throughput.py).

* A step boundary is reached after a multiple of `grad_accum_steps` backwards since the last update;
  `step()` elsewhere (mid-accumulation, or with no backward since the last step) does nothing and
  returns False, so calling it twice never updates twice.
* Several backwards before a step accumulate, at every stage alike: the update uses the sum of
  their gradients, as torch's optimizers do. `zero_grad()` discards them but keeps their count (a
  boundary stays where it was), as a torch loop that steps every grad_accum_steps micro-batches
  does and as DeepSpeed does.
* A forward, backward or step that raises on some ranks only: every rank raises at the same call
  (ValueError, nothing updated; `zero_grad()` on every rank puts them in step again), or, where a
  step raised while updating, the engine refuses to go on (step_failures.py).
* A bare `loss.backward()` reaches the engine's gradient hooks outside `engine.backward` and
  raises RuntimeError there (it would skip the loss scale and the reductions); the engine then
  refuses to step until `engine.zero_grad()` discards the gradients accumulated since the last step.
* After `initialize` every trainable parameter is a view of the stage's flat buffers. Code that
  replaces a parameter's `.data` (`Module.to(dtype)` to another dtype, `.float()`, `param.data = t`;
  Hugging Face's Switch Transformers router does so in every forward when the model is not in
  `router_dtype`) leaves the model reading a tensor the optimizer never updates: `step()` checks
  every parameter and, if any rank finds one, raises RuntimeError on every rank before anything is
  updated. Write values with `engine.load_state_dict(...)` (any stage, any precision) or in place
  (`model.load_state_dict`, `nn.init`, `with torch.no_grad(): param.copy_(...)`, at stages 0-2):
  the step adopts such writes (in bf16/fp16 into the fp32 master) if every rank wrote the same
  values, and otherwise (some ranks only; nn.Embedding(max_norm=...) renormalising each rank's own
  rows) updates nothing (ValueError on every rank); stage 3 refuses any write made while a unit
  was gathered. A write into `param.data` is invisible to torch's count of in-place writes, so
  in bf16/fp16 the next step overwrites it.
* Which parameters are trainable is fixed at `initialize`. One frozen after it
  (`requires_grad_(False)`) gets no gradient, so no step changes it, as torch's AdamW leaves a
  parameter without one; the engine still holds it, and checkpoints save and load it. One frozen at
  `initialize` and made trainable after it: `step()` raises RuntimeError on every rank.
* A model belongs to one open engine; a stage-3 engine leaves its parameters without values (even
  closed), and reading one outside the forward raises FreedParameterError (sharded_param.py).
  `model.zero_grad()` on the model given to initialize is `engine.zero_grad()` (ownership.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from . import activations

from ..io import checkpoint

from .. import materialize

from ..guard import ownership, param_writes, step_failures
from ..io import state_dict as state_dict_io
from .comm import Comm, CommLedger
from ..config import ZeroConfig
from .grad_stats import GradStats, StepStatistics, detached_message
from .in_flight import CollectiveError
from .labels import label
from .param_groups import ZeroOptimizer, build_groups
from .precision import LossScaler
from ..guard.same_everywhere import check_same_everywhere
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3, refuse_compiled
from .stage_base import Stage

MEMORY_CATEGORIES = ("params", "grads", "optimizer_states", "buffers", "comm_buffers")


def initialize(model: nn.Module, config: ZeroConfig, process_group: dist.ProcessGroup | None = None,
               mesh=None, *, init_fn=None, state_dict=None, device=None, param_groups=None) -> "ZeroEngine":
    """Take ownership of `model` and return the engine that trains it under `config`.

    The model is converted (parameters to `config.dtype`) and partitioned in place: its Parameter
    objects are kept, but their storage becomes views of the stage's flat buffers (stage 3: freed
    until used), so no second full copy stays alive. Rank 0's values are broadcast first, so every
    rank starts from the same model. `process_group` defaults to the default group; world size 1
    works. Every rank of the group must call it, with the same model structure, config and
    param_groups: they are compared first, and any difference raises ValueError on every rank
    (same_everywhere.py).

    With model parallelism pass `mesh`, a 2-D DeviceMesh with dimensions named "dp" and "mp"
    (`init_device_mesh("cpu", (Nd, Nm), mesh_dim_names=("dp", "mp"))`): ZeRO shards over "dp" only;
    the model's layers split over "mp" (tensor_parallel.py) and the gradient norm spans both.

    Sharded construction: a model built under `torch.device("meta")` is given its values here, one
    module at a time, on `device` (default: this rank's CUDA device under NCCL, else the CPU), from
    `state_dict` (any mapping of names to tensors), `init_fn(module)` or each module's
    `reset_parameters()`; at stage 3 each rank keeps only its shards, so the full model never
    exists on any rank (materialize.py).

    `param_groups` takes torch's form, `[{"params": [...], "weight_decay": 0.0}, ...]`: every trainable
    parameter in exactly one group, each group setting any of lr, betas, eps, weight_decay (the
    config's values otherwise). `engine.optimizer` exposes them as a torch Optimizer, so torch's
    lr_scheduler classes drive the learning rate (param_groups.py).
    """
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a zero_ref.ZeroConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call "
                           "torch.distributed.init_process_group('gloo' or 'nccl') before zero_ref.initialize "
                           "(under torchrun the environment provides rank and world size; world size 1 works)")
    mp_group = None
    if mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group (data parallelism only) or mesh (data x model "
                             "parallelism), not both")
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if getattr(mesh, "ndim", None) != 2 or sorted(names) != ["dp", "mp"]:
            raise ValueError(f"mesh must be a 2-D DeviceMesh with dimensions named 'dp' and 'mp', got "
                             f"dimensions {names or None} of shape {tuple(getattr(mesh, 'shape', ()))}")
        process_group, mp_group = mesh.get_group("dp"), mesh.get_group("mp")
    try:   # refused here on some ranks only, it is refused on every rank at the engine's first exchange
        materializer, refusal = _take(model, config, process_group, init_fn, state_dict, device), None
    except ValueError as err:
        materializer, refusal = None, err
    return ZeroEngine(model, config, process_group, mp_group, materializer, param_groups, refusal)


def _take(model: nn.Module, config: ZeroConfig, process_group, init_fn, state_dict, device
          ) -> materialize.Materializer | None:
    """Check that this rank can take `model` (no other open engine holds it; stage 3: not compiled) and
    prepare sharded construction for a model on the meta device; ValueError says why not."""
    ownership.check_not_taken(model)
    if config.stage == 3:
        refuse_compiled(model)
    backend = str(dist.get_backend_config(process_group) if hasattr(dist, "get_backend_config")
                  else dist.get_backend(process_group))
    # a fake process group (at_scale.py) runs the engine on meta tensors on purpose: nothing to materialise
    if materialize.has_meta_tensors(model) and "fake" not in backend:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        return materialize.Materializer(model, device, init_fn, state_dict)
    if init_fn is not None or state_dict is not None:
        raise ValueError("init_fn and state_dict are for models built on the meta device (sharded construction); "
                         "this model already has values (load a state dict into it before initialize, or use "
                         "engine.load_checkpoint)")
    return None


class ZeroEngine:
    """Trains one model with ZeRO stage `config.stage` over a data-parallel process group.

    Attributes: `module` (the model), `config`, `optimizer` (the parameter groups as a torch
    Optimizer, for lr schedulers: param_groups.py), `global_step` (updates applied), `loss_scale`,
    `skipped_steps` (non-finite gradients: fp16 overflows, or nonfinite="skip"), `grad_norm` (the
    L2 norm of the whole averaged gradient the last step() used, before clipping and without the
    fp16 loss scale, as torch's clip_grad_norm_ returns it; inf after a step skipped for a
    non-finite gradient; None before the first; from the step's own statistics, so no extra
    collective or host sync). Usable as a context manager that `close()`s it.
    """

    def __init__(self, model: nn.Module, config: ZeroConfig, process_group: dist.ProcessGroup | None,
                 mp_group: dist.ProcessGroup | None = None, materializer: materialize.Materializer | None = None,
                 param_groups=None, refusal: ValueError | None = None):
        self.module = model
        self.config = config
        self.dtype = config.torch_dtype
        params = list(model.parameters())
        devices = {p.device for p in params} | {b.device for b in model.buffers()}
        if len(devices) > 1 and refusal is None:
            refusal = ValueError(f"the model's tensors must all be on one device, found {sorted(map(str, devices))}")
        # (several: the one the collectives can serve, for the exchange that tells every rank of the refusal)
        device = min(devices, key=lambda d: ("cuda", "cpu").index(d.type) if d.type in ("cuda", "cpu") else 2,
                     default=torch.device("cpu"))
        self.ledger = CommLedger()
        self.comm = Comm(process_group, self.ledger, device, config.comm_timeout_s, gather_channel=config.stage == 3)
        self.mp_comm = Comm(mp_group, self.ledger, device, config.comm_timeout_s) \
            if mp_group is not None and dist.get_world_size(mp_group) > 1 else None
        self.closed = False
        self.broken: str | None = None   # why this engine cannot go on (step_failures.step_raised)
        trainable = [p for p in params if p.requires_grad]
        self.frozen = [p for p in params if not p.requires_grad]
        defaults = {"lr": config.lr, "betas": config.betas, "eps": config.eps, "weight_decay": config.weight_decay}
        groups = check_same_everywhere(   # before anything changes: on every rank alike
            model, self.comm, config, lambda: build_groups(param_groups, model, trainable, defaults), refusal,
            from_meta=materializer is not None)
        sharded_construction = materializer is not None and config.stage == 3
        if materializer is not None:
            self._start_from_rank0_rng(device)
            if sharded_construction:   # the stage keeps its shards of each module's values as they appear
                self.stage: Stage = Stage3(model, trainable, config, self.comm, materializer)
            else:
                materializer.run()
        with torch.no_grad():
            cast = [*self.frozen, *(model.buffers() if config.cast_buffers else ())]
            for tensor in cast:
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(self.dtype)
            if self.comm.world_size > 1:   # every rank starts from rank 0's model
                whole = [*self.frozen, *model.buffers()] if sharded_construction else [*params, *model.buffers()]
                for tensor in whole:
                    self.comm.broadcast(tensor.data, 0, in_step=False)
        if not sharded_construction:
            self.stage = _make_stage(model, trainable, config, self.comm)
        self.optimizer = ZeroOptimizer(self, groups)
        self.grad_stats = GradStats(self.stage, self.comm, self.mp_comm)
        self.scaler = LossScaler(enabled=self.dtype == torch.float16, scale=config.initial_loss_scale,
                                 growth_interval=config.loss_scale_growth_interval,
                                 min_scale=config.min_loss_scale)
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.micro_step = 0   # backwards since the last update (zero_grad keeps it modulo grad_accum_steps)
        self.global_step = 0
        self.grad_norm: float | None = None   # the last step's global gradient norm (see the class docstring)
        self._skipped_steps = 0
        self._failed_at = 0   # the micro-batch of this step at which a forward or backward raised (0: none)
        self._discarded_mid_step = False   # zero_grad() dropped gradients of this step's earlier micro-batches
        self._boundary_unchecked = False   # a backward reached a step boundary and no step() followed yet
        ownership.take(self, model)   # one open engine per model; model.zero_grad() is engine.zero_grad()
        self.stage.note_param_writes()

    def _start_from_rank0_rng(self, device: torch.device) -> None:
        """Sharded construction draws initial values on every rank: start them all from rank 0's RNG."""
        if self.comm.world_size == 1:
            return
        states = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(device)
        states = self.comm.all_gather_object(states)[0]
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"], device)

    # --- the training step -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The model's forward. Floating-point tensor inputs are cast to the model dtype."""
        self._check_open()
        step_failures.check_nobody_failed_at_the_boundary(self)
        try:
            self._broadcast_buffers()
        except CollectiveError as err:
            raise self._forward_needs_every_rank(err, "broadcasts rank 0's buffers first (ZeroConfig."
                                                      "broadcast_buffers)") from err
        cast = lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        args, kwargs = tree_map(cast, (args, kwargs))
        with label("zero_ref.forward"), self.stage.forward_context():
            try:
                return self.module(*args, **kwargs)
            except CollectiveError as err:
                raise self._forward_needs_every_rank(err, "gathers each unit's parameters" if self.config.stage == 3
                                                     else "runs collectives") from err
            except BaseException:   # a rank that skips this micro-batch must not pass unnoticed
                if torch.is_grad_enabled():
                    step_failures.forward_raised(self)
                raise

    forward = __call__

    def train(self, mode: bool = True) -> "ZeroEngine":
        """`module.train(mode)`, as a torch module or DeepSpeed's engine takes it; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        """`module.eval()` (dropout off, batch norm on its running statistics); returns the engine."""
        return self.train(False)

    def _forward_needs_every_rank(self, err: CollectiveError, what: str) -> CollectiveError:
        """The forward's collective did not complete: most often a forward run on some ranks only
        (an evaluation on rank 0), which the error says, with the way to do that."""
        return CollectiveError(
            f"{err}. It was the engine's forward, which {what}, so every rank must run it: to evaluate on "
            "some ranks only, call engine.module(...) under torch.no_grad() there (stages 0-2), or evaluate "
            "on every rank")

    def _broadcast_buffers(self) -> None:
        """config.broadcast_buffers: every forward starts from rank 0's floating-point buffers."""
        if self.config.broadcast_buffers and self.comm.world_size > 1:
            for buffer in self._float_buffers:
                self.comm.broadcast(buffer.data, 0)

    @property
    def at_boundary(self) -> bool:
        """True when the backwards since the last step complete a step (a positive multiple of
        grad_accum_steps)."""
        return self.micro_step > 0 and self.micro_step % self.config.grad_accum_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of `loss` (scaled by the fp16 loss scale and 1 / grad_accum_steps). At a step
        boundary every gradient reduction of the step has finished on return. Each call is one
        micro-batch of the count toward grad_accum_steps, so two losses of one forward backwarded
        apart (the first with `retain_graph=True`, as torch's `loss.backward` takes it) count two."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects the scalar loss tensor of this micro-batch")
        self._check_clean()
        step_failures.check_nobody_failed_at_the_boundary(self)
        self.micro_step += 1
        boundary = self.at_boundary
        stage = self.stage
        stage.in_backward = True
        try:
            with label("zero_ref.backward"):
                stage.begin_backward(boundary)
                stage.run_backward(loss * (self.scaler.scale / self.config.grad_accum_steps), retain_graph)
                stage.end_backward(boundary)
            self._boundary_unchecked = boundary
        except BaseException as err:   # some gradients may be in, some reductions not: refuse to step
            step_failures.backward_raised(self, err)   # raises ValueError if the failure was not every rank's
            raise
        finally:
            stage.in_backward = False

    @torch.no_grad()
    def step(self) -> bool:
        """Apply the update if the backwards since the last step complete one (see the contract in
        the module docstring). Returns True when parameters were updated; False when there was
        nothing to do or the step was skipped (non-finite gradients)."""
        self._check_open()
        self._check_clean()
        if not self.at_boundary:
            return False
        self.optimizer._opt_called = True   # what torch's lr_schedulers look for: "the optimizer stepped"
        stage, optimizer = self.stage, self.stage.optimizer
        summed = self._step_statistics(stepping=True)
        step_failures.refuse_if_the_ranks_failed_apart(self, summed)
        step_failures.refuse_unless_every_rank_steps(self, summed)
        step_failures.refuse_if_some_ranks_discarded(self, summed)
        if summed.detached_anywhere:
            raise RuntimeError(detached_message(self.module, self.dtype, summed.detached, summed.unfrozen))
        if summed.hyper_error or summed.disagreement:
            raise summed.hyper_error or ValueError(summed.disagreement)
        param_writes.adopt_or_refuse(self, summed.written)
        sum_sq, nonfinite, used, grads = summed.sum_sq, summed.nonfinite, summed.used, summed.grads
        if nonfinite:
            self.grad_norm = math.inf
            return self._skip_step()
        if not math.isfinite(sum_sq):        # finite gradients whose squares overflow fp32
            total = self.grad_stats.local(grads, fp64=True)
            self.grad_stats.sum(total)
            sum_sq = total.item()
        self.grad_norm = math.sqrt(sum_sq) / self.scaler.scale
        grad_scale = 1.0 / self.scaler.scale
        if self.config.grad_clip is not None:
            grad_scale *= min(1.0, self.config.grad_clip / (self.grad_norm + 1e-6))
        try:
            with label("zero_ref.optimizer"):
                optimizer.step(grads, grad_scale, [u > 0 for u in used], self.optimizer.group_of, summed.hyper,
                               stage.segment_updated)
            with label("zero_ref.after_update"):
                stage.after_update()
        except BaseException as err:
            step_failures.step_raised(self, err)
            raise
        stage.note_param_writes()
        self._clear_step()
        self.scaler.update(found_overflow=False, step=self.global_step + self._skipped_steps + 1)
        self.global_step += 1
        return True

    def _step_statistics(self, stepping: bool = False, discarding: bool = False) -> StepStatistics:
        """The step's one statistics all-reduce (grad_stats.py); it carries the micro-batch of this
        step at which this rank's forward or backward raised and whether a zero_grad() dropped
        gradients of its earlier micro-batches, which are then forgotten, and whether step() sends it
        (`stepping`) or a call that drops the step (`discarding`)."""
        failed_at, self._failed_at = self._failed_at, 0
        discarded, self._discarded_mid_step = self._discarded_mid_step, False
        self._boundary_unchecked = False
        with torch.no_grad():
            return self.grad_stats.step_statistics(self.optimizer, self.frozen, failed_at, self._ranks_summed,
                                                   stepping, discarding, discarded)

    @property
    def _ranks_summed(self) -> int:
        """How many ranks' values a sum over the data-parallel group adds up: a fake group (the
        engine at scale, at_scale.py) sums nothing, so every "sum" is this rank's own value."""
        return 1 if self.comm.backend == "fake" else self.comm.world_size

    def _skip_step(self) -> bool:
        """Non-finite gradients on some rank (the same decision on every rank): change nothing."""
        number = self.global_step + self._skipped_steps + 1
        self._clear_step()
        self._skipped_steps += 1
        if self.scaler.enabled:
            self.scaler.update(found_overflow=True, step=number)   # raises at min_loss_scale
        elif self.config.nonfinite == "error":
            raise FloatingPointError(
                f"non-finite gradient at step {number} (ZeroConfig.nonfinite='error'; set nonfinite='skip' "
                "to skip such steps)")
        return False

    def _clear_step(self) -> None:
        self.stage.zero_grads()
        self.micro_step = 0
        self.ledger.close_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last step (also after a bare loss.backward()),
        but not their place in the step: the boundary stays where the backwards since the last update
        put it, as in a torch loop that steps every grad_accum_steps micro-batches. `model.zero_grad()`
        and `engine.optimizer.zero_grad()` call it. As in torch, `set_to_none=False` leaves the
        parameters that got a gradient with one of zeros: the step updates them even if no later
        micro-batch reaches them (weight decay, momentum); by default it updates only those that do.
        So at a step boundary `set_to_none=False` keeps the boundary, and step() then updates them
        with zero gradients, as torch's AdamW does; by default the step is dropped. Called on some
        ranks only in the middle of a step's micro-batches, the ranks would hold gradients of
        different micro-batches: that step raises ValueError on every rank (step_failures.py)."""
        self._check_open()
        keep_boundary = not set_to_none and self.at_boundary and not self.stage.polluted
        if not keep_boundary:
            step_failures.check_nobody_failed_at_the_boundary(self, discarding=True)
            self._discarded_mid_step |= self.micro_step % self.config.grad_accum_steps != 0
            self.micro_step %= self.config.grad_accum_steps
        self.stage.zero_grads(keep_used=not set_to_none)
        self.stage.polluted = None

    def _check_clean(self) -> None:
        if self.stage.polluted:
            raise RuntimeError(self.stage.polluted)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this ZeroEngine was closed (engine.close()): its hooks are gone, it can no "
                               "longer train, save or report; build a new one with zero_ref.initialize")
        if self.broken:
            raise RuntimeError(self.broken)
        if self.comm.failed or (self.mp_comm is not None and self.mp_comm.failed):
            raise RuntimeError("a collective of this ZeroEngine did not complete earlier (CollectiveError): its "
                               "ranks may be at different points of a step, so it cannot go on. Build a new "
                               "engine with zero_ref.initialize (and load the last checkpoint to resume)")

    def _open_collective_call(self, call: str, discarding: bool = False) -> None:
        """The start of a collective call that training does not make (comm.CALLS): the step
        statistics first if this rank stopped at a boundary without stepping (so a rank that calls
        it where the others step meets them there: step_failures.py), then the call's name on the
        calls channel (a call made on some ranks only waits there alone: comm.py)."""
        self._check_open()
        step_failures.check_nobody_failed_at_the_boundary(self, discarding)
        self.comm.announce(call)

    # --- checkpoints ---------------------------------------------------------------------------------
    def save_checkpoint(self, path, keep: int = 2, lr_scheduler=None):
        """Write a sharded checkpoint under the folder `path` (every rank calls it; see checkpoint.py),
        with the parameter groups' hyper-parameters and, if given, `lr_scheduler`'s state. Returns the
        new checkpoint's folder; `path/latest` names it once it is complete."""
        self._open_collective_call("save_checkpoint")
        param_writes.adopt_or_refuse(self)
        return checkpoint.save_checkpoint(self, self._mp_path(path), keep, lr_scheduler)

    def load_checkpoint(self, path, lr_scheduler=None) -> None:
        """Load a checkpoint written at any world size and stage (every rank calls it), and the state
        of `lr_scheduler` if given. Every rank verifies what it reads, then all vote: a failure
        anywhere changes nothing anywhere. The step in progress, if any, is dropped."""
        self._open_collective_call("load_checkpoint", discarding=True)
        checkpoint.load_checkpoint(self, self._mp_path(path), lr_scheduler)
        self._discarded_mid_step = False   # the step it dropped

    def _mp_path(self, path):
        """With model parallelism each MP rank's slice of the model is its own sharded checkpoint,
        in `path/mp<rank>-of-<Nm>` (so it loads at the same Nm, any data-parallel size)."""
        if self.mp_comm is None:
            return path
        return Path(path) / f"mp{self.mp_comm.rank}-of-{self.mp_comm.world_size}"

    # --- inspection ------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was non-finite (fp16 overflow, or nonfinite='skip')."""
        return self._skipped_steps

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Give the model new values after initialize ({name: tensor of full shape}, the same on every
        rank: a torch state_dict or what full_state_dict returned; under model parallelism the
        unsplit model's, or this MP rank's slices). Each rank copies its own pieces
        into the fp32 master weights, then the parameters are rewritten from them; the optimizer's
        moments and step counts are kept. The way to write values in bf16/fp16, where training reads
        the master, not the parameter (a write into `param.data` would be lost at the next step), and
        at stage 3, where a parameter has no values outside the forward. Checked before anything changes:
        every parameter present (a tied one under any of its names, equal under each), shapes as the
        model's, no unknown key, and the same values on every rank; a state dict refused on one rank
        is refused on every rank (state_dict.py)."""
        self._open_collective_call("load_state_dict")
        state_dict_io.load_state_dict(self, state_dict)

    def full_state_dict(self, rank0_only: bool = False, device: str | torch.device = "cpu"
                        ) -> dict[str, torch.Tensor]:
        """{name: fp32 tensor of full shape on `device`} for every parameter (a tied weight under each
        of its names) plus persistent buffers, from the fp32 master weights. Collective: every rank
        calls it. Groups are gathered one at a time over the data-parallel group, so the engine's
        device holds at most one full group beyond its shards; under model parallelism each split
        parameter's slices are then all-gathered over the MP group and joined by its layer's split,
        so the dict is the unsplit model's (io/model_parallel.py). With `rank0_only` only rank 0
        returns the dict (under MP: DP and MP rank 0, global rank 0 in a mesh from init_device_mesh;
        only its MP group holds a copy) and the others return {}."""
        self._open_collective_call("full_state_dict")
        param_writes.adopt_or_refuse(self)
        return state_dict_io.full_state_dict(self, rank0_only, torch.device(device))

    def memory_report(self) -> dict[str, int]:
        """Bytes of live tensor storage on this rank by category (each storage counted once):
        params, grads, optimizer_states (the paper's model states), buffers (the model's),
        comm_buffers (constant-size gradient buckets kept for reuse: the paper's CB),
        activation_checkpoints (saved block inputs now alive, activations.py) and their total;
        activation_checkpoints_host: checkpoints offloaded to host memory (Pa+cpu), not in total;
        activation_checkpoints_arena: the part of those two held in MD's contiguous arenas."""
        tensors = self.stage.memory_tensors()
        tensors["params"] = [*tensors["params"], *self.frozen]
        tensors["buffers"] = list(self.module.buffers())
        seen: set[int] = set()
        report = {}
        for category in MEMORY_CATEGORIES:
            total = 0
            for tensor in tensors[category]:
                storage = tensor.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    total += storage.nbytes()
            report[category] = total
        saved = activations.model_checkpoints(self.module)
        report["activation_checkpoints"] = sum(c.device_bytes for c in saved)
        report["total"] = sum(report.values())
        report["activation_checkpoints_host"] = sum(c.host_bytes for c in saved)
        report["activation_checkpoints_arena"] = sum(c.arena.nbytes() for c in saved if c.arena is not None)
        return report

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Elements moved per rank by collective kind, for the last step and cumulatively, counted
        as the paper counts (all-reduce of n: 2n; reduce-scatter or all-gather of n: n)."""
        return self.ledger.stats()

    # --- release ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook the engine registered and give its communication channels back (they
        are shared with the other engines on the same ranks, see comm.py). The model keeps its
        parameters (stage 3: their storage stays freed; take full_state_dict() first). Any method
        but close, memory_report and comm_stats then raises. Closing twice is a no-op."""
        if self.closed:
            return
        self.stage.close()
        ownership.release(self.module)
        self.closed = True

    def __enter__(self) -> "ZeroEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _make_stage(model: nn.Module, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm) -> Stage:
    if config.stage == 3:
        return Stage3(model, trainable, config, comm)
    return {0: Stage0, 1: Stage1, 2: Stage2}[config.stage](trainable, config, comm)

