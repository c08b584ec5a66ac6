import pytest
import torch
import torch.nn.functional as F

import ember
from ember.ops import cross_entropy as lce
from tests.helpers import force_triton_or_skip

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Gradient error relative to the largest gradient element: the kernel path rounds the logits'
# gradient to the input dtype before its two GEMMs (as a bf16 F.linear backward does) and the
# result once more; float32 keeps ~1e-7.
GRAD_TOL = {torch.float32: 2e-6, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}
LOSS_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}  # fp32 math on exact inputs


def float64_loss(x, w, b, t, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_softcap=None):
    """The oracle: float64 logits materialised, then torch's cross-entropy."""
    z = x.double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    return F.cross_entropy(z.reshape(-1, w.shape[0]), t.reshape(-1).long(), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing).reshape(
                               t.shape if reduction == "none" else ())


def operands(N, H, V, dtype, *, bias=True, ignored_every=5, lead=()):
    x = torch.randn(*lead, N, H).to(dtype).requires_grad_()
    w = (torch.randn(V, H) / H ** 0.5 * 3).to(dtype).requires_grad_()  # logits of O(3): a peaked softmax
    b = torch.randn(V).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (*lead, N))
    if ignored_every:
        t.view(-1)[::ignored_every] = -100
    return x, w, b, t


def check_against_float64(x, w, b, t, dtype, **kw):
    loss = ember.ops.linear_cross_entropy(x, w, t, bias=b, **kw)
    assert loss.dtype == torch.float32
    inputs = [a for a in (x, w, b) if a is not None]
    go = torch.randn_like(loss)
    grads = torch.autograd.grad(loss, inputs, go)
    ref_inputs = [a.detach().double().requires_grad_() for a in inputs]
    xd, wd = ref_inputs[:2]
    bd = ref_inputs[2] if b is not None else None
    exp = float64_loss(xd, wd, bd, t, **kw)
    exp_grads = torch.autograd.grad(exp, ref_inputs, go.double())
    assert loss.shape == exp.shape
    torch.testing.assert_close(loss.double(), exp, atol=LOSS_TOL[dtype] * max(1.0, exp.abs().max().item()), rtol=0)
    for name, g, e, a in zip("xwb", grads, exp_grads, inputs):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        err = (g.double() - e).abs().max().item() / e.abs().max().item()
        assert err <= GRAD_TOL[dtype], f"grad {name}: relative error {err:.2e} > {GRAD_TOL[dtype]:.0e}"


# ------------------------------------------------------------------ both paths vs float64
# force=True runs the Triton kernels through the interpreter; V = 101 is not a multiple of any tile.
@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction,smoothing,softcap", [("mean", 0.0, None), ("sum", 0.1, 5.0), ("none", 0.25, None),
                                                         ("mean", 0.0, 2.5)])
def test_matches_float64(monkeypatch, force, dtype, reduction, smoothing, softcap):
    force_triton_or_skip(monkeypatch, force)
    x, w, b, t = operands(37, 40, 101, dtype)
    check_against_float64(x, w, b, t, dtype, reduction=reduction, label_smoothing=smoothing, logit_softcap=softcap)


@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
def test_leading_dims_int32_target_no_bias(monkeypatch, force):
    force_triton_or_skip(monkeypatch, force)
    x, w, _, t = operands(9, 24, 70, torch.float32, bias=False, lead=(2,), ignored_every=4)
    check_against_float64(x, w, None, t.to(torch.int32), torch.float32, reduction="none")
    t3 = torch.where(t == -100, 3, t).to(torch.int32)  # a class id as ignore_index: those rows drop out
    check_against_float64(x, w, None, t3, torch.float32, ignore_index=3)


@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
def test_chunked_paths_match_float64(monkeypatch, force):
    """Many vocab chunks in the kernel's backward (256 columns each) and many row chunks in the
    reference: the chunk loops, not one pass, are what is tested."""
    force_triton_or_skip(monkeypatch, force)
    monkeypatch.setattr(lce, "_G_CHUNK_BYTES", 1)  # the 256-column floor
    monkeypatch.setattr(lce, "_REF_CHUNK_ELEMENTS", 3 * 700)  # 3 rows per reference chunk
    x, w, b, t = operands(20, 32, 700, torch.float32)
    check_against_float64(x, w, b, t, torch.float32, label_smoothing=0.05)


@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(monkeypatch, force, reduction):
    force_triton_or_skip(monkeypatch, force)
    x, w, b, t = operands(6, 16, 50, torch.bfloat16)
    t.fill_(-100)
    loss = ember.ops.linear_cross_entropy(x, w, t, bias=b, reduction=reduction, label_smoothing=0.1)
    loss.sum().backward()
    assert torch.count_nonzero(loss) == 0
    for g in (x.grad, w.grad, b.grad):
        assert torch.isfinite(g).all() and torch.count_nonzero(g) == 0


@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
def test_frozen_weight_gets_no_grad(monkeypatch, force):
    force_triton_or_skip(monkeypatch, force)
    x, w, _, t = operands(8, 16, 40, torch.float32, bias=False)
    w.requires_grad_(False)
    loss = ember.ops.linear_cross_entropy(x, w, t)
    (gx,) = torch.autograd.grad(loss, (x,))
    xd = x.detach().double().requires_grad_()
    (exp,) = torch.autograd.grad(float64_loss(xd, w.double(), None, t), (xd,))
    torch.testing.assert_close(gx.double(), exp, atol=1e-7, rtol=1e-5)


def test_no_grad_forward_and_empty_batch():
    x, w, b, t = operands(5, 8, 30, torch.float32)
    with torch.no_grad():
        loss = ember.ops.linear_cross_entropy(x, w, t, bias=b)
    torch.testing.assert_close(loss.double(), float64_loss(x.detach(), w.detach(), b.detach(), t), atol=1e-6, rtol=0)
    empty = ember.ops.linear_cross_entropy(torch.zeros(0, 8), w, torch.zeros(0, dtype=torch.long))
    assert empty.item() == 0.0


def test_compile_fullgraph_reference():
    x, w, b, t = operands(12, 16, 45, torch.float32)

    def f(x, w, b, t):
        return ember.ops.linear_cross_entropy(x, w, t, bias=b, label_smoothing=0.1, logit_softcap=4.0)

    exp = f(x, w, b, t)
    exp_g = torch.autograd.grad(exp, (x, w, b))
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, w, b, t)
    got_g = torch.autograd.grad(got, (x, w, b))
    torch.testing.assert_close(got, exp, atol=0, rtol=0)
    for g, e in zip(got_g, exp_g):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


# ------------------------------------------------------------------ bad input
def test_bad_inputs_name_the_argument():
    x, w, b, t = operands(4, 8, 10, torch.float32)
    f = ember.ops.linear_cross_entropy
    with pytest.raises(ValueError, match=r"target: expected class ids in \[0, 10\).*got 10"):
        f(x, w, torch.tensor([0, 1, 10, -100]))
    with pytest.raises(ValueError, match="target: expected class ids"):
        f(x, w, torch.tensor([0, -1, 2, 3]))
    f(x, w, torch.tensor([0, 1, 2, -100]), check=False)  # in range: fine either way
    with pytest.raises(ValueError, match=r"target: expected shape \(4,\)"):
        f(x, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="target: expected dtype"):
        f(x, w, t.float())
    with pytest.raises(ValueError, match=r"x: expected last dim 8"):
        f(torch.randn(4, 9), w, t)
    with pytest.raises(TypeError, match="weight: expected dtype torch.float32"):
        f(x, w.detach().bfloat16(), t)
    with pytest.raises(ValueError, match="bias: expected length 10"):
        f(x, w, t, bias=torch.zeros(11))
    with pytest.raises(ValueError, match="weight: expected device cpu"):
        f(x, w.detach().to("meta"), t)
    with pytest.raises(ValueError, match=r"label_smoothing: expected a value in \[0, 1\), got 1.0"):
        f(x, w, t, label_smoothing=1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        f(x, w, t, label_smoothing=-0.1)
    with pytest.raises(ValueError, match="reduction: expected one of"):
        f(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="logit_softcap"):
        f(x, w, t, logit_softcap=0.0)


# ------------------------------------------------------------------ GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_full_vocab_against_float64(cuda, dtype):
    """A full Qwen3 vocabulary on the GPU, held to float64 logits of the same rounded inputs. torch's
    own float32 path (F.linear + F.cross_entropy) is measured beside it: over a 151,936-term
    reduction its gradient error is of the same order as ember's, so ember must be within GRAD_TOL or
    at least as close to float64 as that path (the bound a user of the stock path already accepts)."""
    N, H, V = 2048, 2048, 151936
    x = torch.randn(N, H, device=cuda, dtype=dtype, requires_grad=True)
    w = (torch.randn(V, H, device=cuda) / H ** 0.5 * 2).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), device=cuda)
    t[::7] = -100
    loss = ember.ops.linear_cross_entropy(x, w, t)
    gx, gw = torch.autograd.grad(loss, (x, w))
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    exp = F.cross_entropy(xd @ wd.t(), t)
    ex, ew = torch.autograd.grad(exp, (xd, wd))
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    stock = F.cross_entropy(xf @ wf.t(), t)
    sx, sw = torch.autograd.grad(stock, (xf, wf))
    torch.testing.assert_close(loss.double(), exp, atol=1e-5, rtol=1e-5)
    for name, g, s, e in (("x", gx, sx, ex), ("weight", gw, sw, ew)):
        scale = e.abs().max().item()
        err = (g.double() - e).abs().max().item() / scale
        stock_err = (s.double() - e).abs().max().item() / scale
        assert err <= max(GRAD_TOL[dtype], stock_err), f"grad {name}: {err:.2e} (float32 torch path {stock_err:.2e})"


@pytest.mark.gpu
def test_gpu_peak_memory_at_bench_shape(cuda):
    N, H, V = 8192, 2048, 151936
    x = torch.randn(N, H, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device=cuda) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device=cuda)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = ember.ops.linear_cross_entropy(x, w, t)
    loss.backward()
    torch.cuda.synchronize()
    extra_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
    assert torch.isfinite(loss) and torch.isfinite(w.grad).all() and torch.isfinite(x.grad).all()
    assert extra_gb <= 0.75, f"peak extra {extra_gb:.3f} GB (grad_W alone is {w.numel() * 2 / 1e9:.3f} GB)"
