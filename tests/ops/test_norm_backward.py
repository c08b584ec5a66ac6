import pytest
import torch

import ember
from ember.ops import norm
from tests.helpers import assert_close, force_triton_or_skip

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float64_grads(s, w, eps, g, g_res):
    """Independent float64 autograd of ``normed = s * rsqrt(mean(s^2) + eps) * w`` (plus ``s`` itself as
    the new-residual output when ``g_res`` is given) at the rounded rows ``s``."""
    sd, wd = s.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * wd
    outs, grads = [y], [g.double()]
    if g_res is not None:
        outs.append(sd)
        grads.append(g_res.double())
    return torch.autograd.grad(outs, (sd, wd), grads)


@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 99), (2, 5, 130)])
def test_rmsnorm_backward_matches_float64(monkeypatch, force, dtype, shape):
    force_triton_or_skip(monkeypatch, force)
    x = torch.randn(shape).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1])).to(dtype).requires_grad_()
    y = ember.ops.rmsnorm(x, w, 1e-6)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    ex, ew = float64_grads(x, w, 1e-6, g, None)
    assert gx.dtype == dtype and gw.dtype == dtype
    assert_close(gx, ex, dtype)
    assert_close(gw, ew, dtype)
    assert_close(y, float64_forward(x, w, 1e-6), dtype)


def float64_forward(s, w, eps):
    sd = s.detach().double()
    return sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * w.detach().double()


@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_residual_out", [True, False])
def test_add_rmsnorm_backward_matches_float64(monkeypatch, force, dtype, use_residual_out):
    force_triton_or_skip(monkeypatch, force)
    shape = (3, 4, 77)
    x, r = torch.randn(shape).to(dtype).requires_grad_(), torch.randn(shape).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(77)).to(dtype).requires_grad_()
    normed, new_res = ember.ops.add_rmsnorm(x, r, w, 1e-5)
    g = torch.randn_like(normed)
    g_res = torch.randn_like(new_res) if use_residual_out else None
    outs, grads = ([normed, new_res], [g, g_res]) if use_residual_out else ([normed], [g])
    gx, gr, gw = torch.autograd.grad(outs, (x, r, w), grads)
    s = (x.detach().float() + r.detach().float()).to(dtype)  # the stored sum, as the op documents
    assert torch.equal(new_res.detach(), s)
    es, ew = float64_grads(s, w, 1e-5, g, g_res)
    assert_close(gx, es, dtype)
    assert torch.equal(gx, gr)
    assert_close(gw, ew, dtype)


def test_kernel_partials_over_many_rows_and_strided_rows(monkeypatch):
    """More rows than programs (each program sums a run of rows) on a row-strided view of x."""
    force_triton_or_skip(monkeypatch, True)
    base = torch.randn(50, 2, 64)
    x = base[:, 1].requires_grad_()  # rows 128 elements apart
    w = torch.randn(64, requires_grad=True)
    y = ember.ops.rmsnorm(x, w, 1e-6)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    ex, ew = float64_grads(x, w, 1e-6, g, None)
    assert_close(gx, ex, torch.float32)
    assert_close(gw, ew, torch.float32)


def test_no_grad_call_keeps_the_direct_path(monkeypatch):
    """A call that needs no gradient never goes through the registered (autograd) ops."""
    def boom(*a, **k):
        raise AssertionError("custom op called")
    monkeypatch.setattr(norm, "_rmsnorm_op", boom)
    monkeypatch.setattr(norm, "_add_rmsnorm_op", boom)
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    ember.ops.rmsnorm(x, w)
    ember.ops.add_rmsnorm(x, r, w)
    with torch.no_grad():
        ember.ops.rmsnorm(x.requires_grad_(), w)


def test_compile_fullgraph_backward():
    x, r = torch.randn(4, 48, requires_grad=True), torch.randn(4, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)

    def f(x, r, w):
        normed, res = ember.ops.add_rmsnorm(x, r, w, 1e-6)
        return (ember.ops.rmsnorm(normed, w, 1e-6) * res).sum()

    exp = torch.autograd.grad(f(x, r, w), (x, r, w))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(x, r, w), (x, r, w))
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


def test_hf_qwen3_rmsnorm_gradients_agree():
    """Against transformers' own module (fp32): the gradients a patched model would see."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    m = Qwen3RMSNorm(40, eps=1e-6)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(6, 40, requires_grad=True)
    g = torch.randn(6, 40)
    ex, ew = torch.autograd.grad(m(x), (x, m.weight), g)
    gx, gw = torch.autograd.grad(ember.ops.rmsnorm(x, m.weight, 1e-6), (x, m.weight), g)
    torch.testing.assert_close(gx, ex, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, ew, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_add_rmsnorm_backward_matches_float64(cuda, dtype):
    x = torch.randn(8192, 2048, device=cuda, dtype=dtype, requires_grad=True)
    r = torch.randn(8192, 2048, device=cuda, dtype=dtype, requires_grad=True)
    w = (1 + 0.5 * torch.randn(2048, device=cuda)).to(dtype).requires_grad_()
    normed, res = ember.ops.add_rmsnorm(x, r, w, 1e-6)
    g, g_res = torch.randn_like(normed), torch.randn_like(res)
    gx, gr, gw = torch.autograd.grad([normed, res], (x, r, w), [g, g_res])
    es, ew = float64_grads(res.detach(), w, 1e-6, g, g_res)
    assert_close(gx, es, dtype)
    assert torch.equal(gx, gr)
    assert_close(gw, ew, dtype, atol=2e-2 if dtype == torch.bfloat16 else 1e-3)  # a sum of 8192 rows
