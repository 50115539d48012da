"""Stage 3 (Pos+g+p): optimizer states, gradients and parameters sharded: 16Ψ/Nd bytes per rank.

The model is cut into units (module subtrees, units.build_units); each unit's parameters are one
flat group padded to a multiple of Nd, of which rank r keeps shard r. A unit's full parameters
exist only while something holds them: each `Unit` has a state (FREED: its full buffer has no
storage, the parameters are views of it; GATHERING; GATHERED) and named reasons it is held
(`Hold`). It is gathered with the first reason and freed with the last, in `_free_if_unheld`.

Communicated, per micro-batch (paper Sec 7.2.2), 3Ψ in all, 1.5x plain data parallelism:
1. forward: before a unit's root module runs, the unit is all-gathered (Ψ), following the gather
   schedule every rank shares (units.GatherSchedule), `prefetch` units ahead; it is freed when the
   root returns. A forward that raises on some ranks raises on every rank, at its end;
2. backward: a hook on each root's outputs gathers the unit again before the root's backward (Ψ);
   once all its gradients are in, it is freed and its gradients are reduce-scattered into this
   rank's shard in bucket-size pieces (CB, Ψ), in the reverse forward order on every rank;
3. step: each rank updates its shard; nothing is gathered until the next forward.

Freeing resizes the full buffer's storage to zero bytes: the parameters stay views of it, so
autograd's saved references see the regathered values in backward. Reads outside a unit's window
are the guard's to see (guard/unit_reads.py); it gathers through `acquire`, `gather_for_backward`
and `hold`, and adds units a module uses outside their roots to `external`.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..config import ZeroConfig
from .comm import Comm
from .grad_buffers import GroupArrivals, ShardedGradBuckets, register_grad_hooks
from .in_flight import SideStream
from .labels import label
from .partition import GroupLayout, bind_params_to, copy_params_into, make_group
from .stage_base import Stage
from .units import (FOREIGN_BACKWARD, TRUST_AFTER, GatherSchedule, Hold, Unit, UnitState, build_units, internal,
                    module_name, output_tensors)


class Stage3(Stage):
    """Full parameter partitioning with per-unit gather, prefetch and release."""

    params_sharded = True

    def __init__(self, model: nn.Module, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm,
                 materializer=None):
        super().__init__(trainable, config, comm)
        self.model = model
        roots = build_units(model, trainable, config.bucket_numel)
        self.groups = [make_group(params, self.world_size) for _, params in roots]
        self.layout = GroupLayout(self.groups)

        # Keep only this rank's shard of each unit; the full buffers start freed. A model on the
        # meta device (sharded construction) hands over each module's values as they are made.
        self.flat_param_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.param_shards = [self.layout.shard_slice(self.flat_param_shard, g) for g in range(len(self.groups))]
        if materializer is not None:
            where = {id(p): (g, start, end) for g, group in enumerate(self.groups)
                     for p, start, end in group.param_ranges()}
            materializer.run(take=lambda param: self._keep_own_pieces(param, *where[id(param)]))
        self.full_params: list[torch.Tensor] = []
        for g, group in enumerate(self.groups):
            full = torch.empty(group.padded_numel, dtype=self.dtype, device=self.device)
            if materializer is None:
                copy_params_into(group, full, self.kernels.flatten_)
                lo, hi = group.shard_range(self.rank)
                self.param_shards[g].copy_(full[lo:hi])
            bind_params_to(group, full)
            full.untyped_storage().resize_(0)
            self.full_params.append(full)
        self.flat_grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        self.grad_shards = [self.layout.shard_slice(self.flat_grad_shard, g) for g in range(len(self.groups))]
        self.optimizer = self._make_optimizer(self.param_shards)

        self.units = [Unit(module_name(model, root), full) for (root, _), full in zip(roots, self.full_params)]
        self.unit_of_root = {id(root): g for g, (root, _) in enumerate(roots)}
        self.unit_of_param = {id(p): g for g, group in enumerate(self.groups) for p in group.params}
        self.unit_of_storage = {full.untyped_storage()._cdata: g for g, full in enumerate(self.full_params)}
        self.slot = {id(p): (g, i) for g, group in enumerate(self.groups) for i, p in enumerate(group.params)}
        self.frames: list[tuple[nn.Module, list[int]]] = []   # running unit roots, innermost last
        self.external: dict[int, set[int]] = {}  # id(module) -> units it uses outside their roots
        self.used_this_pass: set[int] = set()
        self.reused: set[int] = set()            # units a forward uses twice: held to the end of each forward
        self.pinned: set[int] = set()            # units with an untracked view in the graph: held in backward
        self.retaining = False                   # the backward running keeps its graph (retain_graph)
        self.written_while_gathered: str | None = None   # a unit written in place while gathered, since the step
        self.scratch: list = []                  # (buffer, gather) for gathers of a unit already held
        self.gathering: set[int] = set()         # units whose gather is in flight
        self.error_before_forward = None         # the exception being handled when the forward began
        self.internal = 0                        # > 0 while the stage's own code runs
        self.gather_stream = SideStream(self.device)
        self.shards_written = None               # CUDA event: this rank's shards are up to date
        trust_after = TRUST_AFTER if config.checks == "off" else None   # off: every rank runs alike
        self.forward_schedule = GatherSchedule(comm, self._issue_gather, config.prefetch, trust_after)
        self.backward_schedule = GatherSchedule(comm, self._issue_gather, config.prefetch, trust_after)
        # on gloo the host itself waits for a reduction, stalling backward: two in flight (three buffers)
        # let the oldest finish meanwhile (`zero-ref bench --stages 3` measures the difference)
        may_block = self.device.type == "cuda" or comm.backend == "fake"
        self.buckets = ShardedGradBuckets(comm, self.groups, self.grad_shards, self.grad_dtype, self.device,
                                          config.overlap, config.bucket_numel, may_block=may_block,
                                          max_in_flight=1 if may_block else 2)
        self.arrivals = GroupArrivals(self.groups, self.buckets.reduce_scatter)
        self.hooks = register_grad_hooks(trainable, self._after_grad, self._before_grad)
        for module in [model, *[root for root, _ in roots if root is not model]]:
            self.hooks.append(module.register_forward_pre_hook(self._enter))
            self.hooks.append(module.register_forward_hook(self._exit, always_call=True))
        self._mark_shards_written()

    def _keep_own_pieces(self, param: nn.Parameter, g: int, start: int, end: int) -> None:
        """Sharded construction: copy this rank's piece of a newly made parameter (elements
        [start, end) of unit g) into the unit's shard, then release the parameter's storage."""
        lo, hi = self.groups[g].shard_range(self.rank)
        a, b = max(start, lo), min(end, hi)
        if a < b:
            self.param_shards[g][a - lo:b - lo].copy_(param.detach().reshape(-1)[a - start:b - start])
        param.untyped_storage().resize_(0)

    # --- a unit's lifetime: gathered with its first hold, freed with its last ------------------------
    def _issue_gather(self, g: int) -> None:
        """Start gathering unit g (called by the gather schedules, in the same order on every rank);
        it is held until used (forward) or for the backward."""
        unit = self.units[g]
        self.gather_stream.wait_event(self.shards_written)
        with self.gather_stream.on():
            if unit.state is UnitState.FREED:
                with label("zero_ref::gather unit", g):   # profiler labels only
                    unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
                    unit.gather = self.comm.all_gather(unit.full, self.param_shards[g], async_op=True, channel="gather")
                unit.state = UnitState.GATHERING
                self.gathering.add(g)
            else:   # held here, but a peer needs it: take part, into a scratch buffer
                with label("zero_ref::gather unit", g, "scratch"):
                    scratch = torch.empty_like(unit.full)
                    self.scratch.append((scratch, self.comm.all_gather(scratch, self.param_shards[g], async_op=True,
                                                                       channel="gather")))
        self.hold(g, Hold.BACKWARD if self.in_backward else Hold.SCHEDULED)

    def hold(self, g: int, reason: Hold) -> None:
        holds = self.units[g].holds
        holds[reason] = holds[reason] + 1 if reason is Hold.RUNNING else 1

    def _drop(self, g: int, reason: Hold) -> None:
        """Unit g is no longer held for `reason` (one count of it)."""
        holds = self.units[g].holds
        if holds[reason] > 0:
            holds[reason] -= 1
        self._free_if_unheld(g)

    def _free_if_unheld(self, g: int) -> None:
        """The one place a unit is freed: when no reason holds it any more."""
        unit = self.units[g]
        if unit.state is not UnitState.FREED and not +unit.holds:
            self.wait_for(g)
            if self._unit_version(g) != unit.version and self.written_while_gathered is None:
                self.written_while_gathered = unit.name   # lost with the buffer: the step refuses
            with label("zero_ref::free unit", g):
                unit.full.untyped_storage().resize_(0)
            unit.state = UnitState.FREED

    def _end_pass(self, *reasons: Hold) -> None:
        """A forward or backward is over: drop its reasons from every unit, and let peers' gathers finish."""
        for g, unit in enumerate(self.units):
            for reason in reasons:
                unit.holds[reason] = 0
            self._free_if_unheld(g)
        while self.scratch:
            self.scratch.pop()[1].wait()

    def wait_for(self, g: int) -> None:
        """Wait until unit g's gather in flight, if any, has arrived."""
        unit = self.units[g]
        if unit.state is UnitState.GATHERING:
            unit.gather.wait()
            unit.gather, unit.state = None, UnitState.GATHERED
            self.gathering.discard(g)
            unit.version = self._unit_version(g)
            if self.device.type == "cuda":   # allocated on the gather stream, used on this one
                unit.full.record_stream(torch.cuda.current_stream(self.device))

    def is_freed(self, g: int) -> bool:
        return self.units[g].state is UnitState.FREED

    def is_running(self, g: int) -> bool:
        """Whether a running unit root holds unit g."""
        return self.units[g].holds[Hold.RUNNING] > 0

    def gathers_in_flight(self) -> bool:
        return bool(self.gathering)

    def acquire(self, g: int) -> None:
        """A root about to run needs unit g: gather it through this pass's schedule, and hold it
        while the root runs (in backward, a recomputation, until its gradients are in too)."""
        if self.in_backward:
            self.backward_schedule.acquire(g, held=not self.is_freed(g))
            self.hold(g, Hold.BACKWARD)
        else:
            if g in self.used_this_pass and self.is_freed(g):
                self.reused.add(g)   # used again after its release: from now on kept to the end of each forward
            self.used_this_pass.add(g)
            self.forward_schedule.acquire(g, held=not self.is_freed(g))
            if g in self.reused:
                self.hold(g, Hold.FORWARD)
        self.wait_for(g)
        self.hold(g, Hold.RUNNING)
        self._drop(g, Hold.SCHEDULED)

    def gather_for_backward(self, g: int) -> None:
        """Unit g is needed by this backward: gathered through the backward schedule, held until its
        gradients are in."""
        self.backward_schedule.acquire(g, held=not self.is_freed(g))
        self.hold(g, Hold.BACKWARD)
        self.wait_for(g)

    # --- forward: one pair of hooks per unit root, and the model's --------------------------------
    @internal
    def _enter(self, module: nn.Module, args) -> None:
        acquired: list[int] = []
        self.frames.append((module, acquired))   # first: _exit, always called, releases what was acquired
        if module is self.model and not self.in_backward:
            self.forward_schedule.begin()
            self.used_this_pass = set()
            self.error_before_forward = sys.exc_info()[1]   # a forward may run inside an except clause
        units = [g for g in (self.unit_of_root.get(id(module)),) if g is not None]
        units += sorted(self.external.get(id(module), ()))
        for g in units:   # if one raises, _exit releases those acquired before it
            self.acquire(g)
            acquired.append(g)

    @internal
    def _exit(self, module: nn.Module, args, output) -> None:
        _, units = self.frames.pop()
        if self.comm.failed:   # a gather of this forward failed: the engine cannot go on, so no more collectives
            return
        for g in units:
            self._drop(g, Hold.RUNNING)
        if torch.is_grad_enabled() and units:
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, gs=tuple(units): self._before_backward(gs))
        if module is self.model and not self.in_backward:
            # torch calls this hook (always_call) inside its except clause when the forward raised
            failed = sys.exc_info()[1] is not self.error_before_forward
            self._end_forward(failed)
            if self.forward_schedule.failed_ranks and not failed:
                ranks = ", ".join(map(str, self.forward_schedule.failed_ranks))
                raise RuntimeError(
                    f"stage 3: the forward raised on rank(s) {ranks} of the data-parallel group, so it stops here "
                    "too: every rank gathers the same units in one order, and a rank that went on alone would pair "
                    "its gathers with the wrong ones. Nothing was changed; every rank may now skip this batch (or "
                    "retry it) alike")

    @internal
    def idle_forward(self) -> None:
        self.forward_schedule.begin()
        self._end_forward()   # issues the whole schedule and answers rounds until every rank's forward is over

    def _end_forward(self, failed: bool = False) -> None:
        first = not self.forward_schedule.learned
        self.forward_schedule.finish(failed)
        self._end_pass(Hold.SCHEDULED, Hold.FORWARD)
        if first:   # reduce in the reverse of the (agreed) forward order, on every rank
            entries = self.forward_schedule.entries
            self.arrivals.set_order(entries[::-1] + [g for g in range(len(self.groups)) if g not in entries])

    # --- backward ----------------------------------------------------------------------------------
    @internal
    def _before_backward(self, units: tuple[int, ...]) -> None:
        """Runs when the gradient of a unit root's output is ready, before the root's backward."""
        self.check_in_backward(FOREIGN_BACKWARD)
        for g in units:
            self.gather_for_backward(g)

    @internal
    def _before_grad(self, param: nn.Parameter) -> None:
        self.check_in_backward()
        self.buckets.bind(self.unit_of_param[id(param)])

    @internal
    def _after_grad(self, param: nn.Parameter) -> None:
        self.check_in_backward()
        self.mark_used(param)
        g, i = self.slot[id(param)]
        self.buckets.add(g, i, param)
        self.arrivals.arrive(g, i)
        if self.arrivals.missing[g] == 0:
            self._drop(g, Hold.BACKWARD)   # every use of this unit in backward is done
        self.buckets.harvest()

    @internal
    def begin_backward(self, boundary: bool) -> None:
        self.arrivals.reset()
        self.backward_schedule.begin()
        for g in sorted(self.pinned):   # an untracked view of the unit may be read anywhere in this backward
            self.gather_for_backward(g)
            self.hold(g, Hold.PINNED)

    @internal
    def end_backward(self, boundary: bool, failed: bool = False) -> None:
        # after a failed backward too: the schedule, learned from rounds, is every rank's alike
        self.backward_schedule.finish()
        self.arrivals.flush()
        self.buckets.drain()
        self._end_pass(Hold.BACKWARD, Hold.PINNED)
        if not self.retaining:
            self.pinned.clear()

    def run_backward(self, loss: torch.Tensor, retain_graph: bool, autograd=torch.autograd.backward) -> None:
        self.retaining = retain_graph   # units pinned for this backward stay so for the next one too
        autograd(loss, retain_graph=retain_graph)

    # --- step --------------------------------------------------------------------------------------
    def grad_segments(self) -> list[torch.Tensor]:
        return self.grad_shards

    def after_update(self) -> None:
        self._mark_shards_written()

    def _mark_shards_written(self) -> None:
        if self.device.type == "cuda":
            self.shards_written = torch.cuda.current_stream(self.device).record_event()

    def _zero_grad_buffers(self) -> None:
        self.buckets.discard()   # what a backward that raised left behind
        self.flat_grad_shard.zero_()

    def param_buffer(self, g: int) -> torch.Tensor:
        return self.full_params[g]

    def _unit_version(self, g: int) -> int:
        """torch's count of in-place writes into unit g's parameters (each only grows). A write made while
        gathered (nn.Embedding(max_norm=...)) is lost with the buffer: `written_while_gathered` names
        the unit, and a guard refuses the step (guard/param_writes.py)."""
        return sum(param._version for param in self.groups[g].params)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_param_shard, *self.full_params], "grads": [self.flat_grad_shard],
                "optimizer_states": self.optimizer.state_tensors(), "comm_buffers": self.buckets.buffers()}
