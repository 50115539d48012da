"""The torch twins of the fused kernels, and the argument checks both backends share.

Each function here states, in plain torch, exactly what its Triton counterpart computes. They are
the ``"torch"`` backend of ``triton_kernels.load`` (used on CPU and wherever Triton cannot run)
and the reference the tests compare the Triton kernels against. None of them is fused: each
torch call below is its own pass over memory, which is the cost the Triton versions remove.

The ``check_*`` functions validate arguments once, with ValueErrors that name the argument, so
both backends accept and reject exactly the same inputs.
"""

from typing import Sequence

import torch

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


def _check_flat(t, what: str, numel: int | None, dtypes, device) -> None:
    """Check that ``t`` is a 1-D contiguous tensor with an allowed dtype, length and device."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be a flat 1-D tensor, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{what} must have dtype in ({names}), got {t.dtype}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{what} has {t.numel()} elements but master has {numel}")
    if device is not None and t.device != device:
        raise ValueError(f"{what} is on {t.device} but master is on {device}")


def check_adamw_args(master, grad, exp_avg, exp_avg_sq, low_precision_out, step) -> None:
    """Validate the arguments of ``fused_adamw_`` (see ``fused_adamw_`` for their meaning)."""
    _check_flat(master, "master", None, (torch.float32,), None)
    n, dev = master.numel(), master.device
    _check_flat(grad, "grad", n, GRAD_DTYPES, dev)
    _check_flat(exp_avg, "exp_avg", n, (torch.float32,), dev)
    _check_flat(exp_avg_sq, "exp_avg_sq", n, (torch.float32,), dev)
    if low_precision_out is not None:
        _check_flat(low_precision_out, "low_precision_out", n, LOW_PRECISION_DTYPES, dev)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be the 1-based step count (an int >= 1), got {step!r}")


def adamw_scalars(lr, beta1, beta2, weight_decay, step) -> dict:
    """Compute, in Python double precision as torch.optim.AdamW does, the per-step scalars.

    Returns the weight-decay factor, the lerp weight of the first moment, the step size
    ``lr / (1 - beta1**step)`` and ``sqrt(1 - beta2**step)``.
    """
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return {
        "decay": 1 - lr * weight_decay,
        "weight1": 1 - beta1,
        "weight2": 1 - beta2,
        "step_size": lr / bias_correction1,
        "bc2_sqrt": bias_correction2**0.5,
    }


def fused_adamw_(master, grad, exp_avg, exp_avg_sq, low_precision_out, *, lr, beta1, beta2,
                 eps, weight_decay, step, grad_scale=1.0) -> None:
    """One AdamW step on flat fp32 tensors, in place, plus an optional low-precision copy.

    ``grad`` (fp32, bf16 or fp16) is read in its own dtype, upcast to fp32 and multiplied by
    ``grad_scale`` (the loss-scale inverse times the clipping coefficient). The update is
    torch.optim.AdamW's, operation for operation (``step`` is the 1-based step count)::

        master *= 1 - lr * weight_decay
        exp_avg = lerp(exp_avg, g, 1 - beta1)
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        denom = sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps
        master -= lr / (1 - beta1**step) * exp_avg / denom

    When ``low_precision_out`` (bf16 or fp16) is given, ``master`` is then cast into it
    (round-to-nearest-even), producing the weights the next forward pass uses.
    """
    check_adamw_args(master, grad, exp_avg, exp_avg_sq, low_precision_out, step)
    if master.numel() == 0:
        return
    s = adamw_scalars(lr, beta1, beta2, weight_decay, step)
    # read-only from here on: an fp32 gradient with nothing to scale is used as it is (x * 1.0 == x),
    # otherwise a scaled fp32 copy (never modify the caller's grad)
    g = grad if grad.dtype == torch.float32 and grad_scale == 1.0 else grad.to(torch.float32) * grad_scale
    master.mul_(s["decay"])
    exp_avg.lerp_(g, s["weight1"])
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=s["weight2"])
    denom = exp_avg_sq.sqrt().div_(s["bc2_sqrt"]).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-s["step_size"])
    if low_precision_out is not None:
        low_precision_out.copy_(master)


def check_flatten_args(tensors, flat, offsets) -> list[int]:
    """Validate ``flatten_``/``unflatten_`` arguments; return the offsets as a list of ints.

    ``flat`` must be a 1-D contiguous tensor; every tensor must be contiguous, on flat's device,
    and fit inside flat at its offset. Overlaps between ranges are the caller's business.
    """
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("flat must be a 1-D contiguous torch.Tensor")
    tensors = list(tensors)
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.tolist()
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(tensors):
        raise ValueError(f"offsets has {len(offsets)} entries but there are {len(tensors)} tensors")
    for i, (t, start) in enumerate(zip(tensors, offsets)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{i}] (shape {tuple(t.shape)}) must be contiguous")
        if t.device != flat.device:
            raise ValueError(f"tensors[{i}] is on {t.device} but flat is on {flat.device}")
        if start < 0 or start + t.numel() > flat.numel():
            raise ValueError(
                f"offsets[{i}]={start} with {t.numel()} elements does not fit in flat of "
                f"{flat.numel()} elements"
            )
    return offsets


def flatten_(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets) -> None:
    """Copy each tensor into ``flat[offsets[i] : offsets[i] + numel]``, casting to flat's dtype.

    Elements of ``flat`` outside those ranges are left untouched.
    """
    offsets = check_flatten_args(tensors, flat, offsets)
    for t, start in zip(tensors, offsets):
        flat[start:start + t.numel()].copy_(t.reshape(-1))


def unflatten_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets) -> None:
    """Copy ``flat[offsets[i] : offsets[i] + numel]`` into each tensor, casting to its dtype."""
    offsets = check_flatten_args(tensors, flat, offsets)
    for t, start in zip(tensors, offsets):
        t.copy_(flat[start:start + t.numel()].view(t.shape))


def check_norm_args(flat) -> None:
    """Validate the input of ``norm_and_overflow``: a contiguous fp32/bf16/fp16 tensor."""
    if not isinstance(flat, torch.Tensor):
        raise ValueError(f"flat must be a torch.Tensor, got {type(flat).__name__}")
    if not flat.is_contiguous():
        raise ValueError("flat must be contiguous")
    if flat.dtype not in GRAD_DTYPES:
        raise ValueError(f"flat must be float32, bfloat16 or float16, got {flat.dtype}")


def norm_and_overflow(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(sum of squares in fp32, any element inf or NaN)`` as 0-d tensors on flat's device.

    The flag looks at the input elements only; the sum of squares of huge finite fp32 values may
    itself overflow to inf without the flag being set. Empty input gives ``(0.0, False)``.
    The gradient norm for clipping is ``sqrt`` of the sum of squares summed over ranks.
    """
    check_norm_args(flat)
    x = flat.reshape(-1)
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device), torch.zeros((), dtype=torch.bool, device=flat.device)
    # One fused pass: vector_norm upcasts while it reads (no fp32 copy of a bf16 input).
    norm = torch.linalg.vector_norm(x, dtype=torch.float32)
    sum_sq = norm * norm
    # An inf or NaN element makes the norm non-finite, so a finite norm proves every element finite.
    # Only otherwise is a second pass needed, to tell inf/NaN elements from finite ones whose squares
    # overflowed: on the CPU we look (no sync to speak of); on a GPU we always run it rather than
    # stop the host. Every element is finite exactly when the smallest and the largest are (min and
    # max propagate NaN); one aminmax pass is ten times faster than torch.isfinite(x).all().
    if x.device.type == "cpu" and bool(torch.isfinite(norm)):
        return sum_sq, torch.zeros((), dtype=torch.bool, device=flat.device)
    low, high = torch.aminmax(x)
    return sum_sq, ~(torch.isfinite(low) & torch.isfinite(high))

