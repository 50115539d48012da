"""Fused kernels for ZeRO's memory-bound steps, each beside a plain torch twin.

Two jobs dominate the time a ZeRO step spends outside matmuls and communication, and one more the
time it takes to build the engine; all are memory bound, so fusing them (one pass over memory
instead of several) is what makes them fast:

* ``fused_adamw_``: the AdamW update on a flat fp32 shard plus the bf16/fp16 weight copy (every step).
* ``norm_and_overflow``: the gradient sum of squares and the inf/NaN check for loss scaling (every step).
* ``flatten_`` / ``unflatten_``: copies between many tensors and one flat buffer (the engine
  flattens its parameters once, at set-up and when it repacks its buckets).

Pick an implementation with ``load``::

    import triton_kernels
    k = triton_kernels.load("auto", device)   # Triton on CUDA if available, else torch
    k.fused_adamw_(master, grad, exp_avg, exp_avg_sq, bf16_copy, lr=1e-3, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)

``reference.py`` holds the torch twins (the ``"torch"`` backend); ``adamw.py``, ``flatten.py``
and ``norm.py`` hold the Triton kernels, and ``common.py`` what they share. Importing this
package never imports triton: that happens in ``load("triton")``. On a CPU, Triton runs only
through its interpreter, enabled by ``TRITON_INTERPRET=1`` set before the first
``load("triton")`` (that is when the kernels are defined).
"""

import os
from dataclasses import dataclass
from typing import Callable

import torch

BACKENDS = ("torch", "triton", "auto")


@dataclass(frozen=True)
class Kernels:
    """The four kernel functions of one backend; ``name`` is ``"torch"`` or ``"triton"``."""

    name: str
    fused_adamw_: Callable
    flatten_: Callable
    unflatten_: Callable
    norm_and_overflow: Callable


def _interpret_requested() -> bool:
    """Tell whether ``TRITON_INTERPRET`` asks Triton to interpret kernels instead of compiling."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_unavailable_reason() -> str | None:
    """Return why the Triton backend cannot run here, or None if it can.

    It can run when triton imports and either a CUDA device is present (compiled kernels) or
    ``TRITON_INTERPRET=1`` is set (the interpreter, on CPU tensors).
    """
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not importable ({err})"
    if not torch.cuda.is_available() and not _interpret_requested():
        return ("no CUDA device is available and TRITON_INTERPRET is not set to 1, so Triton "
                "kernels can neither be compiled nor interpreted")
    return None


def _load_torch() -> Kernels:
    """Build the torch backend from the twins in ``reference``."""
    from . import reference

    return Kernels("torch", reference.fused_adamw_, reference.flatten_, reference.unflatten_,
                   reference.norm_and_overflow)


def _load_triton() -> Kernels:
    """Import the Triton modules (defining the kernels) and build the Triton backend."""
    reason = triton_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the 'triton' kernel backend cannot run here: {reason}. "
                           "The 'torch' backend works everywhere: load('torch').")
    from . import adamw, flatten, norm

    return Kernels("triton", adamw.fused_adamw_, flatten.flatten_, flatten.unflatten_,
                   norm.norm_and_overflow)


def load(name: str = "auto", device=None) -> Kernels:
    """Return the kernels of backend ``name``: ``"torch"``, ``"triton"`` or ``"auto"``.

    ``"auto"`` picks ``"triton"`` when ``device`` is a CUDA device, triton imports and the
    interpreter is not requested (it cannot run on CUDA tensors), and ``"torch"`` otherwise
    (including ``device=None``). ``"triton"`` raises RuntimeError, saying
    why, where Triton cannot run. Unknown names raise ValueError.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    if name == "auto":
        is_cuda = device is not None and torch.device(device).type == "cuda"
        compiled = is_cuda and not _interpret_requested() and triton_unavailable_reason() is None
        name = "triton" if compiled else "torch"
    return _load_torch() if name == "torch" else _load_triton()
