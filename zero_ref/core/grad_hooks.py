"""Knowing when a bucket's gradients are complete, and reducing buckets in the same order on every rank.

Every trainable parameter gets two autograd hooks (`register_grad_hooks`):

* *before*: runs just before autograd adds this backward's gradient into `param.grad`. Stages 2 and
  3 use it to point `.grad` at the parameter's range in a bucket buffer first, so that autograd
  accumulates straight into the bucket (stages 0 and 1 bind their persistent buffer once).
* *after*: runs once autograd has accumulated every use of the parameter in this backward (uses of
  one parameter share one AccumulateGrad node). The stage then tells `GroupArrivals`.

Collectives pair up by position, so a group (bucket or unit) whose gradients are complete is
launched only once every group before it in a launch order shared by all ranks has been launched;
a group that waits for an earlier one is launched as soon as that one is. At the end of backward,
`flush` launches whatever is left (groups holding parameters that got no gradient this time: their
buffer holds zeros for them), again in order. Each rank may see gradients arrive in its own order
(data-dependent control flow); only the launch order has to agree.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from .partition import FlatGroup


class GroupArrivals:
    """Per-group arrival counting and in-order launching for one backward pass.

    Args:
        groups: the flat groups.
        launch: called with a group index to start that group's reduction.
        order: the launch order (group indices), identical on every rank; index order by default.
    """

    def __init__(self, groups: Sequence[FlatGroup], launch: Callable[[int], None],
                 order: Sequence[int] | None = None):
        self.groups = groups
        self.launch = launch
        self.order = list(order) if order is not None else list(range(len(groups)))
        self.reset()

    def reset(self) -> None:
        """Forget the previous backward."""
        self.arrived = [[False] * len(g.params) for g in self.groups]
        self.missing = [len(g.params) for g in self.groups]
        self.launched = [False] * len(self.groups)
        self.position = 0

    def set_order(self, order: Sequence[int]) -> None:
        self.order = list(order)

    def arrive(self, g: int, i: int) -> None:
        """Parameter i of group g has its gradient for this backward."""
        if self.launched[g]:
            shape = tuple(self.groups[g].params[i].shape)
            raise RuntimeError(
                f"a gradient for a parameter of shape {shape} in group {g} arrived after that group was "
                "reduced: a parameter's gradient was produced twice in one backward. Reentrant activation "
                "checkpointing does this (torch.utils.checkpoint(..., use_reentrant=True) runs a backward of "
                "its own per checkpoint, so a parameter used in two checkpoints, or inside and outside one, "
                "gets two gradients): use use_reentrant=False")
        if not self.arrived[g][i]:
            self.arrived[g][i] = True
            self.missing[g] -= 1
        while self.position < len(self.order) and self.missing[self.order[self.position]] == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        g = self.order[self.position]
        self.position += 1
        self.launched[g] = True
        self.launch(g)

    def flush(self) -> None:
        """Launch every group not launched yet, in order."""
        while self.position < len(self.order):
            self._launch_next()


def register_grad_hooks(params: Sequence[nn.Parameter], after: Callable[[nn.Parameter], None],
                        before: Callable[[nn.Parameter], None] | None = None) -> list[RemovableHandle]:
    """Call `before(param)` just before autograd accumulates a gradient into `param.grad` (if given)
    and `after(param)` once it has accumulated all of this backward's uses of `param`."""
    handles = []
    for param in params:
        if before is not None:
            handles.append(param.register_hook(lambda grad, p=param: before(p)))
        handles.append(param.register_post_accumulate_grad_hook(after))
    return handles
