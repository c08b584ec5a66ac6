"""ember.ops.moe_experts_train: forward == moe_experts, backward vs float64 autograd of the reference,
through the reference path and the Triton kernels (interpreter on CPU), odd shapes, empty experts,
strided inputs, torch.compile, bad input; full width on the GPU."""
import importlib

import pytest
import torch

import ember
from tests.helpers import assert_close

mt = importlib.import_module("ember.ops.moe_train")

# (T, H, I, E, k): odd sizes, ragged against the 16-wide interpreter tiles; T=1; k = E
SHAPES = [(21, 48, 40, 5, 3), (1, 32, 16, 4, 2), (37, 64, 24, 7, 7)]
PATHS = ["reference", "kernel"]


def problem(T, H, I, E, k, dtype=torch.float32, empty_expert=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    wgu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    wd = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    logits = torch.randn(T, E, generator=g)
    if empty_expert and k < E:
        logits[:, E - 1] = -1e4  # the last expert gets no tokens
    tw, ids = torch.topk(logits.softmax(-1), k)
    return [t.to(dtype) for t in (x, wgu, wd, tw.double())], ids


def float64_grads(inputs, ids, grad_out):
    """Autograd of the reference in float64: the oracle for every gradient."""
    leaves = [t.double().requires_grad_(True) for t in inputs]
    out = mt.moe_experts_train_reference(*leaves, ids)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out.double())


def run(inputs, ids, grad_out, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = ember.ops.moe_experts_train(*leaves, ids, **kw)
    return out.detach(), torch.autograd.grad(out, leaves, grad_out)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def use_path(path, monkeypatch):
    if path == "kernel":
        request_interpreter(monkeypatch)


def request_interpreter(monkeypatch):
    from ember import _dispatch
    if torch.cuda.is_available() or not _dispatch.triton_available():
        pytest.skip("interpreter tests run on CPU-only machines with triton")
    monkeypatch.setenv("EMBER_FORCE_TRITON", "1")


# ------------------------------------------------------------------ reference
def test_backward_reference_matches_float64_autograd():
    """The hand-written backward (the reference path's) against autograd of the forward spec."""
    inputs, ids = problem(*SHAPES[0], dtype=torch.float64)
    grad_out = torch.randn(SHAPES[0][0], SHAPES[0][1], dtype=torch.float64)
    _, want = float64_grads(inputs, ids, grad_out)
    got = mt.moe_experts_train_backward_reference(grad_out, *inputs, ids)
    for name, a, b in zip(("dx", "dw_gate_up", "dw_down", "dtopk_weights"), got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=name)


# ------------------------------------------------------------------ forward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_moe_experts(dtype, monkeypatch):
    request_interpreter(monkeypatch)
    (x, wgu, wd, tw), ids = problem(*SHAPES[0], dtype=dtype)
    got = ember.ops.moe_experts_train(x, wgu, wd, tw, ids)
    assert_close(got, ember.ops.moe_experts(x, wgu, wd, tw.float(), ids))
    assert_close(got, mt.moe_experts_train_reference(x, wgu, wd, tw, ids))


# ------------------------------------------------------------------ backward, float32
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_forward_and_grads_vs_float64(path, shape, monkeypatch):
    use_path(path, monkeypatch)
    inputs, ids = problem(*shape)
    grad_out = torch.randn(shape[0], shape[1])
    want_out, want = float64_grads(inputs, ids, grad_out)
    out, got = run(inputs, ids, grad_out)
    torch.testing.assert_close(out.double(), want_out, atol=2e-6, rtol=1e-5)
    for name, a, b in zip(("x", "w_gate_up", "w_down", "topk_weights"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=1e-5, msg=name)
    # the expert nobody chose: exact zero gradients, every element written
    if shape[4] < shape[3]:
        assert torch.all(got[1][-1] == 0) and torch.all(got[2][-1] == 0)


def test_every_output_element_written(monkeypatch):
    """Kernel buffers poisoned with NaN: the backward writes every element of every gradient and
    intermediate (zeros for the expert with no tokens), and nothing it reads is left unwritten."""
    request_interpreter(monkeypatch)
    real_empty = torch.empty

    def nan_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    inputs, ids = problem(*SHAPES[0])
    grad_out = torch.randn(SHAPES[0][0], SHAPES[0][1])
    _, want = float64_grads(inputs, ids, grad_out)
    monkeypatch.setattr(torch, "empty", nan_empty)
    _, got = run(inputs, ids, grad_out)
    monkeypatch.setattr(torch, "empty", real_empty)
    for a, b in zip(got, want):
        assert not a.isnan().any()
        torch.testing.assert_close(a.double(), b, atol=2e-6, rtol=1e-5)


# ------------------------------------------------------------------ backward, bf16
@pytest.mark.parametrize("path", PATHS)
def test_bf16_grads_vs_float64(path, monkeypatch):
    """bf16 inputs: each gradient within 1.2% (relative Frobenius norm) of the float64 gradients of the
    same bf16 inputs. The kernel rounds dgu and each pair's dx row to bf16 once (2^-9 relative each),
    the reference path only the result; both stay well under 3 bf16 roundings."""
    use_path(path, monkeypatch)
    inputs, ids = problem(*SHAPES[2], dtype=torch.bfloat16)
    grad_out = torch.randn(SHAPES[2][0], SHAPES[2][1]).bfloat16()
    want_out, want = float64_grads(inputs, ids, grad_out)
    out, got = run(inputs, ids, grad_out)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, want_out) < 6e-3
    for name, a, b in zip(("x", "w_gate_up", "w_down", "topk_weights"), got, want):
        assert a.dtype == torch.bfloat16, name
        assert rel_err(a, b) < 1.2e-2, (name, rel_err(a, b))


# ------------------------------------------------------------------ layouts, partial grads
def test_strided_inputs_and_partial_grads(monkeypatch):
    """x with a non-unit last stride, w_down a transposed view, int32 ids, frozen x and weights."""
    request_interpreter(monkeypatch)
    (x, wgu, wd, tw), ids = problem(*SHAPES[0])
    x_strided = torch.stack([x, x], -1)[..., 0]  # stride (2H, 2)
    wd_t = wd.transpose(1, 2).contiguous().transpose(1, 2)
    grad_out = torch.randn_like(x)
    _, want = float64_grads([x, wgu, wd, tw], ids, grad_out)
    tw_leaf = tw.clone().requires_grad_(True)
    out = ember.ops.moe_experts_train(x_strided, wgu, wd_t, tw_leaf, ids.to(torch.int32))
    (g,) = torch.autograd.grad(out, [tw_leaf], grad_out)
    torch.testing.assert_close(g.double(), want[3], atol=2e-6, rtol=1e-5)


# ------------------------------------------------------------------ compile
@pytest.mark.parametrize("path", PATHS)
def test_torch_compile_fullgraph_backward(path, monkeypatch):
    use_path(path, monkeypatch)
    inputs, ids = problem(*SHAPES[1])
    grad_out = torch.randn(SHAPES[1][0], SHAPES[1][1])

    def f(x, wgu, wd, tw):
        return ember.ops.moe_experts_train(x, wgu, wd, tw, ids)

    torch._dynamo.reset()
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    got = torch.autograd.grad(out, leaves, grad_out)
    _, want = run(inputs, ids, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ------------------------------------------------------------------ bad input
def test_bad_input():
    (x, wgu, wd, tw), ids = problem(*SHAPES[0])
    f = ember.ops.moe_experts_train
    with pytest.raises(TypeError, match="w_gate_up"):
        f(x, wgu.to(torch.float8_e4m3fn), wd, tw, ids)
    with pytest.raises(TypeError, match="w_gate_up"):
        f(x, wgu.bfloat16(), wd.bfloat16(), tw, ids)
    with pytest.raises(ValueError, match="w_down"):
        f(x, wgu, wd[:, :, :-1], tw, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        f(x, wgu, wd, tw, torch.full_like(ids, wgu.shape[0]))
    with pytest.raises(ValueError, match="topk_weights"):
        f(x, wgu, wd, tw[:, :-1], ids)
    with pytest.raises(ValueError, match="w_gate_up"):
        f(x, wgu.to("meta"), wd.to("meta"), tw, ids)
    with pytest.raises(TypeError, match="x"):
        f(x.long(), wgu, wd, tw, ids)


# ------------------------------------------------------------------ GPU, full width
def _qwen3_30b_layer(T, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    E, k, H, I = 128, 8, 2048, 768
    x = torch.randn(T, H, generator=g, device=device).to(dtype)
    wgu = (torch.randn(E, 2 * I, H, generator=g, device=device) / H ** 0.5).to(dtype)
    wd = (torch.randn(E, H, I, generator=g, device=device) / I ** 0.5).to(dtype)
    logits = torch.randn(T, E, generator=g, device=device)
    tw, ids = torch.topk(logits.softmax(-1), k)
    return [x, wgu, wd, (tw / tw.sum(-1, keepdim=True)).to(dtype)], ids


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 4096])
def test_gpu_fp32_kernels_vs_reference(cuda, T):
    """fp32 kernels (IEEE dots) against the reference's float64 gradients at full width."""
    inputs, ids = _qwen3_30b_layer(T, torch.float32, cuda)
    grad_out = torch.randn(T, 2048, device=cuda)
    want_out, want = float64_grads(inputs, ids, grad_out)
    out, got = run(inputs, ids, grad_out)
    assert rel_err(out, want_out) < 1e-5
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


@pytest.mark.gpu
def test_gpu_bf16_full_width(cuda):
    """bf16 at 8192 tokens: the kernels' gradients are as close to float64 (relative norm) as stock
    bf16 autograd of the reference is: within 1.5x of its error, and cosine similarity > 0.9999."""
    T = 8192
    inputs, ids = _qwen3_30b_layer(T, torch.bfloat16, cuda)
    grad_out = torch.randn(T, 2048, device=cuda).bfloat16()
    _, want = float64_grads(inputs, ids, grad_out)
    _, got = run(inputs, ids, grad_out)
    bf16_leaves = [t.clone().requires_grad_(True) for t in inputs]
    stock = torch.autograd.grad(mt.moe_experts_train_reference(*bf16_leaves, ids), bf16_leaves, grad_out)
    for name, a, s, b in zip(("x", "w_gate_up", "w_down", "topk_weights"), got, stock, want):
        cos = torch.nn.functional.cosine_similarity(a.double().flatten(), b.flatten(), 0).item()
        assert cos > 0.9999, (name, cos)
        assert rel_err(a, b) < 1.5 * rel_err(s, b) + 1e-3, (name, rel_err(a, b), rel_err(s, b))


@pytest.mark.gpu
def test_gpu_compile(cuda):
    inputs, ids = _qwen3_30b_layer(256, torch.bfloat16, cuda)
    grad_out = torch.randn(256, 2048, device=cuda).bfloat16()
    torch._dynamo.reset()
    f = torch.compile(lambda *a: ember.ops.moe_experts_train(*a, ids), fullgraph=True)
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    got = torch.autograd.grad(f(*leaves), leaves, grad_out)
    _, want = run(inputs, ids, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
