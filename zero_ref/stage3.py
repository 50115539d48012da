"""Stage 3 (Pos+g+p): optimizer states, gradients and parameters sharded.

Sharded: everything. The model is cut into units (subtrees of modules, see `build_units`); each
unit's parameters are one flat group padded to a multiple of Nd, and rank r keeps only shard r of
it: 16Ψ/Nd bytes of model state per rank. A unit's full parameters exist only while it computes.

Communicated, per micro-batch (paper Sec 7.2.2):
1. forward: just before a module that uses a unit runs, the unit is all-gathered into its full
   buffer (Ψ elements over the whole forward), the next `prefetch` units of the recorded forward
   order are gathered asynchronously, and the unit is freed again when its last user returns;
2. backward: a hook on each module's outputs gathers the unit again before the module's backward
   (Ψ elements); when every gradient of a unit has arrived its parameters are freed and its
   gradient bucket is reduce-scattered (averaged) into this rank's gradient shard (Ψ elements);
3. step: each rank updates its shard; nothing is gathered until the next forward.
Total 3Ψ, 1.5x plain data parallelism.

Freeing is done by resizing the storage of the unit's full buffer to zero bytes: the parameters
stay views of that buffer (same Parameter objects and shapes), so autograd's saved references see
the regathered values in backward. Units are reduced in the reverse of the first forward's order,
the same on every rank, so the collectives pair up.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .comm import Comm
from .config import ZeroConfig
from .grad_hooks import GroupArrivals, ShardedGradBuckets, register_grad_hooks
from .optim import ShardedAdamW
from .partition import GroupLayout, bind_params_to, copy_params_into, make_group
from .precision import make_fp32_master
from .stage_base import Stage

def build_units(model: nn.Module, trainable: list[nn.Parameter], unit_numel: int
                ) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Cut the model into units, walking modules children-first: a module whose subtree holds at
    least `unit_numel` not-yet-assigned trainable elements becomes the root of a unit holding them;
    the model itself takes whatever is left. A parameter shared by several modules (a tied weight)
    is only taken by a module whose subtree contains all of its users, so one gather serves them
    all (GPT-2's wte/lm_head land in the model's own unit)."""
    wanted = {id(p) for p in trainable}
    users: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), set()).add(id(module))
    assigned: set[int] = set()
    units = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        subtree = {id(m) for m in module.modules()}
        params = [p for p in module.parameters()
                  if id(p) in wanted and id(p) not in assigned and users[id(p)] <= subtree]
        if params and (module is model or sum(p.numel() for p in params) >= unit_numel):
            units.append((module, params))
            assigned.update(id(p) for p in params)

    visit(model)
    return units


class Stage3(Stage):
    """Full parameter partitioning with per-unit gather, prefetch and release."""

    def __init__(self, model: nn.Module, trainable: list[nn.Parameter], config: ZeroConfig, comm: Comm):
        super().__init__(trainable, config, comm)
        units = build_units(model, trainable, config.bucket_numel)
        self.groups = [make_group(i, params, self.world_size) for i, (_, params) in enumerate(units)]
        self.layout = GroupLayout(self.groups)

        # Keep only this rank's shard of each unit; the full buffers start freed.
        self.flat_param_shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.param_shards = [self.layout.shard_slice(self.flat_param_shard, g) for g in range(len(self.groups))]
        self.full_params: list[torch.Tensor] = []
        for g, group in enumerate(self.groups):
            full = torch.empty(group.padded_numel, dtype=self.dtype, device=self.device)
            copy_params_into(group, full, self.kernels.flatten_)
            lo, hi = group.shard_range(self.rank)
            self.param_shards[g].copy_(full[lo:hi])
            bind_params_to(group, full)
            full.untyped_storage().resize_(0)
            self.full_params.append(full)
        self.flat_grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.grad_shards = [self.layout.shard_slice(self.flat_grad_shard, g) for g in range(len(self.groups))]
        self.optimizer = ShardedAdamW(make_fp32_master(self.param_shards), config, self.kernels)

        self.gathered = [False] * len(self.groups)
        self.pending_gather: dict[int, object] = {}     # group -> async all-gather in flight
        self.users = [0] * len(self.groups)             # modules inside their forward using the group
        self.forward_order: list[int] = []              # groups in order of first use, first forward
        self.order_known = False
        self.forward_position: dict[int, int] = {}     # unit -> index in forward_order
        self.backward_position: dict[int, int] = {}    # unit -> index in the reduce order
        self.in_backward = False
        self.buckets = ShardedGradBuckets(comm, self.groups, self.grad_shards, self.dtype, self.device,
                                          config.overlap)
        self.arrivals = GroupArrivals(self.groups, self.buckets.reduce_scatter)
        self.hooks = register_grad_hooks(self.groups, self._on_grad)
        self._register_module_hooks(model, units)

    # --- gather and release ----------------------------------------------------------------------
    def _gather(self, g: int, wait: bool) -> None:
        if not self.gathered[g]:
            full = self.full_params[g]
            full.untyped_storage().resize_(full.numel() * full.element_size())
            self.pending_gather[g] = self.comm.all_gather(full, self.param_shards[g], async_op=True)
            self.gathered[g] = True
        if wait and g in self.pending_gather:
            self.pending_gather.pop(g).wait()

    def _free(self, g: int) -> None:
        if g in self.pending_gather:
            self.pending_gather.pop(g).wait()
        if self.gathered[g]:
            self.full_params[g].untyped_storage().resize_(0)
            self.gathered[g] = False

    def _prefetch_after(self, order: list[int], position: dict[int, int], g: int, skip_done: bool = False) -> None:
        """Start gathering the next `prefetch` units after g in `order` (position: unit -> index),
        in backward skipping units whose gradients are already complete."""
        wanted = self.config.prefetch
        j = position.get(g, len(order)) + 1
        while wanted and j < len(order):
            u = order[j]
            if not skip_done or (not self.arrivals.launched[u] and self.arrivals.missing[u] > 0):
                self._gather(u, wait=False)
                wanted -= 1
            j += 1

    # --- forward: module hooks -------------------------------------------------------------------
    def _register_module_hooks(self, model: nn.Module, units) -> None:
        group_of = {id(p): g for g, group in enumerate(self.groups) for p in group.params}
        root_of = {id(root): g for g, (root, _) in enumerate(units)}
        for module in model.modules():
            used = {group_of[id(p)] for p in module.parameters(recurse=False) if id(p) in group_of}
            if id(module) in root_of:
                used.add(root_of[id(module)])
            if used:
                groups = sorted(used)
                module.register_forward_pre_hook(lambda m, args, gs=groups: self._acquire(gs))
                module.register_forward_hook(lambda m, args, out, gs=groups: self._release(gs, out),
                                             always_call=True)

    def _acquire(self, groups: list[int]) -> None:
        for g in groups:
            if self.users[g] == 0:
                if not self.order_known and g not in self.forward_order:
                    self.forward_order.append(g)
                self._gather(g, wait=True)
                if self.order_known and not self.in_backward:
                    self._prefetch_after(self.forward_order, self.forward_position, g)
            self.users[g] += 1

    def _release(self, groups: list[int], output) -> None:
        for g in groups:
            self.users[g] -= 1
            # A forward inside backward is activation-checkpoint recomputation: its unit must stay
            # gathered for the backward that follows; _on_grad frees it once its gradients are in.
            if self.users[g] == 0 and not self.in_backward:
                self._free(g)
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad, gs=groups: self._before_backward(gs))

    def pre_forward(self) -> None:
        self.users = [0] * len(self.groups)
        self.in_backward = False

    def post_forward(self) -> None:
        for g in range(len(self.groups)):   # prefetched units that this forward never used
            if self.users[g] == 0:
                self._free(g)
        if not self.order_known:
            unused = [g for g in range(len(self.groups)) if g not in self.forward_order]
            self.arrivals.set_order(self.forward_order[::-1] + unused)
            self.forward_position = {u: i for i, u in enumerate(self.forward_order)}
            self.backward_position = {u: i for i, u in enumerate(self.arrivals.order)}
            self.order_known = True

    # --- backward --------------------------------------------------------------------------------
    def _before_backward(self, groups: list[int]) -> None:
        """Runs when the gradient of a module's output is ready, before the module's backward."""
        for g in groups:
            if not self.gathered[g] or g in self.pending_gather:
                self._gather(g, wait=True)
                self._prefetch_after(self.arrivals.order, self.backward_position, g, skip_done=True)

    def _on_grad(self, g: int, i: int, param: nn.Parameter) -> None:
        self.buckets.add(g, i, param.grad)
        param.grad = None
        self.arrivals.arrive(g, i)
        if self.arrivals.missing[g] == 0:
            self._free(g)   # every use of this unit in backward is done

    def begin_backward(self, boundary: bool) -> None:
        self.arrivals.reset()
        self.in_backward = True

    def end_backward(self, boundary: bool) -> None:
        self.in_backward = False
        self.arrivals.flush()
        self.buckets.drain()
        for g in range(len(self.groups)):
            self._free(g)

    # --- step ------------------------------------------------------------------------------------
    def zero_grads(self) -> None:
        self.flat_grad_shard.zero_()

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [self.flat_param_shard, *self.full_params],
                "grads": [self.flat_grad_shard, *self.buckets.live()],
                "optimizer_states": self.optimizer.state_tensors()}
