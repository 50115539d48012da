"""Stage 3's parameters: Parameters whose data may be freed, which say so instead of being read.

Between a unit's gathers its parameters keep their shapes but have no data (stage3.py: the storage
of the unit's full buffer is resized to zero bytes). A kernel handed such a tensor reads past its
storage: a crash or garbage, not an error. So stage 3 makes each of its parameters a
`ShardedParameter` (still an `nn.Parameter`, same object): a torch operation that would read a
freed one raises a RuntimeError that names it, while operations that only look at metadata (shape,
dtype, `.grad`, hooks) work as on any parameter, and a gathered one behaves as a plain Parameter.
Inside the engine's forward and backward the parameters are plain (`plain`): stage 3's watcher
checks each read there itself and gathers the unit (unit_reads.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_PROPERTIES = ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "layout", "ndim",
               "names", "_base", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "_version",
               "output_nr", "itemsize", "nbytes")
_METHODS = ("size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
            "is_floating_point", "is_complex", "is_signed", "untyped_storage", "data_ptr", "register_hook",
            "register_post_accumulate_grad_hook", "requires_grad_", "get_device", "__len__", "_is_view", "is_shared",
            "new_empty", "new_zeros", "new_ones", "new_full")


def _metadata_operations() -> frozenset:
    ops = {torch.numel, torch.is_floating_point, torch.is_complex, torch.Tensor.data.__set__,
           torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
           torch.randint_like}
    for name in _PROPERTIES:
        attr = torch.Tensor.__dict__.get(name) or getattr(torch._C.TensorBase, name, None)
        ops |= {getattr(attr, "__get__", None), getattr(attr, "__set__", None)} - {None}
    ops |= {getattr(torch.Tensor, name) for name in _METHODS if hasattr(torch.Tensor, name)}
    return frozenset(ops)


METADATA = _metadata_operations()
"""Operations that read no element of a tensor (its metadata, or a new tensor like it): allowed on a
freed parameter."""


def is_freed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has elements but no storage behind them."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter (see the module docstring); ``zero_ref_name`` is its name in the model."""

    zero_ref_name = "?"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in METADATA:
            for arg in (*args, *kwargs.values()):
                for item in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                    if isinstance(item, ShardedParameter) and is_freed(item):
                        raise FreedParameterError(item, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


class FreedParameterError(RuntimeError):
    """An operation would have read a stage-3 parameter while its unit is not gathered."""

    def __init__(self, param: ShardedParameter, func):
        self.param = param
        what = getattr(func, "__name__", str(func))
        if what in ("__get__", "__set__"):     # a property: say which
            what = f".{getattr(getattr(func, '__self__', None), '__name__', '?')}"
        super().__init__(
            f"stage 3: parameter {param.zero_ref_name} is sharded across the data-parallel ranks here (its "
            f"unit is gathered only inside the engine's forward and backward), so {what} cannot read it. "
            "Read the values with engine.full_state_dict(); write them with engine.load_state_dict(...); a "
            "model whose stage-3 engine was closed keeps no values: build it again.")


def mark_sharded(model: nn.Module, params) -> list[nn.Parameter]:
    """Make each of ``params`` (parameters of ``model``) a ShardedParameter, named; returns those it
    marked (a parameter of another subclass keeps its class)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    marked = []
    for param in params:
        if type(param) is nn.Parameter:
            param.__class__ = ShardedParameter
            marked.append(param)
        param.zero_ref_name = names.get(id(param), "?")
    return marked


@contextlib.contextmanager
def plain(marked: list[nn.Parameter]):
    """Inside the engine's forward and backward the watcher (unit_reads.py) checks every read of a
    parameter itself, so the parameters are plain there: no check of their own on every operation."""
    for param in marked:
        param.__class__ = nn.Parameter
    try:
        yield
    finally:
        for param in marked:
            param.__class__ = ShardedParameter
