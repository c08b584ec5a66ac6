import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _dispatch
from ember.ops import conv1d
from tests.helpers import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float64_causal_conv(x, w, b, prev, silu):
    """Independent float64 math: a plain loop over taps on the state-prefixed input."""
    xin = torch.cat([prev.double(), x.double()], dim=-1)
    T, K = x.shape[-1], w.shape[1]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(T):
        for j in range(K):
            y[..., t] += w[:, j].double() * xin[..., xin.shape[-1] - T + t - (K - 1) + j]
    if b is not None:
        y += b.double()[:, None]
    return y * torch.sigmoid(y) if silu else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,C,T,K,S", [(1, 8, 5, 4, 3), (2, 33, 1, 4, 4), (1, 130, 17, 3, 2), (3, 5, 2, 4, 6)])
@pytest.mark.parametrize("silu", [False, True])
def test_reference_matches_float64(dtype, B, C, T, K, S, silu):
    x, w, b = torch.randn(B, C, T).to(dtype), torch.randn(C, K).to(dtype), torch.randn(C).to(dtype)
    state = torch.randn(B, C, S).to(dtype)
    prev = state.clone()
    y = ember.ops.causal_conv1d(x, w, b, conv_state=state, activation="silu" if silu else None)
    assert_close(y, float64_causal_conv(x, w, b, prev[..., -(K - 1):], silu), dtype)
    expected_state = torch.cat([prev, x], dim=-1)[..., -S:]
    assert torch.equal(state, expected_state)


def test_prefill_then_steps_equals_one_long_conv():
    C, K = 16, 4
    w, b = torch.randn(C, K), torch.randn(C)
    x = torch.randn(2, C, 12)
    full = ember.ops.causal_conv1d(x, w, b, activation="silu")
    state = torch.zeros(2, C, K - 1)
    parts = [ember.ops.causal_conv1d(x[..., :7], w, b, conv_state=state, activation="silu")]
    for t in range(7, 12):
        parts.append(ember.ops.causal_conv1d(x[..., t:t + 1], w, b, conv_state=state, activation="silu"))
    torch.testing.assert_close(torch.cat(parts, -1), full, atol=1e-6, rtol=1e-6)


def test_matches_torch_conv1d_layer():
    conv = torch.nn.Conv1d(24, 24, 3, groups=24, padding=2)
    x = torch.randn(2, 24, 9)
    exp = conv(x)[..., :9]
    got = ember.ops.causal_conv1d(x, conv.weight.squeeze(1), conv.bias)
    torch.testing.assert_close(got, exp.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,C,T,K,S", [(1, 8, 1, 4, 3), (2, 70, 5, 3, 3), (1, 9, 100, 4, 4), (2, 3, 2, 4, 5)])
def test_kernel_matches_reference_interpreter(interpreter, dtype, B, C, T, K, S):
    # x as a transposed view [B, C, T] of a [B, T, C] projection, as models produce it
    x = torch.randn(B, T, C).to(dtype).transpose(1, 2)
    w, b = torch.randn(C, K).to(dtype), torch.randn(C).to(dtype)
    s_kernel, s_ref = torch.randn(B, C, S).to(dtype), None
    s_ref = s_kernel.clone()
    y = ember.ops.causal_conv1d(x, w, b, conv_state=s_kernel, activation="silu")
    exp = conv1d.causal_conv1d_reference(x, w, b, conv_state=s_ref, activation="silu")
    assert_close(y, exp, dtype)
    assert torch.equal(s_kernel, s_ref)


def test_kernel_without_state_interpreter(interpreter):
    x, w = torch.randn(2, 10, 7), torch.randn(10, 4)
    assert_close(ember.ops.causal_conv1d(x, w), conv1d.causal_conv1d_reference(x, w), torch.float32)


def _is_channels_last(y):
    return y.transpose(1, 2).is_contiguous() and y.stride(1) == 1


@pytest.mark.parametrize("B,C,T,S", [(1, 70, 1, 3), (2, 70, 5, 3), (1, 9, 100, 4)])
def test_channels_last_equals_default_interpreter(interpreter, B, C, T, S):
    """Same values, bit for bit, in the [B, T, C] layout; T = 100 takes the two-launch path."""
    x = torch.randn(B, T, C).to(torch.bfloat16).transpose(1, 2)
    w, b = torch.randn(C, 4).to(torch.bfloat16), torch.randn(C).to(torch.bfloat16)
    s1 = torch.randn(B, C, S).to(torch.bfloat16)
    s2 = s1.clone()
    y = ember.ops.causal_conv1d(x, w, b, conv_state=s1, activation="silu", channels_last=True)
    exp = ember.ops.causal_conv1d(x, w, b, conv_state=s2, activation="silu")
    assert _is_channels_last(y) and (T == 1 or not _is_channels_last(exp))  # at T = 1 the layouts coincide
    assert torch.equal(y, exp) and torch.equal(s1, s2)


def test_channels_last_reference_path():
    x, w = torch.randn(2, 6, 5), torch.randn(6, 3)
    s1, s2 = torch.randn(2, 6, 2), None
    s2 = s1.clone()
    y = ember.ops.causal_conv1d(x, w, conv_state=s1, channels_last=True)
    assert _is_channels_last(y)
    assert torch.equal(y, ember.ops.causal_conv1d(x, w, conv_state=s2)) and torch.equal(s1, s2)


def test_channels_last_compile_fullgraph():
    w = torch.randn(8, 4)
    f = torch.compile(lambda x: ember.ops.causal_conv1d(x, w, activation="silu", channels_last=True).transpose(1, 2)
                      .contiguous(), fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 8, 5)
    torch.testing.assert_close(f(x), ember.ops.causal_conv1d(x, w, activation="silu").transpose(1, 2))


def test_compile_fullgraph_mutates_state():
    w = torch.randn(8, 4)
    state_c, state_e = torch.zeros(1, 8, 3), torch.zeros(1, 8, 3)
    f = torch.compile(lambda x, s: ember.ops.causal_conv1d(x, w, conv_state=s, activation="silu"),
                      fullgraph=True, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(1, 8, 1)
        torch.testing.assert_close(f(x, state_c), ember.ops.causal_conv1d(x, w, conv_state=state_e, activation="silu"))
    assert torch.equal(state_c, state_e)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(x=torch.randn(1, 8), weight=torch.randn(8, 4)), ValueError, "x: expected a 3-d"),
    (dict(x=torch.randn(1, 8, 2), weight=torch.randn(7, 4)), ValueError, "weight: expected shape"),
    (dict(x=torch.randn(1, 8, 2), weight=torch.randn(8, 4), bias=torch.randn(3)), ValueError, "bias"),
    (dict(x=torch.randn(1, 8, 2), weight=torch.randn(8, 4), conv_state=torch.zeros(1, 8, 2)), ValueError, "S >= 3"),
    (dict(x=torch.randn(1, 8, 2), weight=torch.randn(8, 4), conv_state=torch.zeros(2, 8, 3)), ValueError, "conv_state"),
    (dict(x=torch.randn(1, 8, 2), weight=torch.randn(8, 4), activation="gelu"), ValueError, "activation"),
    (dict(x=torch.randint(0, 2, (1, 8, 2)), weight=torch.randn(8, 4)), TypeError, "x"),
    (dict(x=torch.randn(1, 8, 2), weight=torch.randn(8, 4), channels_last="yes"), TypeError, "channels_last"),
])
def test_bad_input(kw, exc, words):
    x, w = kw.pop("x"), kw.pop("weight")
    b = kw.pop("bias", None)
    with pytest.raises(exc, match=words):
        ember.ops.causal_conv1d(x, w, b, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,C,T,K,S", [(1, 6144, 1, 4, 3), (4, 2048, 1, 3, 3), (1, 8192, 333, 4, 3)])
def test_gpu_kernel_matches_reference(cuda, dtype, B, C, T, K, S):
    x = torch.randn(B, T, C, device=cuda).to(dtype).transpose(1, 2)
    w, b = torch.randn(C, K, device=cuda).to(dtype), torch.randn(C, device=cuda).to(dtype)
    s_k = torch.randn(B, C, S, device=cuda).to(dtype)
    s_r = s_k.clone()
    y = ember.ops.causal_conv1d(x, w, b, conv_state=s_k, activation="silu")
    exp = conv1d.causal_conv1d_reference(x, w, b, conv_state=s_r, activation="silu")
    assert_close(y, exp, dtype)
    assert torch.equal(s_k, s_r)


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_steps(cuda):
    C, K = 2048, 4
    w = torch.randn(C, K, device=cuda, dtype=torch.bfloat16)
    x = torch.randn(1, C, 1, device=cuda, dtype=torch.bfloat16)
    state = torch.zeros(1, C, K - 1, device=cuda, dtype=torch.bfloat16)
    ember.ops.causal_conv1d(x, w, conv_state=state.clone())  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ember.ops.causal_conv1d(x, w, conv_state=state, activation="silu")
    ref_state = state.clone()
    for _ in range(4):
        x.copy_(torch.randn_like(x))
        g.replay()
        exp = conv1d.causal_conv1d_reference(x, w, conv_state=ref_state, activation="silu")
        assert_close(y, exp)
    assert torch.equal(state, ref_state)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (1, 333)])
def test_gpu_channels_last_equals_default(cuda, B, T):
    """Qwen3.5-35B-A3B's conv (C = 8192, K = 4): the [B, T, C] output equals the default, bit for bit."""
    C = 8192
    x = torch.randn(B, T, C, device=cuda, dtype=torch.bfloat16).transpose(1, 2)
    w = torch.randn(C, 4, device=cuda, dtype=torch.bfloat16)
    s1 = torch.randn(B, C, 3, device=cuda, dtype=torch.bfloat16)
    s2 = s1.clone()
    y = ember.ops.causal_conv1d(x, w, conv_state=s1, activation="silu", channels_last=True)
    assert _is_channels_last(y)
    assert torch.equal(y, ember.ops.causal_conv1d(x, w, conv_state=s2, activation="silu")) and torch.equal(s1, s2)


# ----------------------------------------------------------------------------- gated (LFM2's short conv)
def _lfm2_gates(B, C, T, dtype, device="cpu"):
    """b, c, x as LFM2 makes them: [B, C, T] views of one [B, T, 3C] projection (stride 3C along C... T)."""
    proj = torch.randn(B, T, 3 * C, device=device).to(dtype)
    b, c, x = proj.chunk(3, dim=-1)
    return b.transpose(1, 2), c.transpose(1, 2), x.transpose(1, 2)


def _unfused(x, w, bias, state, b, c):
    """The three ops the gated call replaces, through the same conv (kernel or reference)."""
    return c * ember.ops.causal_conv1d(b * x, w, bias, conv_state=state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 9, 70])
def test_gated_kernel_equals_three_torch_ops_interpreter(interpreter, dtype, T):
    B, C, K = 2, 40, 3
    b, c, x = _lfm2_gates(B, C, T, dtype)
    w = torch.randn(C, K).to(dtype)
    bias = torch.randn(C).to(dtype)
    state = torch.randn(B, C, K - 1).to(dtype)
    state_ref = state.clone()
    y = ember.ops.causal_conv1d(x, w, bias, conv_state=state, gate_in=b, gate_out=c)
    assert torch.equal(y, _unfused(x, w, bias, state_ref, b, c))  # same roundings, same sums: bit-exact
    assert torch.equal(state, state_ref)  # the state keeps the gated inputs b * x
    y_cl = ember.ops.causal_conv1d(x, w, bias, conv_state=state.clone(), gate_in=b, gate_out=c, channels_last=True)
    y2 = ember.ops.causal_conv1d(x, w, bias, conv_state=state_ref.clone(), gate_in=b, gate_out=c)
    assert torch.equal(y_cl, y2) and y_cl.transpose(1, 2).is_contiguous()


def test_gated_reference_path_equals_three_torch_ops():
    b, c, x = _lfm2_gates(1, 8, 5, torch.bfloat16)
    w = torch.randn(8, 4).bfloat16()
    s1, s2 = torch.zeros(1, 8, 3).bfloat16(), torch.zeros(1, 8, 3).bfloat16()
    y = ember.ops.causal_conv1d(x, w, conv_state=s1, gate_in=b, gate_out=c)
    assert torch.equal(y, _unfused(x, w, None, s2, b, c)) and torch.equal(s1, s2)


@pytest.mark.parametrize("kw,words", [
    (dict(gate_in=torch.randn(1, 8, 4)), "gate_in"),
    (dict(gate_out=torch.randn(1, 8, 5).double()), "gate_out"),
    (dict(gate_out=torch.randn(8, 5)), "gate_out"),
])
def test_gated_bad_input(kw, words):
    with pytest.raises((ValueError, TypeError), match=words):
        ember.ops.causal_conv1d(torch.randn(1, 8, 5), torch.randn(8, 3), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 128])
def test_gpu_gated_lfm2_shapes(cuda, T):
    B, C, K = 1, 2048, 3  # LFM2-8B-A1B: hidden 2048, conv_L_cache 3
    b, c, x = _lfm2_gates(B, C, T, torch.bfloat16, cuda)
    w = torch.randn(C, K, device=cuda).bfloat16()
    state = torch.randn(B, C, K - 1, device=cuda).bfloat16()
    state_ref = state.clone()
    y = ember.ops.causal_conv1d(x, w, conv_state=state, gate_in=b, gate_out=c)
    assert torch.equal(y, _unfused(x, w, None, state_ref, b, c)) and torch.equal(state, state_ref)
