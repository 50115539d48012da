"""Pieces every Triton kernel here shares: dtype codes, exact bf16 rounding, block sizes, checks.

Importing this module imports triton, so only the Triton backend imports it (lazily, from
``triton_kernels.load``). Two facts about where the kernels run shape everything below:

* On a CUDA GPU the kernels are compiled. Tensors must live on the GPU.
* On a CPU the kernels run only through Triton's interpreter (``TRITON_INTERPRET=1`` set before
  the ``@triton.jit`` functions are defined). The interpreter executes each program with numpy on
  the CPU tensors' own memory, so tensors must live on the CPU. It has two traps we design around:
  an fp32 -> bf16 cast *truncates* instead of rounding to nearest even, and arithmetic on bf16
  values is wrong. So bf16 never appears as a Triton dtype in these kernels: bf16 tensors are
  passed as ``int16`` views of the same memory and converted with integer bit arithmetic
  (``bf16_bits_to_fp32`` / ``fp32_to_bf16_bits``), which is exact and identical on both sides.

Element kinds are small integers (``KIND_*``) rather than dtypes so that one kernel can serve
several dtypes: as a ``tl.constexpr`` (one compiled variant per kind) or, in the fused flatten,
as a runtime value read from a table (one launch for tensors of mixed dtypes).
"""

import contextlib

import torch
import triton
import triton.language as tl

KIND_FP32 = 0
KIND_BF16 = 1
KIND_FP16 = 2

_KIND_OF_DTYPE = {torch.float32: KIND_FP32, torch.bfloat16: KIND_BF16, torch.float16: KIND_FP16}

# Elements per program on CUDA. The kernels are memory bound; these are conventional choices for
# elementwise work (several elements per thread) and are fixed on purpose: autotuning with
# several configs does not run in the interpreter, and one fixed config keeps results repeatable.
CUDA_BLOCK = {"adamw": 1024, "flatten": 4096, "norm": 4096}
CUDA_WARPS = {"adamw": 4, "flatten": 4, "norm": 8}

# In the interpreter every program is a numpy call, so the cost is per program: use big blocks.
INTERPRETER_MAX_BLOCK = 65536


def dtype_kind(dtype: torch.dtype, what: str) -> int:
    """Return the ``KIND_*`` code for ``dtype``, or raise a ValueError naming the argument ``what``.

    The Triton kernels handle the three floating dtypes of mixed-precision training; anything
    else (fp64, integers) is rejected here with a hint to use the torch backend.
    """
    try:
        return _KIND_OF_DTYPE[dtype]
    except KeyError:
        raise ValueError(
            f"{what}: dtype {dtype} is not supported by the Triton kernels "
            "(float32, bfloat16 and float16 are); the 'torch' backend handles any dtype"
        ) from None


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """Return ``t`` as the kernels want to see it: bf16 tensors as int16 views of the same bytes.

    The kernels convert those 16-bit patterns to and from fp32 themselves (see module docstring),
    which avoids both the interpreter's truncating cast and its broken bf16 arithmetic.
    """
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def is_interpreted(kernel) -> bool:
    """Tell whether a ``@triton.jit`` kernel was created in interpreter mode.

    The mode is fixed when the kernel is defined (Triton reads ``TRITON_INTERPRET`` then), so we
    ask the kernel object rather than the environment, which may have changed since.
    """
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(t: torch.Tensor, what: str, interpreted: bool) -> None:
    """Raise a ValueError if ``t`` is on a device the (compiled or interpreted) kernels cannot use.

    Interpreted kernels read CPU memory directly (our flatten kernel even follows raw addresses
    from a table), so they need CPU tensors; compiled kernels need CUDA tensors.
    """
    if interpreted and t.device.type != "cpu":
        raise ValueError(
            f"{what}: the Triton kernels were defined with TRITON_INTERPRET=1 and run on CPU "
            f"tensors only, got a tensor on {t.device}"
        )
    if not interpreted and t.device.type != "cuda":
        raise ValueError(
            f"{what}: compiled Triton kernels need CUDA tensors, got a tensor on {t.device} "
            "(use the 'torch' backend, or set TRITON_INTERPRET=1 before loading for CPU tensors)"
        )


def device_context(t: torch.Tensor):
    """Make ``t``'s GPU the current one for a launch (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def pick_block(op: str, largest: int, interpreted: bool) -> tuple[int, int]:
    """Return ``(BLOCK, num_warps)`` for kernel family ``op`` given the largest run of elements.

    On CUDA this is the fixed table above. In the interpreter it is the next power of two of
    ``largest``, capped at ``INTERPRETER_MAX_BLOCK``: one program per small tensor, few in all.
    """
    if interpreted:
        return min(INTERPRETER_MAX_BLOCK, max(16, triton.next_power_of_2(max(1, largest)))), 1
    return CUDA_BLOCK[op], CUDA_WARPS[op]


@triton.jit
def bf16_bits_to_fp32(bits):
    """Widen bf16 bit patterns (held in int16) to fp32 values: exact, it is a 16-bit left shift.

    A bf16 number is the upper half of the fp32 number with the same value, so placing its 16
    bits at the top of a 32-bit word (lower half zero) gives that fp32 number, inf and NaN too.
    """
    wide = bits.to(tl.int32) & 0xFFFF
    return (wide << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x):
    """Round fp32 values to bf16 with round-to-nearest-even; return the bit patterns as int16.

    Keeping the upper 16 bits truncates. To round to nearest instead, add just under half of
    the dropped range (0x7FFF) before truncating, plus 1 when the kept part is odd, so that an
    exact tie goes to the even neighbour. Carries propagate into the exponent naturally, so the
    largest finite values round up to inf, as in torch. Infinities survive unchanged (their low
    bits are zero). A NaN could carry into the sign bit, so NaNs take a separate path: keep the
    upper bits and set the quiet bit (0x0040), which stays NaN and keeps bf16 NaNs unchanged.
    """
    bits = x.to(tl.uint32, bitcast=True)
    odd = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + odd) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = (bits >> 16) | 0x0040
    out = tl.where(is_nan, quiet_nan, rounded)
    return out.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def load_fp32(ptr, offs, mask, KIND: tl.constexpr):
    """Load elements of kind ``KIND`` at ``ptr + offs`` (masked, 0 where masked) as fp32 values.

    ``ptr`` must point to float32 (KIND_FP32), int16 holding bf16 bits (KIND_BF16) or float16
    (KIND_FP16). fp16 -> fp32 is exact in the interpreter (numpy) and on GPUs.
    """
    if KIND == 1:
        x = bf16_bits_to_fp32(tl.load(ptr + offs, mask=mask, other=0))
    elif KIND == 2:
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def store_fp32(ptr, offs, x, mask, KIND: tl.constexpr):
    """Store fp32 values ``x`` at ``ptr + offs`` (masked) as elements of kind ``KIND``.

    bf16 is rounded to nearest even by ``fp32_to_bf16_bits``. fp32 -> fp16 uses Triton's own
    cast, which rounds to nearest even both compiled and in the interpreter (numpy ``astype``),
    subnormals and overflow to inf included, so it is bit-equal to torch's cast.
    """
    if KIND == 1:
        tl.store(ptr + offs, fp32_to_bf16_bits(x), mask=mask)
    elif KIND == 2:
        tl.store(ptr + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)
