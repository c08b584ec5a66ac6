import numpy as np
import pytest
import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import ember
from ember.ops import deltanet
from tests.helpers import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(B, T, HK, HV, DK, DV, dtype=torch.float32, device="cpu"):
    q = torch.randn(B, T, HK, DK, device=device).to(dtype)
    k = torch.randn(B, T, HK, DK, device=device).to(dtype)
    v = torch.randn(B, T, HV, DV, device=device).to(dtype)
    g = (-torch.rand(B, T, HV, device=device) * 0.5).to(dtype)  # log decay <= 0
    beta = torch.rand(B, T, HV, device=device).to(dtype)
    return q, k, v, g, beta


def _raw_gates(B, T, HV, dtype=torch.float32, device="cpu"):
    """a, dt_bias, neg_a, b as Qwen3.5 projects them (a and b slices of one [b | a] projection), with
    a few a + dt_bias values past softplus' threshold of 20 and far below zero."""
    ba = (torch.randn(B, T, 2 * HV, device=device) * 4).to(dtype)
    b, a = ba[..., :HV], ba[..., HV:]
    a[0, 0, 0] = 30.0
    a[-1, -1, -1] = -95.0
    dt_bias = torch.randn(HV, device=device)
    neg_a = -torch.rand(HV, device=device).mul(4).exp()
    return a, dt_bias, neg_a, b


def _numpy_gates(a, dt_bias, neg_a, b):
    """The gate formulas with numpy's float32 exp/log, as Triton's interpreter evaluates the kernel
    (no libdevice there: log1p is log(1 + e) * e / ((1 + e) - 1)); torch's CPU exp differs in the
    last bit, so this, not gates_reference, is what the interpreted kernel must equal bit for bit."""
    x = a.float().numpy() + dt_bias.float().numpy()
    with np.errstate(over="ignore"):
        e = np.exp(np.where(x > 20, np.float32(20), x))
        u = np.float32(1) + e
        sp = np.where(u == 1, e, np.log(u) * (e / np.where(u == 1, np.float32(1), u - np.float32(1))))
        g = neg_a.float().numpy() * np.where(x > 20, x, sp)
        beta = np.float32(1) / (np.float32(1) + np.exp(-b.float().numpy()))
    return torch.from_numpy(g), torch.from_numpy(beta).to(b.dtype)


def _hf(fn, q, k, v, g, beta, state, **kw):
    group = v.shape[2] // q.shape[2]
    return fn(q.repeat_interleave(group, 2), k.repeat_interleave(group, 2), v, g=g, beta=beta, initial_state=state,
              output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)


@pytest.mark.parametrize("B,T,HK,HV,DK,DV", [(1, 1, 2, 4, 16, 16), (2, 7, 1, 3, 8, 12), (1, 70, 2, 2, 32, 16)])
def test_reference_matches_transformers_recurrent_and_chunked(B, T, HK, HV, DK, DV):
    q, k, v, g, beta = _inputs(B, T, HK, HV, DK, DV)
    state0 = torch.randn(B, HV, DK, DV)
    o, s = deltanet.gated_delta_rule_reference(q, k, v, g, beta, state0)
    o_rec, s_rec = _hf(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state0.clone())
    torch.testing.assert_close(o, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_rec, atol=1e-5, rtol=1e-5)
    o_chk, s_chk = _hf(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, state0.clone(), chunk_size=16)
    torch.testing.assert_close(o, o_chk, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, s_chk, atol=1e-4, rtol=1e-4)


def test_prefill_then_decode_steps_equal_one_scan():
    q, k, v, g, beta = _inputs(1, 9, 2, 4, 16, 16)
    full = ember.ops.gated_delta_rule(q, k, v, g, beta)
    state = torch.zeros(1, 4, 16, 16)
    parts = [ember.ops.gated_delta_rule(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], state=state)]
    for t in range(5, 9):
        sl = slice(t, t + 1)
        parts.append(ember.ops.gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state=state))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,HK,HV,DK,DV", [(1, 1, 2, 4, 16, 40), (2, 3, 1, 2, 24, 8)])
def test_kernel_matches_reference_interpreter(interpreter, dtype, B, T, HK, HV, DK, DV):
    q, k, v, g, beta = _inputs(B, T, HK, HV, DK, DV, dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided [B, T, H, D] view
    state = torch.randn(B, HV, DK, DV)
    o_exp, s_exp = deltanet.gated_delta_rule_reference(q, k, v, g, beta, state)
    o = ember.ops.gated_delta_rule(q, k, v, g, beta, state=state)
    assert_close(o, o_exp, dtype)
    torch.testing.assert_close(state, s_exp, atol=1e-5, rtol=1e-5)


def test_kernel_any_head_dim_stride_interpreter(interpreter):
    q, k, v, g, beta = _inputs(1, 2, 2, 2, 8, 8)
    q_strided = torch.randn(1, 2, 2, 16)[..., ::2]  # head dim with stride 2
    q_strided.copy_(q)
    exp = deltanet.gated_delta_rule_reference(q, k, v, g, beta)[0]
    assert_close(ember.ops.gated_delta_rule(q_strided, k, v, g, beta), exp, torch.float32)


def test_kernel_without_state_interpreter(interpreter):
    q, k, v, g, beta = _inputs(1, 2, 1, 1, 8, 8)
    assert_close(ember.ops.gated_delta_rule(q, k, v, g, beta),
                 deltanet.gated_delta_rule_reference(q, k, v, g, beta)[0], torch.float32)


def test_gates_reference_matches_float64():
    a, dt_bias, neg_a, b = _raw_gates(2, 5, 4)
    g, beta = deltanet.gates_reference(a, dt_bias, neg_a, b)
    x = a.double() + dt_bias.double()
    exp_g = neg_a.double() * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    assert g.dtype == torch.float32 and beta.dtype == b.dtype
    # atol: softplus(-95) ~ 5e-42 is subnormal in fp32, where precision is absolute (2^-149)
    torch.testing.assert_close(g, exp_g.float(), rtol=1e-6, atol=1e-44)
    torch.testing.assert_close(beta, torch.sigmoid(b.double()).float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("raw", ["g", "beta", "both"])
def test_raw_gates_reference_path_equals_precomputed(raw):
    q, k, v, _, _ = _inputs(1, 4, 2, 4, 8, 8, torch.bfloat16)
    a, dt_bias, neg_a, b = _raw_gates(1, 4, 4, torch.bfloat16)
    g, beta = deltanet.gates_reference(a, dt_bias, neg_a, b)
    s1, s2 = torch.randn(1, 4, 8, 8), None
    s2 = s1.clone()
    kw = {}
    kw.update(a=a, dt_bias=dt_bias, neg_a=neg_a) if raw != "beta" else kw.update(g=g)
    kw.update(b=b) if raw != "g" else kw.update(beta=beta)
    got = ember.ops.gated_delta_rule(q, k, v, state=s1, **kw)
    assert torch.equal(got, ember.ops.gated_delta_rule(q, k, v, g, beta, state=s2))
    assert torch.equal(s1, s2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,HK,HV,DK,DV", [(1, 1, 2, 4, 16, 40), (2, 3, 1, 2, 24, 8)])
def test_kernel_raw_gates_interpreter(interpreter, dtype, B, T, HK, HV, DK, DV):
    q, k, v, _, _ = _inputs(B, T, HK, HV, DK, DV, dtype)
    a, dt_bias, neg_a, b = _raw_gates(B, T, HV, dtype)
    state = torch.randn(B, HV, DK, DV)
    s_raw, s_pre = state.clone(), state.clone()
    o = ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a, b=b, state=s_raw)
    # bit for bit the kernel fed the same gates precomputed (with the interpreter's exp)
    g_np, beta_np = _numpy_gates(a, dt_bias, neg_a, b)
    assert torch.equal(o, ember.ops.gated_delta_rule(q, k, v, g_np, beta_np, state=s_pre))
    assert torch.equal(s_raw, s_pre)
    # and the spec, torch's gates on the reference scan, to rounding
    o_exp, s_exp = deltanet.gated_delta_rule_reference(q, k, v, *deltanet.gates_reference(a, dt_bias, neg_a, b),
                                                       state)
    assert_close(o, o_exp, dtype)
    torch.testing.assert_close(s_raw, s_exp, atol=1e-5, rtol=1e-5)


def _padding_is_a_no_op(device):
    """Tokens with raw gates a = b = -inf (decay exp(0) = 1, beta = 0: how a padded prefill chunk
    masks its padding) leave the state bit for bit where the real tokens left it."""
    q, k, v, _, _ = _inputs(1, 7, 2, 4, 16, 24, torch.float32, device)
    a, dt_bias, neg_a, b = _raw_gates(1, 7, 4, torch.float32, device)
    state = torch.randn(1, 4, 16, 24, device=device)
    exact = state.clone()
    ember.ops.gated_delta_rule(q[:, :4], k[:, :4], v[:, :4], a=a[:, :4], dt_bias=dt_bias, neg_a=neg_a, b=b[:, :4],
                               state=exact)
    a[:, 4:], b[:, 4:] = float("-inf"), float("-inf")
    padded = state.clone()
    o = ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a, b=b, state=padded)
    assert torch.equal(padded, exact) and torch.isfinite(o).all()


def test_masked_tokens_leave_the_state_unchanged_reference():
    _padding_is_a_no_op("cpu")


def test_masked_tokens_leave_the_state_unchanged_interpreter(interpreter):
    _padding_is_a_no_op("cpu")


@pytest.mark.gpu
def test_gpu_masked_tokens_leave_the_state_unchanged(cuda):
    _padding_is_a_no_op(cuda)


def test_compile_fullgraph_raw_gates():
    q, k, v, _, _ = _inputs(1, 1, 2, 4, 16, 16)
    a, dt_bias, neg_a, b = _raw_gates(1, 1, 4)
    s1, s2 = torch.zeros(1, 4, 16, 16), torch.zeros(1, 4, 16, 16)
    f = torch.compile(lambda q, k, v, a, b, s: ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a,
                                                                          b=b, state=s),
                      fullgraph=True, backend="aot_eager")
    got = f(q, k, v, a, b, s1)
    torch.testing.assert_close(got, ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a, b=b,
                                                               state=s2))
    torch.testing.assert_close(s1, s2)


def test_compile_fullgraph():
    q, k, v, g, beta = _inputs(1, 1, 2, 4, 16, 16)
    s1, s2 = torch.zeros(1, 4, 16, 16), torch.zeros(1, 4, 16, 16)
    f = torch.compile(lambda *a: ember.ops.gated_delta_rule(*a[:5], state=a[5]), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q, k, v, g, beta, s1), ember.ops.gated_delta_rule(q, k, v, g, beta, state=s2))
    torch.testing.assert_close(s1, s2)


def test_bad_input():
    q, k, v, g, beta = _inputs(1, 2, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="divisible by the 2 key heads"):
        ember.ops.gated_delta_rule(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match=r"g: expected shape \(1, 2, 4\)"):
        ember.ops.gated_delta_rule(q, k, v, g[:, :1], beta)
    with pytest.raises(ValueError, match="state: expected shape"):
        ember.ops.gated_delta_rule(q, k, v, g, beta, state=torch.zeros(1, 4, 8, 9))
    with pytest.raises(TypeError, match="state: expected dtype"):
        ember.ops.gated_delta_rule(q, k, v, g, beta, state=torch.zeros(1, 4, 8, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="k: expected dtype"):
        ember.ops.gated_delta_rule(q, k.half(), v, g, beta)


def test_bad_raw_gates():
    q, k, v, g, beta = _inputs(1, 2, 2, 4, 8, 8)
    a, dt_bias, neg_a, b = _raw_gates(1, 2, 4)
    with pytest.raises(ValueError, match="g: expected g, or a, dt_bias and neg_a .* no dt_bias, neg_a"):
        ember.ops.gated_delta_rule(q, k, v, beta=beta, a=a)
    with pytest.raises(ValueError, match="g: expected either g or .* got both g and a"):
        ember.ops.gated_delta_rule(q, k, v, g, beta, a=a, dt_bias=dt_bias, neg_a=neg_a)
    with pytest.raises(ValueError, match="beta: expected exactly one of beta and b .* got both"):
        ember.ops.gated_delta_rule(q, k, v, g, beta, b=b)
    with pytest.raises(ValueError, match="beta: expected exactly one of beta and b .* got neither"):
        ember.ops.gated_delta_rule(q, k, v, g)
    with pytest.raises(ValueError, match=r"a: expected shape \(1, 2, 4\)"):
        ember.ops.gated_delta_rule(q, k, v, a=a[:, :1], dt_bias=dt_bias, neg_a=neg_a, b=b)
    with pytest.raises(ValueError, match=r"dt_bias: expected shape \(4,\) \(one per value head\)"):
        ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias[:3], neg_a=neg_a, b=b)
    with pytest.raises(ValueError, match="neg_a: expected a 1-d tensor"):
        ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a[None], b=b)
    with pytest.raises(TypeError, match="b: expected dtype"):
        ember.ops.gated_delta_rule(q, k, v, g, b=b.to(torch.int32))
    with pytest.raises(ValueError, match="neg_a: expected device cpu"):
        ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a.to("meta"), b=b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (1, 300)])
def test_gpu_qwen35_shapes(cuda, dtype, B, T):
    q, k, v, g, beta = _inputs(B, T, 16, 32, 128, 128, dtype, cuda)
    state = torch.randn(B, 32, 128, 128, device=cuda) * 0.1
    o_exp, s_exp = deltanet.gated_delta_rule_reference(q, k, v, g, beta, state)
    o = ember.ops.gated_delta_rule(q, k, v, g, beta, state=state)
    # fp32: 300 sequential state updates summed in a different order than the reference, hence 1e-4
    kw = {} if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    assert_close(o, o_exp, dtype, **kw)
    torch.testing.assert_close(state, s_exp, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (1, 300)])
def test_gpu_raw_gates_bit_exact_qwen35_shapes(cuda, dtype, B, T):
    """Gates computed in the kernel equal torch's gates fed to it, bit for bit (libdevice expf /
    log1pf and IEEE division are what torch's CUDA softplus and sigmoid use)."""
    q, k, v, _, _ = _inputs(B, T, 16, 32, 128, 128, dtype, cuda)
    a, dt_bias, neg_a, b = _raw_gates(B, T, 32, dtype, cuda)
    state = torch.randn(B, 32, 128, 128, device=cuda) * 0.1
    s_raw, s_pre = state.clone(), state.clone()
    o = ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a, b=b, state=s_raw)
    g, beta = deltanet.gates_reference(a, dt_bias, neg_a, b)
    assert torch.equal(o, ember.ops.gated_delta_rule(q, k, v, g, beta, state=s_pre))
    assert torch.equal(s_raw, s_pre)


@pytest.mark.gpu
def test_gpu_raw_gates_cuda_graph(cuda):
    """One decode step at Qwen3.5-35B-A3B shapes captured in a CUDA graph, replayed on new inputs:
    equal to eager with torch's gates, bit for bit."""
    q, k, v, _, _ = _inputs(1, 1, 16, 32, 128, 128, torch.bfloat16, cuda)
    a, dt_bias, neg_a, b = _raw_gates(1, 1, 32, torch.bfloat16, cuda)
    state = torch.randn(1, 32, 128, 128, device=cuda) * 0.1
    run = lambda: ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=dt_bias, neg_a=neg_a, b=b, state=state)
    run()  # compile outside capture
    torch.cuda.synchronize()
    g_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_):
        o = run()
    for t in (q, k, v, a, b):
        t.copy_(torch.randn_like(t) * (4 if t is a or t is b else 1))
    s_exp = state.clone()
    g_.replay()
    g, beta = deltanet.gates_reference(a, dt_bias, neg_a, b)
    assert torch.equal(o, ember.ops.gated_delta_rule(q, k, v, g, beta, state=s_exp))
    assert torch.equal(state, s_exp)
