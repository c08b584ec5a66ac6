import importlib

import pytest
import torch
import torch.nn.functional as F

import ember
from tests.helpers import assert_close, force_triton_or_skip, poisoned

sw = importlib.import_module("ember.ops.swiglu")  # the module (ember.ops.swiglu is the function)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float64_swiglu(gate_up):
    g, u = gate_up.double().chunk(2, dim=-1)
    return F.silu(g) * u


@pytest.mark.parametrize("force", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (5, 2 * 77), (2, 3, 2 * 1100)])
def test_forward_and_backward_match_float64(monkeypatch, force, dtype, shape):
    force_triton_or_skip(monkeypatch, force)
    gu = (3 * torch.randn(shape)).to(dtype).requires_grad_()  # wide range: silu's tails both ways
    y, dgu = check_against_float64(gu)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2) and dgu.dtype == dtype


def check_against_float64(gu):
    """swiglu(gu) and its gradient for a random upstream gradient, each as close to the float64
    formula's as one rounding to gu's dtype allows; returns (y, grad of gu)."""
    y = ember.ops.swiglu(gu)
    g = torch.randn_like(y)
    (dgu,) = torch.autograd.grad(y, (gu,), g)
    gd = gu.detach().double().requires_grad_()
    exp = float64_swiglu(gd)
    (edgu,) = torch.autograd.grad(exp, (gd,), g.double())
    assert_close(y, exp, gu.dtype)
    assert_close(dgu, edgu, gu.dtype)
    return y, dgu


def test_kernel_writes_every_element_and_takes_strided_rows(monkeypatch):
    force_triton_or_skip(monkeypatch, True)
    from ember import _dispatch
    k = _dispatch.kernels("swiglu")
    base = torch.randn(7, 3, 2 * 40)
    gu = base[:, 1]  # rows 240 elements apart
    out = poisoned((7, 40), torch.float32, "cpu")
    k.swiglu(gu, out)
    assert_close(out, float64_swiglu(gu), torch.float32)


def test_matches_hf_qwen3_mlp_activation():
    """gate rows then up rows, as Qwen3's MLP computes act_fn(gate_proj(x)) * up_proj(x)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
    mlp = Qwen3MLP(Qwen3Config(hidden_size=32, intermediate_size=48))
    x = torch.randn(5, 32)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    torch.testing.assert_close(mlp.down_proj(ember.ops.swiglu(gate_up)), mlp(x), atol=1e-6, rtol=1e-5)


def test_no_grad_call_skips_the_registered_op(monkeypatch):
    monkeypatch.setattr(sw, "_swiglu_op", lambda *a: (_ for _ in ()).throw(AssertionError("custom op called")))
    ember.ops.swiglu(torch.randn(3, 8))


def test_compile_fullgraph():
    gu = torch.randn(4, 64, requires_grad=True)

    def f(gu):
        return (ember.ops.swiglu(gu) ** 2).sum()

    (exp,) = torch.autograd.grad(f(gu), (gu,))
    torch._dynamo.reset()
    (got,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(gu), (gu,))
    torch.testing.assert_close(got, exp, atol=1e-6, rtol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="gate_up: expected an even last dim"):
        ember.ops.swiglu(torch.randn(3, 7))
    with pytest.raises(TypeError, match="gate_up: expected dtype"):
        ember.ops.swiglu(torch.zeros(3, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="gate_up: expected a torch.Tensor"):
        ember.ops.swiglu([1.0, 2.0])


@pytest.mark.gpu
def test_gpu_matches_float64_at_qwen3_shape(cuda):
    gu = torch.randn(8192, 2 * 6144, device=cuda, dtype=torch.bfloat16, requires_grad=True)
    check_against_float64(gu)
