"""The training step of every stage: forward, backward, step, in that order.

    out = engine(batch)      the model's forward (floating inputs cast to the model dtype);
                             stage 3 gathers each unit around its root module here
    engine.backward(loss)    backward of loss * loss_scale / grad_accum_steps; the stage reduces
                             gradients during it (stages 0-1 on the step's last micro-batch only)
                             and every reduction of the micro-batch has finished on return
    engine.step()            at a step boundary: the vote (optim.GradStats: norm, non-finite flag,
                             which parameters got a gradient; one small all-reduce, one host sync),
                             skip on every rank alike if non-finite, clip, fused AdamW on this
                             rank's segments, regather (stages 1-2), clear the gradients

Vocabulary: a *group* is parameters laid back to back in one flat buffer padded to a multiple of
Nd (stages 0-2 call theirs *buckets*, stage 3 *units*); a *shard* is rank r's 1/Nd of it; a
*segment* is what this rank's optimizer updates of one group (its shard; the whole group at
stage 0); a *piece* is the part of one parameter inside one segment. What protects a step against
its caller is behind the `Seams` (seams.py); the full contract is docs/contract.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..config import ZeroConfig
from ..param_groups import ZeroOptimizer, build_groups
from .comm import Comm, CommLedger
from .optim import GradStats, LossScaler, StepVote
from .labels import label
from .seams import Seams
from .stage0 import Stage0
from .stage1 import Stage1
from .stage2 import Stage2
from .stage3 import Stage3
from .stage_base import Stage


class Engine:
    """Trains one model with ZeRO stage `config.stage` over a data-parallel process group.

    Attributes: `module`, `config`, `stage`, `optimizer` (the param groups as a torch Optimizer, for
    lr schedulers), `global_step` (updates applied), `micro_step` (backwards since the last update),
    `loss_scale`, `skipped_steps`, `grad_norm` (of the averaged, unscaled gradient before clipping,
    as clip_grad_norm_ returns it; inf after a skipped step; None before the first).
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
        """Give the model values (sharded construction: materialize.py), every rank rank 0's, then lay
        the trainable parameters into the stage's flat buffers."""
        sharded_construction = materializer is not None and self.config.stage == 3
        if materializer is not None:
            materializer.start_from_rank0_rng(self.comm)
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

    # --- the training step -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """The model's forward. Floating-point tensor inputs are cast to the model dtype."""
        self.check_open()
        self.seams.before_call(self)
        cast = lambda x: x.to(self.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        args, kwargs = tree_map(cast, (args, kwargs))
        with label("zero_ref.forward"), self.seams.forward_context(self):
            self.broadcast_buffers()
            try:
                return self.module(*args, **kwargs)
            except BaseException:
                if torch.is_grad_enabled() and not self.comm.failed:
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
        """Backward of `loss` times the loss scale / grad_accum_steps: one micro-batch per call. At a
        step boundary every gradient reduction of the step has finished on return."""
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
        """At a step boundary, update: True when the parameters changed; False mid-accumulation, with
        no backward since the last step, or when non-finite gradients skipped it (on every rank)."""
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
        """The step's vote (optim.GradStats) with the seams' fields."""
        counts, same = self.seams.vote(self, stepping, discarding)
        return self.grad_stats.vote(counts, same, mp_counts=self.seams.mp_counts)

    @property
    def ranks_summed(self) -> int:
        """How many ranks a sum over the data-parallel group adds up (a fake group's: this rank's own)."""
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
        """Discard the gradients since the last step, not their place in it (the boundary stays, as
        in a torch loop stepping every grad_accum_steps). `set_to_none=False`: parameters that got a
        gradient keep one of zeros, so a step at a boundary still updates them, as in torch."""
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
        """Elements moved per rank by collective kind, last step and cumulative, as the paper counts."""
        return self.ledger.stats()

    # --- release ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook the engine registered. The model keeps its parameters (stage 3: freed;
        take full_state_dict() first); any method but close, memory_report and comm_stats then raises."""
        if self.closed:
            return
        self.stage.close()
        self.seams.close(self)
        self.closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

