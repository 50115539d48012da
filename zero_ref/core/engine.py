"""The training step of every stage: forward, backward, step, in that order.

The engine knows the order of a step; the stage files know what is sharded and what moves:

    out = engine(batch)      the model's forward (floating inputs cast to the model dtype);
                             stage 3 gathers each unit around its root module here
    engine.backward(loss)    backward of loss * loss_scale / grad_accum_steps; the stage reduces
                             gradients during it (stages 0-1 only on the step's last micro-batch)
                             and every reduction of the micro-batch has finished on return
    engine.step()            at a step boundary: the vote (grad_stats.py: norm, non-finite flag,
                             which parameters got a gradient, in one small all-reduce and one host
                             sync), skip on every rank alike if non-finite, clip, fused AdamW on this
                             rank's segments (optim.py), regather (stages 1-2), clear the gradients

Vocabulary: a *group* is parameters laid back to back in one flat buffer padded to a multiple of
Nd (stages 0-2 call their groups *buckets*, stage 3 *units*); a *shard* is rank r's 1/Nd of it; a
*segment* is what this rank's optimizer updates of one group (its shard, or the whole group at
stage 0); a *piece* is the part of one parameter inside one segment.

Everything that protects a step against its caller (ranks that disagree, a failure on one rank,
parameters written from outside) is behind the `Seams` the engine calls (seams.py); the full
contract is docs/contract.md. Phases are labelled for torch.profiler: "zero_ref.forward",
"zero_ref.backward", "zero_ref.optimizer", "zero_ref.after_update" (labels.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..config import ZeroConfig
from ..param_groups import ZeroOptimizer, build_groups
from .comm import Comm, CommLedger
from .grad_stats import GradStats, StepVote
from .in_flight import CollectiveError
from .labels import label
from .precision import LossScaler
from .seams import Seams
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3
from .stage_base import Stage


class Engine:
    """Trains one model with ZeRO stage `config.stage` over a data-parallel process group
    (`zero_ref.initialize` builds it).

    Attributes: `module` (the model), `config`, `stage`, `optimizer` (the parameter groups as a torch
    Optimizer, for lr schedulers), `global_step` (updates applied), `micro_step` (backwards since
    the last update), `loss_scale`, `skipped_steps` (non-finite gradients), `grad_norm` (the L2 norm
    of the averaged gradient the last step used, before clipping and without the loss scale, as
    torch's clip_grad_norm_ returns it; inf after a skipped step; None before the first).
    """

    def __init__(self, model: nn.Module, config: ZeroConfig, process_group, mp_group=None, materializer=None,
                 param_groups=None, refusal: Exception | None = None, seams: Seams | None = None):
        self.module, self.config, self.dtype = model, config, config.torch_dtype
        self.seams = seams or Seams()
        params = list(model.parameters())
        devices = {p.device for p in params} | {b.device for b in model.buffers()}
        if len(devices) > 1 and refusal is None:
            refusal = ValueError(f"the model's tensors must all be on one device, found {sorted(map(str, devices))}")
        # (with several, the one the collectives can serve, to tell every rank of the refusal)
        device = min(devices, key=lambda d: ("cuda", "cpu").index(d.type) if d.type in ("cuda", "cpu") else 2,
                     default=torch.device("cpu"))
        self.ledger = CommLedger()
        self.comm = Comm(process_group, self.ledger, device, config.comm_timeout_s, gather_channel=config.stage == 3)
        self.mp_comm = Comm(mp_group, self.ledger, device, config.comm_timeout_s) \
            if mp_group is not None and torch.distributed.get_world_size(mp_group) > 1 else None
        self.closed = False
        self.broken: str | None = None   # why this engine cannot go on (a guard sets it)
        trainable = [p for p in params if p.requires_grad]
        self.frozen = [p for p in params if not p.requires_grad]
        defaults = {"lr": config.lr, "betas": config.betas, "eps": config.eps, "weight_decay": config.weight_decay}
        groups = self.seams.setup(self, lambda: build_groups(param_groups, model, trainable, defaults), refusal,
                                  materializer is not None)
        self._build(model, trainable, materializer)
        self.optimizer = ZeroOptimizer(self, groups)
        self.grad_stats = GradStats(self.stage, self.comm, self.mp_comm)
        self.scaler = LossScaler(enabled=self.dtype == torch.float16, scale=config.initial_loss_scale,
                                 growth_interval=config.loss_scale_growth_interval, min_scale=config.min_loss_scale)
        self._float_buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.micro_step = 0
        self.global_step = 0
        self.grad_norm: float | None = None
        self.skipped_steps = 0
        self.seams.started(self)

    def _build(self, model: nn.Module, trainable: list[nn.Parameter], materializer) -> None:
        """Give the model values (sharded construction: materialize.py), start every rank from rank
        0's, then lay the trainable parameters into the stage's flat buffers."""
        sharded_construction = materializer is not None and self.config.stage == 3
        if materializer is not None:
            self._start_from_rank0_rng()
            if sharded_construction:   # the stage keeps its shards of each module's values as they appear
                self.stage: Stage = Stage3(model, trainable, self.config, self.comm, materializer)
            else:
                materializer.run()
        with torch.no_grad():
            for tensor in [*self.frozen, *(model.buffers() if self.config.cast_buffers else ())]:
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(self.dtype)
            if self.comm.world_size > 1:   # every rank starts from rank 0's model
                params = [] if sharded_construction else trainable
                for tensor in [*params, *self.frozen, *model.buffers()]:
                    self.comm.broadcast(tensor.data, 0, in_step=False)
        if not sharded_construction:
            self.stage = Stage3(model, trainable, self.config, self.comm) if self.config.stage == 3 else \
                {0: Stage0, 1: Stage1, 2: Stage2}[self.config.stage](trainable, self.config, self.comm)

    def _start_from_rank0_rng(self) -> None:
        """Sharded construction draws initial values on every rank: start them all from rank 0's RNG."""
        if self.comm.world_size == 1:
            return
        states = {"cpu": torch.get_rng_state()}
        if self.comm.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.comm.device)
        states = self.comm.all_gather_object(states)[0]
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"], self.comm.device)

    # --- the training step -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The model's forward. Floating-point tensor inputs are cast to the model dtype."""
        self.check_open()
        self.seams.before_call(self)
        try:
            self.broadcast_buffers()
        except CollectiveError as err:
            raise _needs_every_rank(err, "broadcasts rank 0's buffers first (ZeroConfig.broadcast_buffers)") from err
        cast = lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        args, kwargs = tree_map(cast, (args, kwargs))
        with label("zero_ref.forward"), self.seams.forward_context(self):
            try:
                return self.module(*args, **kwargs)
            except CollectiveError as err:
                raise _needs_every_rank(err, "gathers each unit's parameters" if self.config.stage == 3
                                        else "runs collectives") from err
            except BaseException:
                if torch.is_grad_enabled():
                    self.seams.forward_raised(self)
                raise

    forward = __call__

    def train(self, mode: bool = True) -> "Engine":
        """`module.train(mode)`, as a torch module or DeepSpeed's engine takes it; returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        """`module.eval()` (dropout off, batch norm on its running statistics); returns the engine."""
        return self.train(False)

    def broadcast_buffers(self) -> None:
        """config.broadcast_buffers: every forward starts from rank 0's floating-point buffers."""
        if self.config.broadcast_buffers and self.comm.world_size > 1:
            for buffer in self._float_buffers:
                self.comm.broadcast(buffer.data, 0)

    @property
    def at_boundary(self) -> bool:
        """True when the backwards since the last step complete one (a positive multiple of
        grad_accum_steps)."""
        return self.micro_step > 0 and self.micro_step % self.config.grad_accum_steps == 0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of `loss` (scaled by the fp16 loss scale and 1 / grad_accum_steps). At a step
        boundary every gradient reduction of the step has finished on return. Each call is one
        micro-batch, so two losses of one forward backwarded apart (the first with
        `retain_graph=True`) count two."""
        self.check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward expects the scalar loss tensor of this micro-batch")
        self.check_clean()
        self.seams.before_call(self)
        self.micro_step += 1
        boundary, stage = self.at_boundary, self.stage
        stage.in_backward = True
        try:
            with label("zero_ref.backward"):
                stage.begin_backward(boundary)
                self.seams.run_backward(self, loss * (self.scaler.scale / self.config.grad_accum_steps), retain_graph)
                stage.end_backward(boundary)
        except BaseException as err:   # some gradients may be in, some reductions not: refuse to step
            stage.polluted = stage.polluted or (
                f"engine.backward raised {type(err).__name__}: the gradients since the last step are "
                "incomplete; engine.zero_grad() discards them")
            self.seams.backward_raised(self, err)
            raise
        finally:
            stage.in_backward = False

    @torch.no_grad()
    def step(self) -> bool:
        """At a step boundary, update: True when the parameters changed; False when there was
        nothing to do (mid-accumulation, or no backward since the last step) or the step was
        skipped for non-finite gradients, on every rank alike."""
        self.check_open()
        self.check_clean()
        if not self.at_boundary:
            return False
        self.optimizer._opt_called = True   # what torch's lr_schedulers look for: "the optimizer stepped"
        vote = self.vote(stepping=True)
        self.seams.before_update(self, vote)
        if vote.nonfinite:
            self.grad_norm = math.inf
            return self._skip_step()
        sum_sq = vote.sum_sq
        if not math.isfinite(sum_sq):        # finite gradients whose squares overflow fp32
            total = self.grad_stats.local(vote.grads, fp64=True)
            self.grad_stats.sum(total, mp_slots=[0])
            sum_sq = total.item()
        self.grad_norm = math.sqrt(sum_sq) / self.scaler.scale
        grad_scale = 1.0 / self.scaler.scale
        if self.config.grad_clip is not None:
            grad_scale *= min(1.0, self.config.grad_clip / (self.grad_norm + 1e-6))
        hyper = self.optimizer.hyperparameters()
        try:
            with label("zero_ref.optimizer"):
                self.stage.optimizer.step(vote.grads, grad_scale, [u > 0 for u in vote.used], self.optimizer.group_of,
                                          hyper, self.stage.segment_updated)
            with label("zero_ref.after_update"):
                self.stage.after_update()
        except BaseException as err:
            self.seams.update_raised(self, err)
            raise
        self.seams.after_update(self)
        self.clear_step()
        self.scaler.update(found_overflow=False, step=self.global_step + self.skipped_steps + 1)
        self.global_step += 1
        return True

    def vote(self, stepping: bool = False, discarding: bool = False) -> StepVote:
        """The step's vote (grad_stats.py) with the seams' fields; `stepping`: sent by step(),
        `discarding`: by a call that drops the step."""
        counts, same = self.seams.vote(self, stepping, discarding)
        return self.grad_stats.vote(counts, same, mp_counts=self.seams.mp_counts)

    @property
    def ranks_summed(self) -> int:
        """How many ranks' values a sum over the data-parallel group adds up: a fake group (the
        engine at scale, analysis/at_scale.py) sums nothing, so every "sum" is this rank's own."""
        return 1 if self.comm.backend == "fake" else self.comm.world_size

    def _skip_step(self) -> bool:
        """Non-finite gradients on some rank (the same decision on every rank): change nothing."""
        number = self.global_step + self.skipped_steps + 1
        self.clear_step()
        self.skipped_steps += 1
        if self.scaler.enabled:
            self.scaler.update(found_overflow=True, step=number)   # raises at min_loss_scale
        elif self.config.nonfinite == "error":
            raise FloatingPointError(
                f"non-finite gradient at step {number} (ZeroConfig.nonfinite='error'; set nonfinite='skip' "
                "to skip such steps)")
        return False

    def clear_step(self) -> None:
        """Clear the gradients and the micro-batch count: the next backward starts a new step."""
        self.stage.zero_grads()
        self.micro_step = 0
        self.ledger.close_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last step, but not their place in the step:
        the boundary stays where the backwards since the last update put it, as in a torch loop
        that steps every grad_accum_steps micro-batches. With `set_to_none=False` the parameters
        that got a gradient keep one of zeros, as in torch: at a boundary the step then still
        updates them (weight decay, momentum)."""
        self.check_open()
        keep_boundary = not set_to_none and self.at_boundary and not self.stage.polluted
        if not keep_boundary:
            self.seams.before_call(self, discarding=True)
            self.seams.zero_grad(self)
            self.micro_step %= self.config.grad_accum_steps
        self.stage.zero_grads(keep_used=not set_to_none)
        self.stage.polluted = None

    def check_clean(self) -> None:
        """RuntimeError if the gradients since the last step are unusable (a bare loss.backward(),
        a backward that raised) until zero_grad."""
        if self.stage.polluted:
            raise RuntimeError(self.stage.polluted)

    def check_open(self) -> None:
        """RuntimeError if this engine was closed, broken by a failed update, or lost a collective."""
        if self.closed:
            raise RuntimeError("this ZeroEngine was closed (engine.close()): its hooks are gone, it can no "
                               "longer train, save or report; build a new one with zero_ref.initialize")
        if self.broken:
            raise RuntimeError(self.broken)
        if self.comm.failed or (self.mp_comm is not None and self.mp_comm.failed):
            raise RuntimeError("a collective of this ZeroEngine did not complete earlier (CollectiveError): its "
                               "ranks may be at different points of a step, so it cannot go on. Build a new "
                               "engine with zero_ref.initialize (and load the last checkpoint to resume)")

    # --- inspection ------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def comm_stats(self) -> dict[str, dict[str, int]]:
        """Elements moved per rank by collective kind, for the last step and cumulatively, counted
        as the paper counts (all-reduce of n: 2n; reduce-scatter or all-gather of n: n)."""
        return self.ledger.stats()

    # --- release ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook the engine registered (their communication channels are shared with
        other engines on the same ranks: comm.py). The model keeps its parameters (stage 3: their
        storage stays freed; take full_state_dict() first). Any method but close, memory_report and
        comm_stats then raises. Closing twice is a no-op."""
        if self.closed:
            return
        self.stage.close()
        self.seams.close(self)
        self.closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _needs_every_rank(err: CollectiveError, what: str) -> CollectiveError:
    """The forward's collective did not complete: most often a forward run on some ranks only (an
    evaluation on rank 0), which the error says, with the way to do that."""
    return CollectiveError(
        f"{err}. It was the engine's forward, which {what}, so every rank must run it: to evaluate on "
        "some ranks only, call engine.module(...) under torch.no_grad() there (stages 0-2), or evaluate "
        "on every rank")
