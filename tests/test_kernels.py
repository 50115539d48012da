"""Tests of triton_kernels: every kernel against its torch twin, AdamW against torch.optim.AdamW.

Each test runs once per available (backend, device) pair:
  torch-cpu always; triton-cpu through Triton's interpreter; torch-cuda and triton-cuda (compiled)
  when a GPU is present. The interpreter must be chosen before triton's kernels are defined, so
  TRITON_INTERPRET defaults to 1 below; experiments/gpu_check.sh runs this file with
  TRITON_INTERPRET=0 to test the compiled kernels (the interpreter cannot use CUDA tensors).
The interpreter is slow per program, so sizes stay small (the kernels use one big block there).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # noqa: E402  (must precede the kernels' definition)

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import triton_kernels  # noqa: E402
from triton_kernels import reference  # noqa: E402

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = triton_kernels._interpret_requested()
N = 70001  # not a multiple of any block size; two programs at the interpreter's 65536 block

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on inf/NaN, interpreter


def _backend_cases():
    """Return the (backend, device) pairs this machine can run; impossible ones are skipped."""
    no_interp = pytest.mark.skipif(not (HAVE_TRITON and INTERPRET),
                                   reason="Triton on CPU needs triton and TRITON_INTERPRET=1")
    cases = [pytest.param(("torch", "cpu"), id="torch-cpu"),
             pytest.param(("triton", "cpu"), id="triton-cpu", marks=no_interp)]
    if torch.cuda.is_available():
        compiled = pytest.mark.skipif(not HAVE_TRITON or INTERPRET,
                                      reason="compiled Triton needs triton and no TRITON_INTERPRET")
        cases += [pytest.param(("torch", "cuda"), id="torch-cuda"),
                  pytest.param(("triton", "cuda"), id="triton-cuda", marks=compiled)]
    return cases


@pytest.fixture(params=_backend_cases())
def kd(request):
    """Yield ``(kernels, device)`` for one backend/device pair."""
    name, device = request.param
    return triton_kernels.load(name), torch.device(device)


def _gen(seed=0):
    """A seeded CPU generator, so every backend sees the same random data."""
    return torch.Generator().manual_seed(seed)


def _assert_rel(actual, expected, rel=1e-6):
    """Assert elementwise closeness within ``rel`` of each value or of the tensor's largest one."""
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


def _assert_bits_equal(actual, expected):
    """Assert two 16-bit float tensors are bit-identical, except that NaN need only map to NaN."""
    nan = torch.isnan(expected)
    assert torch.isnan(actual[nan]).all()
    diff = (actual.view(torch.int16) != expected.view(torch.int16)) & ~nan
    first = diff.nonzero()[:5].flatten().tolist()
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {first}"


FLOATS = [torch.float32, torch.bfloat16, torch.float16]
FLOAT_IDS = ["f32", "bf16", "fp16"]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def _run_adamw_vs_torch(k, device, grad_dtype, out_dtype, n=N, steps=5, grad_scale=0.5, **hyper):
    """Run ``steps`` fused steps and torch.optim.AdamW side by side; return both states."""
    hyper = {**HYPER, **hyper}
    g = _gen(1)
    master0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g).to(grad_dtype).to(device) for _ in range(steps)]
    master = master0.to(device)
    exp_avg, exp_avg_sq = torch.zeros(n, device=device), torch.zeros(n, device=device)
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype, device=device)
    param = torch.nn.Parameter(master0.clone().to(device))
    opt = torch.optim.AdamW([param], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                            eps=hyper["eps"], weight_decay=hyper["weight_decay"], foreach=False)
    for step, grad in enumerate(grads, start=1):
        before = grad.clone()
        k.fused_adamw_(master, grad, exp_avg, exp_avg_sq, out, step=step, grad_scale=grad_scale,
                       **hyper)
        assert torch.equal(grad, before), "the gradient must not be modified"
        param.grad = grad.float() * grad_scale
        opt.step()
    state = opt.state[param]
    expected = (param.detach(), state["exp_avg"], state["exp_avg_sq"])
    return (master, exp_avg, exp_avg_sq, out), expected


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16],
                         ids=["no-copy", "bf16-copy", "fp16-copy"])
@pytest.mark.parametrize("grad_dtype", FLOATS, ids=["g32", "gbf16", "gfp16"])
def test_adamw_matches_torch_optim(kd, grad_dtype, out_dtype):
    """Five steps, grad_scale != 1: master and moments within 1e-6; the copy is master.to(dtype)."""
    k, device = kd
    (master, exp_avg, exp_avg_sq, out), (p_ref, m_ref, v_ref) = _run_adamw_vs_torch(
        k, device, grad_dtype, out_dtype)
    _assert_rel(master, p_ref)
    _assert_rel(exp_avg, m_ref)
    _assert_rel(exp_avg_sq, v_ref)
    if out is not None:
        _assert_bits_equal(out, master.to(out_dtype))


def test_adamw_small_beta1_and_no_decay(kd):
    """beta1 < 0.5 takes torch's other lerp formula; also weight_decay 0 and grad_scale 1."""
    k, device = kd
    (master, exp_avg, exp_avg_sq, _), (p_ref, m_ref, v_ref) = _run_adamw_vs_torch(
        k, device, torch.bfloat16, None, n=1000, grad_scale=1.0, beta1=0.3, weight_decay=0.0)
    _assert_rel(master, p_ref)
    _assert_rel(exp_avg, m_ref)
    _assert_rel(exp_avg_sq, v_ref)


def _special_fp32_values() -> torch.Tensor:
    """fp32 values that probe rounding: ties, near-overflow, subnormals, inf, NaN, random bits."""
    patterns = [0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0x7F7F8000, 0x7F800000,
                0x7FC00000, 0x7F800001, 0x00000001, 0x00008000, 0x00018000, 0x477FF000,
                0x477FEFFF, 0x477FE000, 0x33800000, 0x33000000, 0x33000001, 0x38800000, 0]
    patterns += [p | 0x80000000 for p in patterns]
    bits = torch.tensor(patterns, dtype=torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    random_bits = torch.randint(-2**31, 2**31 - 1, (5000,), dtype=torch.int32, generator=_gen(2))
    return torch.cat([bits, random_bits]).view(torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adamw_copy_rounds_like_torch(kd, out_dtype):
    """With lr=0 and zero grads the master is unchanged, so the copy must equal torch's cast."""
    k, device = kd
    values = _special_fp32_values().to(device)
    n = values.numel()
    master, out = values.clone(), torch.empty(n, dtype=out_dtype, device=device)
    zeros = [torch.zeros(n, device=device) for _ in range(3)]
    k.fused_adamw_(master, zeros[0], zeros[1], zeros[2], out, lr=0.0, beta1=0.9, beta2=0.999,
                   eps=1e-8, weight_decay=0.0, step=1)
    _assert_bits_equal(out, values.to(out_dtype))


def test_adamw_shard_views_and_zero_length(kd):
    """Shards that are views ending at the end of a larger buffer; neighbours stay untouched."""
    k, device = kd
    total, start = 5000, 1234
    g = _gen(3)
    bufs = {name: torch.randn(total, generator=g).to(device) for name in ("p", "g", "m")}
    bufs["v"] = torch.rand(total, generator=g).to(device)
    bufs["o"] = torch.zeros(total, dtype=torch.bfloat16, device=device)
    want = {name: b.clone() for name, b in bufs.items()}
    views = [bufs[x][start:] for x in "pgmvo"]
    k.fused_adamw_(*views, step=3, grad_scale=2.0, **HYPER)
    reference.fused_adamw_(*[want[x][start:] for x in "pgmvo"], step=3, grad_scale=2.0, **HYPER)
    for name in "pgmv":
        assert torch.equal(bufs[name][:start], want[name][:start])
        _assert_rel(bufs[name][start:], want[name][start:])
    assert not bufs["o"][:start].any()
    _assert_bits_equal(bufs["o"][start:], bufs["p"][start:].to(torch.bfloat16))
    empty = [b[total:] for b in views]
    k.fused_adamw_(*empty, step=1, **HYPER)  # a rank with an empty shard: a no-op


def _mixed_tensors(device):
    """Tensors of mixed dtypes and shapes (0-d, empty, multi-block), with gapped offsets."""
    g = _gen(4)
    tensors = [torch.randn(3, 4, generator=g), torch.randn(N, generator=g).to(torch.bfloat16),
               torch.randn(2, 3, 5, generator=g).to(torch.float16), torch.empty(0),
               torch.randn((), generator=g), torch.randn(17, generator=g).to(torch.bfloat16)]
    tensors = [t.to(device) for t in tensors]
    offsets, pos = [], 3
    for t in tensors:
        offsets.append(pos)
        pos += t.numel() + 2
    return tensors, offsets, pos - 2  # the last tensor ends exactly at the end of flat


@pytest.mark.parametrize("flat_dtype", FLOATS, ids=FLOAT_IDS)
def test_flatten_unflatten_match_reference(kd, flat_dtype):
    """Both directions equal the torch twin bit for bit, casting as needed; gaps stay untouched."""
    k, device = kd
    tensors, offsets, size = _mixed_tensors(device)
    flat = torch.full((size,), 7.0, dtype=flat_dtype, device=device)
    want = flat.clone()
    k.flatten_(tensors, flat, offsets)
    reference.flatten_(tensors, want, offsets)
    assert torch.equal(flat.view(torch.uint8), want.view(torch.uint8))
    flat = torch.randn(size, generator=_gen(5)).to(flat_dtype).to(device)
    got = [torch.full_like(t, 3.0) for t in tensors]
    expected = [torch.full_like(t, 3.0) for t in tensors]
    k.unflatten_(flat, got, torch.tensor(offsets))  # offsets may also be a tensor
    reference.unflatten_(flat, expected, offsets)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


def test_flatten_nothing_to_copy(kd):
    """An empty list, and only empty tensors, are no-ops."""
    k, device = kd
    flat = torch.ones(4, device=device)
    k.flatten_([], flat, [])
    k.unflatten_(flat, [torch.empty(0, device=device)], [4])
    k.flatten_([torch.empty(0, 3, device=device)], flat, [2])
    assert torch.equal(flat, torch.ones(4, device=device))


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_norm_matches_reference(kd, dtype):
    """The sum of squares matches the twin (fp32, 1e-5 relative) and nothing is flagged."""
    k, device = kd
    x = torch.randn(N, generator=_gen(6)).to(dtype).to(device)
    ss, bad = k.norm_and_overflow(x)
    ss_ref, bad_ref = reference.norm_and_overflow(x)
    assert ss.dtype == torch.float32 and ss.dim() == 0
    assert bad.dtype == torch.bool and bad.dim() == 0
    assert ss.device.type == device.type and bad.device.type == device.type
    _assert_rel(ss, ss_ref, rel=1e-5)
    assert not bool(bad) and not bool(bad_ref)


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
@pytest.mark.parametrize("special", ["inf", "-inf", "nan"])
def test_norm_flags_nonfinite(kd, dtype, special):
    """One inf or NaN anywhere (here the last element) sets the flag; huge finite values do not."""
    k, device = kd
    x = torch.randn(N, generator=_gen(7)).to(dtype)
    x[-1] = float(special)
    ss, bad = k.norm_and_overflow(x.to(device))
    assert bool(bad)
    assert torch.isinf(ss) if special != "nan" else torch.isnan(ss)
    big = torch.full((10,), 1e30 if dtype != torch.float16 else 6e4, dtype=dtype, device=device)
    assert not bool(k.norm_and_overflow(big)[1])


def test_norm_empty(kd):
    """Empty input gives (0.0, False)."""
    k, device = kd
    ss, bad = k.norm_and_overflow(torch.empty(0, device=device, dtype=torch.bfloat16))
    assert float(ss) == 0.0 and not bool(bad)


def _bad_calls(device):
    """Yield ``(callable(kernels), message pattern)`` for arguments both backends must reject."""
    n = 8
    f32 = lambda: torch.zeros(n, device=device)  # noqa: E731
    strided = torch.zeros(2 * n, device=device)[::2]

    def adamw(master, grad, m, v, out=None, step=1):
        """A fused_adamw_ call with these arguments, to be made on a given backend."""
        return lambda k: k.fused_adamw_(master, grad, m, v, out, step=step, **HYPER)

    yield adamw(strided, f32(), f32(), f32()), "master.*contiguous"
    yield adamw(f32(), torch.zeros(n + 1, device=device), f32(), f32()), "grad"
    yield adamw(f32(), f32().double(), f32(), f32()), "grad.*dtype"
    yield adamw(f32(), f32(), f32().half(), f32()), "exp_avg"
    yield adamw(f32(), f32(), f32(), f32().view(2, 4)), "exp_avg_sq.*1-D"
    yield adamw(f32(), f32(), f32(), f32(), f32()), "low_precision_out"
    yield adamw(f32(), f32(), f32(), f32(), step=0), "step"
    transposed = torch.zeros(4, 4, device=device).t()
    yield (lambda k: k.flatten_([transposed], f32().repeat(2), [0])), "contiguous"
    yield (lambda k: k.flatten_([f32()], f32(), [1])), "offsets"
    yield (lambda k: k.flatten_([f32(), f32()], f32().repeat(2), [0])), "offsets"
    matrix = torch.zeros(2, n, device=device)
    yield (lambda k: k.unflatten_(matrix, [f32()], [0])), "flat"
    yield (lambda k: k.norm_and_overflow(transposed)), "contiguous"
    ints = torch.zeros(4, dtype=torch.int32, device=device)
    yield (lambda k: k.norm_and_overflow(ints)), "float32"


def test_bad_arguments_raise_clear_errors(kd):
    """Each bad argument raises a ValueError whose message names it."""
    k, device = kd
    for call, pattern in _bad_calls(device):
        with pytest.raises(ValueError, match=pattern):
            call(k)


def test_triton_rejects_unsupported_dtypes():
    """The Triton flatten handles fp32/bf16/fp16 only and says so; the twin copies anything."""
    if not (HAVE_TRITON and INTERPRET):
        pytest.skip("needs the Triton interpreter")
    ints, flat = [torch.arange(4)], torch.zeros(4)
    with pytest.raises(ValueError, match="tensors\\[0\\].*torch"):
        triton_kernels.load("triton").flatten_(ints, flat, [0])
    reference.flatten_(ints, flat, [0])
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_load_api(monkeypatch):
    """load() returns the four functions, picks torch for CPU in auto mode, explains refusals."""
    k = triton_kernels.load("torch")
    assert k.name == "torch"
    for fn in ("fused_adamw_", "flatten_", "unflatten_", "norm_and_overflow"):
        assert callable(getattr(k, fn))
    assert triton_kernels.load("auto", "cpu").name == "torch"
    assert triton_kernels.load("auto").name == "torch"
    with pytest.raises(ValueError, match="torch.*triton.*auto"):
        triton_kernels.load("cuda-magic")
    if torch.cuda.is_available():
        expected = "triton" if HAVE_TRITON and not INTERPRET else "torch"
        assert triton_kernels.load("auto", "cuda").name == expected
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="torch"):
            triton_kernels.load("triton")
