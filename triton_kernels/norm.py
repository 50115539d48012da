"""Fused gradient norm and overflow check: the sum of squares and an inf/NaN flag in one pass.

Gradient clipping needs the global norm, and fp16 loss scaling needs to know whether any
gradient overflowed. In torch that is two full passes (``x.square().sum()`` and
``isfinite(x).all()``, plus an fp32 upcast copy for low-precision input). Here one pass reads
each element once, in its own dtype.

Each program reduces its block to two numbers: a partial sum of squares (fp32) and a 0/1 flag.
Those ``ceil(n / BLOCK)`` partials are then summed by torch. This is deterministic (no atomics:
the same input always gives the same bits) and the second stage touches only a few kilobytes.
"""

import torch
import triton
import triton.language as tl

from . import reference
from .common import (check_device, device_context, dtype_kind, is_interpreted, kernel_view,
                     load_fp32, pick_block)


@triton.jit
def _partial_norm_kernel(x_ptr, n, sums_ptr, flags_ptr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Write this block's sum of squares (fp32) and whether it holds any inf or NaN (int32).

    The non-finite test looks at the bits (exponent all ones), which no compiler flag can
    optimise away, unlike ``x != x``. Masked-off lanes load 0, which is finite and adds nothing.
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = load_fp32(x_ptr, offs, mask, KIND)
    bits = x.to(tl.int32, bitcast=True)
    nonfinite = ((bits & 0x7F800000) == 0x7F800000).to(tl.int32)
    tl.store(sums_ptr + pid, tl.sum(x * x, axis=0))
    tl.store(flags_ptr + pid, tl.max(nonfinite, axis=0))


def norm_and_overflow(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(sum of squares as fp32 0-d tensor, any inf/NaN as bool 0-d tensor)``.

    Same contract as ``reference.norm_and_overflow``; results stay on the device (no sync).
    """
    reference.check_norm_args(flat)
    n = flat.numel()
    if n == 0:
        return (torch.zeros((), dtype=torch.float32, device=flat.device),
                torch.zeros((), dtype=torch.bool, device=flat.device))
    interpreted = is_interpreted(_partial_norm_kernel)
    check_device(flat, "flat", interpreted)
    kind = dtype_kind(flat.dtype, "flat")
    block, warps = pick_block("norm", n, interpreted)
    programs = triton.cdiv(n, block)
    sums = torch.empty(programs, dtype=torch.float32, device=flat.device)
    flags = torch.empty(programs, dtype=torch.int32, device=flat.device)
    with device_context(flat):
        _partial_norm_kernel[(programs,)](
            kernel_view(flat.reshape(-1)), n, sums, flags, KIND=kind, BLOCK=block,
            num_warps=warps,
        )
    return sums.sum(), flags.any()
