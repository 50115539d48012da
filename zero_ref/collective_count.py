"""Counting what torch.distributed moves, below any library: a TorchDispatchMode that sees every
c10d collective (the dispatcher's c10d ops, whoever issued them: the engine, a model-parallel layer,
a peer such as DDP) and counts floating-point elements per rank the way the paper counts them
(all-reduce of n: 2n; reduce-scatter or all-gather of n: n; broadcast of n: n).

    with CountCollectives() as counter:
        engine.backward(engine(batch)); engine.step()
    counter.moved      # Counter({"reduce_scatter": ..., "all_gather": ..., "all_reduce": ...})
    counter.calls      # how many collectives of each kind were issued
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# c10d op -> (kind, elements moved per rank from its tensor arguments), as the paper counts
_OPS = {
    "_allgather_base_": ("all_gather", lambda args: args[0].numel()),
    "_reduce_scatter_base_": ("reduce_scatter", lambda args: args[1].numel()),
    "allreduce_": ("all_reduce", lambda args: 2 * sum(t.numel() for t in args[0])),
    "broadcast_": ("broadcast", lambda args: sum(t.numel() for t in args[0])),
}


class CountCollectives(TorchDispatchMode):
    """Counts the elements of every floating-point c10d collective issued while it is active, by
    kind in `moved` ("other": the number of calls of kinds not listed above), and the calls per
    kind in `calls`."""

    def __init__(self):
        super().__init__()
        self.moved = Counter()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[1]
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            while tensors and isinstance(tensors[0], (list, tuple)):     # list forms: a list of lists
                tensors = tensors[0]
            if tensors and tensors[0].is_floating_point():
                if name in _OPS:
                    kind, elements = _OPS[name]
                    self.moved[kind] += elements(args)
                    self.calls[kind] += 1
                else:
                    self.moved["other"] += 1
        return func(*args, **(kwargs or {}))
