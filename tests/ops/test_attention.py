"""Decode attention ops: reference vs float64 math, Triton kernels (interpreter on CPU, real shapes on GPU)."""
import math

import pytest
import torch

from ember.models._common import rope_tables
from ember.ops import attention as A


def _attention_f64(q, kc, vc, lens, scale):
    B, NH, D = q.shape
    kvh = kc.shape[1]
    out = torch.empty(B, NH, D, dtype=torch.float64)
    for b in range(B):
        for h in range(NH):
            k, v = kc[b, h // (NH // kvh), : lens[b]].double(), vc[b, h // (NH // kvh), : lens[b]].double()
            p = torch.softmax(k @ q[b, h].double() * scale, 0)
            out[b, h] = p @ v
    return out.reshape(B, NH * D)


def _rope_inputs(B, NH, KVH, D, S, dtype, device="cpu"):
    qkv = torch.randn(B, (NH + 2 * KVH) * D, device=device).to(dtype)
    qn, kn = (torch.rand(D, device=device) + 0.5).to(dtype), (torch.rand(D, device=device) + 0.5).to(dtype)
    cos, sin = rope_tables(D, 10000.0, S, device)
    pos = torch.randint(0, S, (B,), device=device)
    kc, vc = torch.randn(B + 1, KVH, S, D, device=device).to(dtype), torch.randn(B + 1, KVH, S, D, device=device).to(dtype)
    return qkv, qn, kn, cos, sin, pos, kc, vc


def test_reference_attention_matches_float64():
    q, kc, vc = torch.randn(3, 8, 16), torch.randn(4, 2, 40, 16), torch.randn(4, 2, 40, 16)
    lens = torch.tensor([1, 17, 40], dtype=torch.int32)
    got = A.decode_attention_reference(q, kc, vc, lens, 0.25)
    torch.testing.assert_close(got.double(), _attention_f64(q, kc, vc, lens.tolist(), 0.25), atol=1e-5, rtol=1e-5)


def test_reference_rope_matches_float64():
    B, NH, KVH, D, S = 2, 4, 2, 16, 32
    qkv, qn, kn, cos, sin, pos, kc, vc = _rope_inputs(B, NH, KVH, D, S, torch.float32)
    q = A.qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, pos, kc, vc, NH, 1e-6)
    x = qkv.double()[:, : NH * D].reshape(B, NH, D)
    x = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * qn.double()
    ang = pos.double()[:, None] * (1.0 / 10000.0 ** (torch.arange(0, D, 2).double() / D))[None]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    want = torch.cat([x[..., : D // 2] * c - x[..., D // 2:] * s, x[..., D // 2:] * c + x[..., : D // 2] * s], -1)
    torch.testing.assert_close(q.double(), want, atol=1e-5, rtol=1e-5)
    v = qkv[:, (NH + KVH) * D:].reshape(B, KVH, D)
    for b in range(B):
        assert torch.equal(vc[b, :, pos[b]], v[b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_reference_interpreter(interpreter, dtype):
    B, NH, KVH, D, S = 2, 8, 2, 16, 70
    qkv, qn, kn, cos, sin, pos, kc, vc = _rope_inputs(B, NH, KVH, D, S, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    q_ref = A.qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, pos, kc2, vc2, NH, 1e-6)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1.6e-2)  # kernel rounds once, reference per op
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(kc.float(), kc2.float(), atol=tol[0], rtol=tol[1])
    assert torch.equal(vc, vc2)
    lens = torch.tensor([1, 70], dtype=torch.int32)
    out = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
    ref = _attention_f64(q, kc, vc, lens.tolist(), D ** -0.5)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    torch.testing.assert_close(out.double(), ref, atol=tol[0], rtol=tol[1])


def test_bad_input():
    q, kc, vc = torch.randn(2, 8, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    with pytest.raises(ValueError, match="at most 1 rows"):
        A.decode_attention(q, kc, vc, torch.tensor([3, 3]), scale=0.25)
    with pytest.raises(ValueError, match="seq_lens: expected length 1"):
        A.decode_attention(q[:1], kc, vc, torch.tensor([3, 3]), scale=0.25)
    with pytest.raises(TypeError, match="k_cache/v_cache"):
        A.decode_attention(q[:1], kc.half(), vc.half(), torch.tensor([3]), scale=0.25)
    with pytest.raises(ValueError, match="qkv: expected last dim"):
        A.qk_norm_rope_cache(torch.randn(1, 100), torch.ones(16), torch.ones(16), torch.ones(40, 8), torch.ones(40, 8),
                             torch.tensor([0]), kc, vc, num_heads=8)


@pytest.mark.gpu
@pytest.mark.parametrize("B,S,lens", [(1, 512, [385]), (8, 4096, [1, 7, 128, 999, 4096, 33, 2048, 64])])
def test_kernels_real_shapes(cuda, B, S, lens):
    NH, KVH, D = 32, 4, 128
    qkv, qn, kn, cos, sin, _, kc, vc = _rope_inputs(B, NH, KVH, D, S, torch.bfloat16, cuda)
    pos = torch.tensor(lens, device=cuda) - 1
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    q_ref = A.qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, pos, kc2, vc2, NH, 1e-6)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-2, rtol=1.6e-2)
    out = A.decode_attention(q, kc, vc, torch.tensor(lens, device=cuda, dtype=torch.int32), scale=D ** -0.5)
    ref = A.decode_attention_reference(q, kc, vc, torch.tensor(lens, device=cuda, dtype=torch.int32), D ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=8e-3)
