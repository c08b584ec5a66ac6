import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _dispatch
from ember.ops import norm
from tests.helpers import assert_close, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float64_add_rmsnorm(x, residual, weight, eps):
    """Independent float64 math; the residual sum is rounded to x.dtype, as the op documents."""
    s = (x.double() + residual.double()).to(x.dtype)
    sd = s.double()
    return sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * weight.double(), s


# ------------------------------------------------------------------ reference vs float64
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 99), (2, 5, 123), (4, 2048), (2, 16384)])
def test_reference_matches_float64(dtype, shape):
    x, r = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    normed, new_res = ember.ops.add_rmsnorm(x, r, w, 1e-6)
    exp_normed, exp_res = float64_add_rmsnorm(x, r, w, 1e-6)
    assert normed.dtype == dtype and new_res.dtype == dtype and normed.shape == x.shape
    assert torch.equal(new_res, exp_res)
    assert_close(normed, exp_normed, dtype)


def test_rmsnorm_matches_float64():
    x, w = torch.randn(7, 300), torch.randn(300)
    xd = x.double()
    exp = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert_close(ember.ops.rmsnorm(x, w, 1e-5), exp, torch.float32)


def test_rmsnorm_matches_torch_rms_norm():
    x, w = torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(ember.ops.rmsnorm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (64,), w, 1e-6))


# ------------------------------------------------------------------ kernel (interpreter) vs reference
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 99), (2, 3, 111), (2, 128), (1, 1000)])
def test_kernel_matches_reference_interpreter(interpreter, dtype, shape):
    x, r = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    k = _dispatch.kernels("norm")
    H = shape[-1]
    out, new_res = poisoned(shape, dtype, "cpu"), poisoned(shape, dtype, "cpu")
    k.add_rmsnorm(x.view(-1, H), r.view(-1, H), w, 1e-6, out.view(-1, H), new_res.view(-1, H))
    exp_normed, exp_res = norm.add_rmsnorm_reference(x, r, w, 1e-6)
    assert torch.equal(new_res, exp_res)
    assert_close(out, exp_normed, dtype)


def test_public_op_takes_kernel_under_force_triton(interpreter, monkeypatch):
    k = _dispatch.kernels("norm")
    calls, real = [], k.add_rmsnorm
    monkeypatch.setattr(k, "add_rmsnorm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w = torch.randn(3, 40), torch.randn(40)
    torch.testing.assert_close(ember.ops.rmsnorm(x, w, 1e-6), norm.add_rmsnorm_reference(x, None, w, 1e-6)[0],
                               atol=1e-5, rtol=1e-5)
    assert calls == [1]


def test_kernel_non_contiguous_rows_interpreter(interpreter):
    base = torch.randn(6, 2, 64)
    x = base[:, 0]  # row stride 128, last dim contiguous
    r = torch.randn(6, 128)[:, ::2]  # last dim strided: the op makes it contiguous
    w = torch.randn(64)
    normed, new_res = ember.ops.add_rmsnorm(x, r, w, 1e-6)
    exp_n, exp_r = norm.add_rmsnorm_reference(x, r, w, 1e-6)
    assert torch.equal(new_res, exp_r)
    assert_close(normed, exp_n, torch.float32)


# ------------------------------------------------------------------ gated RMSNorm
GATED_SHAPES = [(1, 1), (3, 99), (2, 5, 123), (1, 1, 32, 128), (2, 3, 32, 128)]


def two_step(x, z, w, eps):
    """The model's unfused path: ember.ops.rmsnorm, then the torch gate."""
    return (ember.ops.rmsnorm(x, w, eps).float() * F.silu(z.float())).to(x.dtype)


def gated_inputs(shape, dtype, device="cpu"):
    """x, and z as the model has it: a head-split slice of a wider fused projection (strided rows)."""
    x = torch.randn(shape, device=device).to(dtype)
    *lead, D = shape
    G = lead[-1] if lead else 1
    wide = (torch.randn(*lead[:-1], 3 * G * D + 5, device=device) * 3).to(dtype)
    z = wide[..., 5 + G * D:5 + 2 * G * D].reshape(shape)
    return x, z, torch.randn(D, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GATED_SHAPES)
def test_rmsnorm_gated_reference_matches_float64(dtype, shape):
    x, z, w = gated_inputs(shape, dtype)
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()).to(dtype)  # rounded first
    exp = normed.double() * F.silu(z.double())
    got = norm.rmsnorm_gated(x, z, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert_close(got, exp, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GATED_SHAPES)
def test_rmsnorm_gated_kernel_interpreter(interpreter, dtype, shape):
    x, z, w = gated_inputs(shape, dtype)
    out = poisoned(shape, dtype, "cpu")
    D = shape[-1]
    _dispatch.kernels("norm").rmsnorm_gated(norm._groups_3d(x), norm._groups_3d(z), w, 1e-6, norm._groups_3d(out))
    # Bit for bit: the norm as the rmsnorm kernel rounds it, times silu in the interpreter's float32
    # (numpy's exp, which differs from torch's CPU exp in the last bit; on the GPU both are expf)
    zf = z.float().numpy()
    with np.errstate(over="ignore"):
        silu = torch.from_numpy(zf / (np.float32(1) + np.exp(-zf)))
    assert torch.equal(out, (ember.ops.rmsnorm(x, w, 1e-6).float() * silu).to(dtype))
    # and the two-step torch path to one rounding of the output dtype
    assert_close(out, two_step(x, z, w, 1e-6), dtype)
    assert torch.equal(norm.rmsnorm_gated(x, z, w, 1e-6), out)  # the public op takes this kernel
    if len(shape) == 4:  # the model's strided z slice is viewed, not copied
        assert norm._groups_3d(z).data_ptr() == z.data_ptr() and z.stride(-2) == D


def test_rmsnorm_gated_reference_path_is_the_two_step_path():
    x, z, w = gated_inputs((2, 3, 32, 128), torch.bfloat16)
    assert torch.equal(norm.rmsnorm_gated(x, z, w, 1e-6), two_step(x, z, w, 1e-6))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: norm.rmsnorm_gated(torch.randn(2, 8), torch.randn(2, 7), torch.ones(8)), ValueError, "z: expected shape"),
    (lambda: norm.rmsnorm_gated(torch.randn(2, 8), torch.randn(1, 8), torch.ones(8)), ValueError, "broadcasting"),
    (lambda: norm.rmsnorm_gated(torch.randn(2, 8), torch.ones(2, 8, dtype=torch.int32), torch.ones(8)), TypeError, "z"),
    (lambda: norm.rmsnorm_gated(torch.randn(2, 8), None, torch.ones(8)), TypeError, "z"),
    (lambda: norm.rmsnorm_gated(torch.randn(2, 8), torch.randn(2, 8), torch.ones(7)), ValueError, "weight"),
    (lambda: norm.rmsnorm_gated(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 0.0), ValueError, "eps"),
    (lambda: norm.rmsnorm_gated(torch.randn(2, 8), torch.randn(2, 8, device="meta"), torch.ones(8)), ValueError,
     "z: expected device cpu"),
])
def test_rmsnorm_gated_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_rmsnorm_gated_compile_fullgraph():
    x, z, w = gated_inputs((2, 1, 4, 16), torch.float32)
    f = torch.compile(lambda x, z: norm.rmsnorm_gated(x, z, w, 1e-6), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x, z), norm.rmsnorm_gated(x, z, w, 1e-6))


# ------------------------------------------------------------------ compile
def test_torch_compile_fullgraph_cpu():
    def f(x, r, w):
        n, s = ember.ops.add_rmsnorm(x, r, w, 1e-6)
        return ember.ops.rmsnorm(n, w, 1e-6) + s

    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, r, w), f(x, r, w))


def test_compile_traces_the_registered_op(monkeypatch):
    seen = []
    real = norm._impl
    monkeypatch.setattr(norm, "_impl", lambda *a: seen.append(_dispatch.compiling()) or real(*a))
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: ember.ops.rmsnorm(x, w, 1e-6), fullgraph=True, backend="aot_eager")
    f(torch.randn(2, 8), torch.randn(8))
    # the custom op runs outside tracing (it is opaque to dynamo), so _impl never sees compiling()==True
    assert seen and not any(seen)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("call, exc, words", [
    (lambda: ember.ops.add_rmsnorm(torch.randn(2, 8), torch.randn(2, 8).half(), torch.ones(8), 1e-6), TypeError, "residual"),
    (lambda: ember.ops.add_rmsnorm(torch.randn(2, 8), torch.randn(1, 8), torch.ones(8), 1e-6), ValueError, "broadcasting"),
    (lambda: ember.ops.add_rmsnorm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(7), 1e-6), ValueError, "weight"),
    (lambda: ember.ops.rmsnorm(torch.randint(0, 3, (2, 8)), torch.ones(8), 1e-6), TypeError, "x"),
    (lambda: ember.ops.rmsnorm(torch.randn(2, 8), torch.ones(8), 0.0), ValueError, "eps"),
    (lambda: ember.ops.rmsnorm(torch.randn(2, 8), torch.ones(8), -1.0), ValueError, "eps"),
    (lambda: ember.ops.rmsnorm(torch.randn(2, 8), torch.ones(8), float("nan")), ValueError, "eps"),
    (lambda: ember.ops.rmsnorm(torch.randn(2, 8), torch.ones(2, 8), 1e-6), ValueError, "weight"),
    (lambda: ember.ops.rmsnorm(torch.randn(2, 16385), torch.ones(16385), 1e-6), ValueError, "16384"),
    (lambda: ember.ops.rmsnorm([1.0, 2.0], torch.ones(2), 1e-6), TypeError, "x"),
    (lambda: ember.ops.add_rmsnorm(torch.randn(2, 8), None, torch.ones(8), 1e-6), TypeError, "residual"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_device_mismatch_named():
    meta_w = torch.ones(8, device="meta")
    with pytest.raises(ValueError, match="weight: expected device cpu"):
        ember.ops.rmsnorm(torch.randn(2, 8), meta_w, 1e-6)


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 2048), (3, 99), (2, 7, 123), (4096, 8192), (5, 16384)])
def test_gpu_kernel_matches_reference(cuda, dtype, shape):
    x, r = torch.randn(shape, device=cuda).to(dtype), torch.randn(shape, device=cuda).to(dtype)
    w = torch.randn(shape[-1], device=cuda).to(dtype)
    H = shape[-1]
    out, new_res = poisoned(shape, dtype, cuda), poisoned(shape, dtype, cuda)
    _dispatch.kernels("norm").add_rmsnorm(x.view(-1, H), r.view(-1, H), w, 1e-6, out.view(-1, H), new_res.view(-1, H))
    exp_n, exp_r = float64_add_rmsnorm(x, r, w, 1e-6)
    assert torch.equal(new_res, exp_r)
    assert_close(out, exp_n, dtype)


@pytest.mark.gpu
def test_gpu_compile_fullgraph(cuda):
    x, r, w = (torch.randn(4, 2048, device=cuda, dtype=torch.bfloat16) for _ in range(3))
    w = w[0]
    f = torch.compile(lambda x, r: ember.ops.add_rmsnorm(x, r, w, 1e-6), fullgraph=True)
    for got, exp in zip(f(x, r), norm.add_rmsnorm_reference(x, r, w, 1e-6)):
        assert_close(got, exp)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(cuda):
    x = torch.randn(2, 2048, device=cuda, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(2048, device=cuda, dtype=torch.bfloat16)
    ember.ops.add_rmsnorm(x, r, w, 1e-6)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, new_res = ember.ops.add_rmsnorm(x, r, w, 1e-6)
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    g.replay()
    exp_n, exp_r = norm.add_rmsnorm_reference(x, r, w, 1e-6)
    assert torch.equal(new_res, exp_r)
    assert_close(out, exp_n)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 32, 128), (4, 1, 32, 128), (1, 300, 32, 128), (3, 99), (2, 16384)])
def test_gpu_rmsnorm_gated_bit_exact(cuda, dtype, shape):
    """Equal to the two-step path (rmsnorm kernel, then torch's CUDA silu and multiply) bit for bit."""
    x, z, w = gated_inputs(shape, dtype, cuda)
    assert torch.equal(norm.rmsnorm_gated(x, z, w, 1e-6), two_step(x, z, w, 1e-6))


@pytest.mark.gpu
def test_gpu_rmsnorm_gated_cuda_graph(cuda):
    x, z, w = gated_inputs((1, 1, 32, 128), torch.bfloat16, cuda)
    norm.rmsnorm_gated(x, z, w, 1e-6)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = norm.rmsnorm_gated(x, z, w, 1e-6)
    x.copy_(torch.randn_like(x))
    z.copy_(torch.randn_like(z) * 3)
    g.replay()
    assert torch.equal(out, two_step(x, z, w, 1e-6))


# ------------------------------------------------------------------ rmsnorm_silu (the Wan VAE's norm + SiLU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 99), (2, 5, 256)])
def test_rmsnorm_silu_kernel_interpreter(interpreter, dtype, shape):
    x = (torch.randn(shape) * 3).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    out = poisoned(shape, dtype, "cpu")
    H = shape[-1]
    _dispatch.kernels("norm").rmsnorm_silu(x.view(-1, H), w, 1e-6, out.view(-1, H))
    # bit for bit: silu (numpy's float32 exp, as the interpreter computes it) of the rmsnorm kernel's
    # rounded output
    n = ember.ops.rmsnorm(x, w, 1e-6).float().numpy()
    with np.errstate(over="ignore"):
        exp = torch.from_numpy(n / (np.float32(1) + np.exp(-n))).to(dtype)
    assert torch.equal(out, exp)
    assert_close(out, norm.rmsnorm_silu_reference(x, w, 1e-6), dtype)  # torch's silu, one rounding
    assert torch.equal(norm.rmsnorm_silu(x, w, 1e-6), out)  # the public op takes this kernel


def test_rmsnorm_silu_writes_into_a_strided_out_interpreter(interpreter):
    x, w = torch.randn(6, 4, 32), torch.randn(32)
    buf = poisoned((6, 7, 32), torch.float32, "cpu")
    before = buf.clone()
    got = norm.rmsnorm_silu(x, w, 1e-6, out=buf[:, 2:6])   # rows of out: stride 32 inside, 224 between groups
    assert got.data_ptr() == buf[:, 2:6].data_ptr()
    assert_close(buf[:, 2:6], norm.rmsnorm_silu_reference(x, w, 1e-6), torch.float32)
    bits, bits_before = buf.view(torch.int32), before.view(torch.int32)  # the poison is NaN: compare bits
    assert torch.equal(bits[:, :2], bits_before[:, :2]) and torch.equal(bits[:, 6:], bits_before[:, 6:])


def test_rmsnorm_silu_reference_path_and_out():
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16()
    exp = F.silu(norm.add_rmsnorm_reference(x, None, w, 1e-6)[0])
    assert torch.equal(norm.rmsnorm_silu(x, w, 1e-6), exp)
    out = torch.empty(3, 2, 40, dtype=torch.bfloat16)[:, 1]
    assert norm.rmsnorm_silu(x, w, 1e-6, out=out) is out and torch.equal(out, exp)


def test_rmsnorm_silu_bias_reference_path():
    x, w, b = torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16(), torch.randn(40).bfloat16()
    assert torch.equal(norm.rmsnorm_silu(x, w, 1e-6, bias=b), norm.rmsnorm_silu(x + b, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_silu_bias_kernel_interpreter(interpreter, dtype):
    """The folded bias: the bits of adding it first (rounded to x's dtype), into a strided out."""
    x, w, b = torch.randn(2, 3, 48).to(dtype), torch.randn(48).to(dtype), torch.randn(48).to(dtype)
    buf = torch.zeros(2, 5, 48, dtype=dtype)
    got = norm.rmsnorm_silu(x, w, 1e-6, out=buf[:, 1:4], bias=b)
    assert torch.equal(got, norm.rmsnorm_silu(x + b, w, 1e-6))
    assert bool((buf[:, 0] == 0).all() and (buf[:, 4] == 0).all())


@pytest.mark.parametrize("call, exc, words", [
    (lambda: norm.rmsnorm_silu(torch.randn(2, 8), torch.ones(8), bias=torch.ones(7)), ValueError, "bias: expected length 8"),
    (lambda: norm.rmsnorm_silu(torch.randn(2, 8), torch.ones(8), bias=torch.ones(8).bfloat16()), TypeError, "bias"),
    (lambda: norm.rmsnorm_silu(torch.randn(2, 8), torch.ones(8), out=torch.empty(2, 8).bfloat16()), TypeError, "out"),
    (lambda: norm.rmsnorm_silu(torch.randn(2, 8), torch.ones(8), out=torch.empty(2, 7)), ValueError, "out: expected shape"),
    (lambda: norm.rmsnorm_silu(torch.randn(2, 8), torch.ones(8), out=torch.empty(8, 2).t()), ValueError,
     "out: expected a contiguous last dimension"),
    (lambda: norm.rmsnorm_silu(torch.randn(2, 8), torch.ones(7)), ValueError, "weight"),
])
def test_rmsnorm_silu_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 99), (1, 4, 192, 336, 256)])
def test_gpu_rmsnorm_silu_bit_exact(cuda, dtype, shape):
    """Equal to the two-step path (rmsnorm kernel, then torch's CUDA silu) bit for bit, into a strided out."""
    x = (torch.randn(shape, device=cuda) * 3).to(dtype)
    w = torch.randn(shape[-1], device=cuda).to(dtype)
    buf = torch.empty((2,) + shape, device=cuda, dtype=dtype)
    got = norm.rmsnorm_silu(x, w, 1e-6, out=buf[1])
    assert torch.equal(got, F.silu(ember.ops.rmsnorm(x, w, 1e-6)))
