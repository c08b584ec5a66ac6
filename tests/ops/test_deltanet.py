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
