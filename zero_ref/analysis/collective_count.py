"""Counting what torch.distributed moves, below any library: a TorchDispatchMode that sees every
c10d collective (the dispatcher's c10d ops, whoever issued them: the engine, a model-parallel layer,
a peer such as DDP) and counts floating-point elements per rank the way the paper counts them
(all-reduce of n: 2n; reduce-scatter, all-gather, broadcast or reduce to one rank of n: n).

    with CountCollectives() as counter:
        engine.backward(engine(batch)); engine.step()
    counter.moved      # Counter({"reduce_scatter": ..., "all_gather": ..., "all_reduce": ...})
    counter.calls      # how many collectives of each kind were issued

A library that builds one collective out of another says so with `core.gloo.counted_as`: zero-ref's
reduce-scatter on gloo is an all-to-all and a local sum (comm.py), and counts as the reduce-scatter
it is, with the elements the all-to-all's own arguments give.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.gloo import counted_kind


def _numel(tensors) -> int:
    return sum(t.numel() for t in pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor))


# c10d op -> (kind, elements moved per rank from its tensor arguments), as the paper counts: the
# forms zero_ref issues, then the list, coalesced and rooted forms other libraries (DDP, FSDP2,
# DeepSpeed) issue; a reduce to one rank counts n, like the reduce-scatter it stands in for
_OPS = {
    "_allgather_base_": ("all_gather", lambda args: args[0].numel()),
    "_reduce_scatter_base_": ("reduce_scatter", lambda args: args[1].numel()),
    "allreduce_": ("all_reduce", lambda args: 2 * _numel(args[0])),
    "broadcast_": ("broadcast", lambda args: _numel(args[0])),
    "reduce_": ("reduce", lambda args: _numel(args[0])),
    "allgather_": ("all_gather", lambda args: _numel(args[0])),                    # outputs, a list of lists
    "allgather_coalesced_": ("all_gather", lambda args: _numel(args[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda args: _numel(args[0])),
    "reduce_scatter_": ("reduce_scatter", lambda args: _numel(args[1])),           # inputs, a list of lists
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda args: _numel(args[1])),
    "allreduce_coalesced_": ("all_reduce", lambda args: 2 * _numel(args[0])),
    "alltoall_": ("all_to_all", lambda args: _numel(args[1])),
    "alltoall_base_": ("all_to_all", lambda args: _numel(args[1])),
    "gather_": ("gather", lambda args: _numel(args[1])),
    "scatter_": ("scatter", lambda args: _numel(args[0])),
}
_NOT_COUNTED = {"barrier", "monitored_barrier_", "check_for_nan"}

class CountCollectives(TorchDispatchMode):
    """Counts the elements of every floating-point c10d collective issued while it is active, by
    kind in `moved` (barriers are not counted; "other": the number of calls of kinds not listed
    above, such as send/recv), and the calls per kind in `calls`."""

    def __init__(self):
        super().__init__()
        self.moved = Counter()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[1]
            tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            if name not in _NOT_COUNTED and tensors and tensors[0].is_floating_point():
                kind, elements = _OPS.get(name, ("other", lambda _: 1))
                kind = counted_kind() or kind
                self.moved[kind] += elements(args)
                self.calls[kind] += 1
        return func(*args, **(kwargs or {}))
