"""Fused AdamW: the whole optimizer step and the low-precision weight copy in one pass.

Unfused (``reference.fused_adamw_``) the step is about ten torch calls, each reading and writing
whole tensors. Here each program loads its block of master weights, gradient and both moments
once, does all the arithmetic in registers, and writes master, moments and the bf16/fp16 copy
once: 28 bytes per element for bf16 gradients and a bf16 copy, the minimum the step needs.

The arithmetic mirrors torch.optim.AdamW (single-tensor path) operation for operation, with
IEEE-rounded division and square root (``tl.div_rn``, ``tl.sqrt_rn``; plain ``tl.sqrt`` is an
approximation on NVIDIA GPUs), so results agree with torch to within a few fp32 ulps. The
remaining differences come from operation fusion (a GPU may compute ``a * b + c`` as one fma).
"""

import triton
import triton.language as tl

from . import reference
from .common import (KIND_FP32, check_device, device_context, dtype_kind, is_interpreted,
                     kernel_view, load_fp32, pick_block, store_fp32)


@triton.jit
def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, n,
                  decay, weight1, beta2, weight2, step_size, bc2_sqrt, eps, grad_scale,
                  GRAD_KIND: tl.constexpr, OUT_KIND: tl.constexpr, HAS_OUT: tl.constexpr,
                  LERP_FROM_START: tl.constexpr, BLOCK: tl.constexpr):
    """Update ``BLOCK`` elements of master/exp_avg/exp_avg_sq in place; optionally write the copy.

    Scalars come precomputed in double precision on the host (``reference.adamw_scalars``) and
    arrive as fp32, as torch's scalar arguments do. Offsets are 64-bit so shards beyond 2**31
    elements work.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    g = load_fp32(grad_ptr, offs, mask, GRAD_KIND) * grad_scale
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)

    p = p * decay  # decoupled weight decay, before the update (torch: param.mul_)
    # torch's lerp(m, g, w) picks the better-conditioned of two equal formulas by |w| < 0.5
    if LERP_FROM_START:
        m = m + weight1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - weight1)
    v = v * beta2 + weight2 * g * g  # torch: mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    # torch's addcdiv: self + (value * t1) / t2 with value = -step_size. Written as a subtraction,
    # the same bits in IEEE arithmetic (x + -y == x - y, (-s) * m == -(s * m)), and no negated scalar
    p = p - tl.div_rn(step_size * m, denom)

    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_OUT:
        store_fp32(out_ptr, offs, p, mask, OUT_KIND)


def fused_adamw_(master, grad, exp_avg, exp_avg_sq, low_precision_out, *, lr, beta1, beta2,
                 eps, weight_decay, step, grad_scale=1.0) -> None:
    """One AdamW step in one kernel launch; same contract as ``reference.fused_adamw_``.

    Validates arguments like the torch twin, then launches one program per ``BLOCK`` elements.
    A zero-length shard (a rank whose partition is empty) is a no-op.
    """
    reference.check_adamw_args(master, grad, exp_avg, exp_avg_sq, low_precision_out, step)
    n = master.numel()
    if n == 0:
        return
    interpreted = is_interpreted(_adamw_kernel)
    check_device(master, "master", interpreted)
    grad_kind = dtype_kind(grad.dtype, "grad")
    has_out = low_precision_out is not None
    out_kind = dtype_kind(low_precision_out.dtype, "low_precision_out") if has_out else KIND_FP32
    out = kernel_view(low_precision_out) if has_out else master  # placeholder, never written
    s = reference.adamw_scalars(lr, beta1, beta2, weight_decay, step)
    block, warps = pick_block("adamw", n, interpreted)
    grid = (triton.cdiv(n, block),)
    with device_context(master):
        _adamw_kernel[grid](
            master, kernel_view(grad), exp_avg, exp_avg_sq, out, n,
            float(s["decay"]), float(s["weight1"]), float(beta2), float(s["weight2"]),
            float(s["step_size"]), float(s["bc2_sqrt"]), float(eps), float(grad_scale),
            GRAD_KIND=grad_kind, OUT_KIND=out_kind, HAS_OUT=has_out,
            LERP_FROM_START=abs(s["weight1"]) < 0.5, BLOCK=block, num_warps=warps,
        )

