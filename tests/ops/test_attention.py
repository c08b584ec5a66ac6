"""Decode attention ops: reference vs float64 math, Triton kernels (interpreter on CPU, real shapes on GPU)."""
import math

import pytest
import torch

from ember.models._common import rope_tables
from ember.ops import attention as A
from tests.helpers import poisoned


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


def test_reference_prenorm_is_the_norm_before_the_projection():
    """prenorm = (h, eps): qkv projected from h * w (no 1 / rms) gives what qkv projected from
    rmsnorm(h) * w gives, up to the roundings the two orders differ in (float32 here: tiny)."""
    B, NH, KVH, D, S, Hd = 2, 4, 2, 16, 32, 48
    _, qn, kn, cos, sin, pos, kc, vc = _rope_inputs(B, NH, KVH, D, S, torch.float32)
    h, lnw = torch.randn(B, Hd) * 3, torch.rand(Hd) + 0.5
    w = torch.randn((NH + 2 * KVH) * D, Hd) / Hd ** 0.5
    kc2, vc2 = kc.clone(), vc.clone()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * lnw
    want = A.qk_norm_rope_cache_reference(normed @ w.T, qn, kn, cos, sin, pos, kc2, vc2, NH, 1e-6)
    got = A.qk_norm_rope_cache_reference((h * lnw) @ w.T, qn, kn, cos, sin, pos, kc, vc, NH, 1e-6, h, 1e-6)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc, kc2, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(vc, vc2, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prenorm_kernel_matches_reference_interpreter(interpreter, dtype):
    B, NH, KVH, D, S, Hd = 2, 8, 2, 16, 70, 100  # 100: the h row is read in masked 64-wide steps
    qkv, qn, kn, cos, sin, pos, kc, vc = _rope_inputs(B, NH, KVH, D, S, dtype)
    h = (torch.randn(B, Hd) * 4).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH, prenorm=(h, 1e-5))
    q_ref = A.qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, pos, kc2, vc2, NH, 1e-6, h, 1e-5)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1.6e-2)  # kernel rounds once, reference per op
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(kc.float(), kc2.float(), atol=tol[0], rtol=tol[1])
    # v: one product and one rounding in both; the 1 / rms may differ in its last bit (summation order)
    torch.testing.assert_close(vc.float(), vc2.float(), atol=tol[0], rtol=tol[1])


def test_prenorm_compile_fullgraph_cpu():
    B, NH, KVH, D, S, Hd = 1, 4, 2, 16, 32, 48
    qkv, qn, kn, cos, sin, pos, kc, vc = _rope_inputs(B, NH, KVH, D, S, torch.float32)
    h = torch.randn(B, Hd)
    kc2, vc2 = kc.clone(), vc.clone()

    def f(qkv, h, kc, vc):
        return A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH, prenorm=(h, 1e-6))

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(qkv, h, kc, vc)
    torch.testing.assert_close(got, f(qkv, h, kc2, vc2))
    torch.testing.assert_close(kc, kc2)
    torch.testing.assert_close(vc, vc2)


def test_prenorm_bad_input():
    B, NH, KVH, D, S = 1, 4, 2, 16, 32
    qkv, qn, kn, cos, sin, pos, kc, vc = _rope_inputs(B, NH, KVH, D, S, torch.float32)
    call = lambda pre: A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH, prenorm=pre)  # noqa: E731
    with pytest.raises(TypeError, match=r"prenorm: expected a \(h, eps\) tuple"):
        call(torch.randn(1, 8))
    with pytest.raises(ValueError, match=r"prenorm\[0\]: expected 1 rows"):
        call((torch.randn(2, 8), 1e-6))
    with pytest.raises(TypeError, match=r"prenorm\[0\]: expected dtype torch.float32"):
        call((torch.randn(1, 8).half(), 1e-6))
    with pytest.raises(ValueError, match=r"prenorm\[0\]: expected a 2-d"):
        call((torch.randn(8), 1e-6))
    with pytest.raises(ValueError, match=r"prenorm\[1\]"):
        call((torch.randn(1, 8), -1.0))


def _prefill_inputs(B, T, NH, KVH, D, S, dtype, device="cpu", gate=0):
    """qkv [B, T, F] as a column slice of a wider projection (``gate`` extra columns: strided rows, as
    Qwen3.5's gated attention passes it), norms, tables and caches (one spare row, random contents)."""
    full = torch.randn(B, T, (NH + 2 * KVH) * D + gate, device=device).to(dtype)
    qkv = full[..., : (NH + 2 * KVH) * D]
    qn, kn = (torch.rand(D, device=device) + 0.5).to(dtype), (torch.rand(D, device=device) + 0.5).to(dtype)
    cos, sin = rope_tables(D, 10000.0, S, device)
    kc, vc = torch.randn(B + 1, KVH, S, D, device=device).to(dtype), torch.randn(B + 1, KVH, S, D, device=device).to(dtype)
    return qkv, qn, kn, cos, sin, kc, vc


def test_prefill_reference_is_the_decode_spec_per_token():
    B, T, NH, KVH, D, S = 2, 6, 4, 2, 16, 16
    qkv, qn, kn, cos, sin, kc, vc = _prefill_inputs(B, T, NH, KVH, D, S, torch.float32, gate=16)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.prefill_qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, kc, vc, NH, 1e-6)
    assert q.shape == (B, T, NH, D)
    for b in range(B):
        for t in range(T):
            q_t = A.qk_norm_rope_cache_reference(qkv[b:b + 1, t], qn, kn, cos, sin, torch.tensor([t]), kc2[b:b + 1],
                                                 vc2[b:b + 1], NH, 1e-6)
            assert torch.equal(q[b, t], q_t[0])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # incl. the untouched spare row and positions >= T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", [0, 32])
def test_prefill_kernel_matches_reference_interpreter(interpreter, dtype, gate):
    B, T, NH, KVH, D, S = 2, 5, 8, 2, 16, 12
    qkv, qn, kn, cos, sin, kc, vc = _prefill_inputs(B, T, NH, KVH, D, S, dtype, gate=gate)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc, vc, num_heads=NH)
    q_ref = A.prefill_qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, kc2, vc2, NH, 1e-6)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1.6e-2)  # kernel rounds once, reference per op
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(kc.float(), kc2.float(), atol=tol[0], rtol=tol[1])
    assert torch.equal(vc, vc2)
    assert torch.equal(kc[:, :, T:], kc2[:, :, T:]) and torch.equal(kc[B], kc2[B])  # nothing else written


def test_prefill_rope_tile_override_interpreter(interpreter, monkeypatch):
    """EMBER_PREFILL_ROPE_TILE (prefill sweeps) changes only how token rows are grouped into programs:
    the same bits as the default tile; a BLOCK_T that is not a power of 2 is named."""
    B, T, NH, KVH, D, S = 2, 5, 4, 2, 16, 8
    qkv, qn, kn, cos, sin, kc, vc = _prefill_inputs(B, T, NH, KVH, D, S, torch.bfloat16)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc, vc, num_heads=NH)
    monkeypatch.setenv("EMBER_PREFILL_ROPE_TILE", "2,1")
    q2 = A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc2, vc2, num_heads=NH)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    monkeypatch.setenv("EMBER_PREFILL_ROPE_TILE", "3,1")
    with pytest.raises(ValueError, match="EMBER_PREFILL_ROPE_TILE"):
        A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc2, vc2, num_heads=NH)


def test_prefill_bad_input():
    B, T, NH, KVH, D, S = 1, 4, 4, 2, 16, 8
    qkv, qn, kn, cos, sin, kc, vc = _prefill_inputs(B, T, NH, KVH, D, S, torch.float32)
    with pytest.raises(ValueError, match="qkv: expected a 3-d tensor"):
        A.prefill_qk_norm_rope_cache(qkv[0], qn, kn, cos, sin, kc, vc, num_heads=NH)
    with pytest.raises(ValueError, match="qkv: expected last dim"):
        A.prefill_qk_norm_rope_cache(qkv[..., :-16], qn, kn, cos, sin, kc, vc, num_heads=NH)
    with pytest.raises(ValueError, match="qkv: expected at most 8 tokens"):
        A.prefill_qk_norm_rope_cache(torch.randn(1, 9, qkv.shape[-1]), qn, kn, cos, sin, kc, vc, num_heads=NH)
    with pytest.raises(ValueError, match="qkv: expected at most 2 rows"):
        A.prefill_qk_norm_rope_cache(torch.randn(3, T, qkv.shape[-1]), qn, kn, cos, sin, kc, vc, num_heads=NH)
    with pytest.raises(ValueError, match="num_heads"):
        A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc, vc, num_heads=3)
    with pytest.raises(TypeError, match="k_cache/v_cache: expected dtype"):
        A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc.bfloat16(), vc.bfloat16(), num_heads=NH)


@pytest.mark.gpu
def test_prefill_kernel_real_shapes(cuda):
    B, T, NH, KVH, D, S = 2, 1000, 32, 4, 128, 1024
    qkv, qn, kn, cos, sin, kc, vc = _prefill_inputs(B, T, NH, KVH, D, S, torch.bfloat16, cuda, gate=NH * D)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc, vc, num_heads=NH)
    q_ref = A.prefill_qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, kc2, vc2, NH, 1e-6)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(kc.float(), kc2.float(), atol=2e-2, rtol=1.6e-2)
    assert torch.equal(vc, vc2)


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


@pytest.mark.gpu
def test_prenorm_real_shapes_in_graph(cuda):
    """Qwen3-30B-A3B shapes, captured in a graph after a GEMV (the decode order: h read before the
    wait on that kernel), replayed with new h values."""
    NH, KVH, D, S, Hd = 32, 4, 128, 256, 2048
    qkv, qn, kn, cos, sin, _, kc, vc = _rope_inputs(1, NH, KVH, D, S, torch.bfloat16, cuda)
    pos = torch.tensor([100], device=cuda)
    h = (torch.randn(1, Hd, device=cuda) * 3).bfloat16()
    w = (torch.randn((NH + 2 * KVH) * D, Hd, device=cuda) / Hd ** 0.5).bfloat16()
    import ember
    run = lambda: A.qk_norm_rope_cache(ember.ops.linear(h, w), qn, kn, cos, sin, pos, kc, vc,  # noqa: E731
                                       num_heads=NH, prenorm=(h, 1e-6))
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q = run()
    h.copy_((torch.randn(1, Hd, device=cuda) * 5).bfloat16())
    g.replay()
    kc2, vc2 = kc.clone(), vc.clone()
    q_ref = A.qk_norm_rope_cache_reference(ember.ops.linear(h, w), qn, kn, cos, sin, pos, kc2, vc2, NH, 1e-6, h, 1e-6)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(vc.float(), vc2.float(), atol=2e-2, rtol=1.6e-2)


# ----------------------------------------------------------------------------- fused qkv projection
def _fused_inputs(B, H, NH, KVH, D, S, dtype, device="cpu"):
    h = torch.randn(B, H, device=device).to(dtype)
    w = (torch.randn((NH + 2 * KVH) * D, H, device=device) * H ** -0.5).to(dtype)
    qn, kn = (torch.rand(D, device=device) + 0.5).to(dtype), (torch.rand(D, device=device) + 0.5).to(dtype)
    cos, sin = rope_tables(D, 10000.0, S, device)
    # NaN-poisoned caches: a slot the kernel should write and does not stays NaN and fails.
    kc, vc = poisoned((B + 1, KVH, S, D), dtype, device), poisoned((B + 1, KVH, S, D), dtype, device)
    return h, w, qn, kn, cos, sin, kc, vc


def _two_step(h, w, qn, kn, cos, sin, pos, kc, vc, NH):
    """Today's decode path: the GEMV (rounded to the I/O dtype), then the qk_norm_rope_cache op."""
    return A.qk_norm_rope_cache(torch.nn.functional.linear(h, w), qn, kn, cos, sin, pos, kc, vc, num_heads=NH)


def _check_written(kc, vc, pos):
    for b, p in enumerate(pos.tolist()):
        assert torch.isfinite(kc[b, :, p]).all() and torch.isfinite(vc[b, :, p]).all()
    written = torch.zeros(kc.shape[0], kc.shape[2], dtype=torch.bool)
    written[torch.arange(len(pos)), pos.cpu()] = True
    assert torch.isnan(kc.permute(0, 2, 1, 3)[~written]).all()  # nothing written elsewhere
    assert torch.isnan(vc.permute(0, 2, 1, 3)[~written]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
def test_fused_qkv_matches_two_step_interpreter(interpreter, dtype, B):
    H, NH, KVH, D, S = 64, 4, 2, 16, 24
    h, w, qn, kn, cos, sin, kc, vc = _fused_inputs(B, H, NH, KVH, D, S, dtype)
    pos = torch.tensor([5, 0, 23][:B])
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.qkv_proj_norm_rope_cache(h, w, qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    q_ref = _two_step(h, w, qn, kn, cos, sin, pos, kc2, vc2, NH)
    _check_written(kc, vc, pos)
    _check_written(kc2, vc2, pos)
    # fp32: only the GEMV's summation order differs. bf16: the qkv rounding may land one ulp apart,
    # which the norm and RoPE carry through (each output rounded once more).
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    assert q.shape == (B, NH, D) and torch.isfinite(q).all()
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(kc.float(), kc2.float(), atol=tol[0], rtol=tol[1], equal_nan=True)
    torch.testing.assert_close(vc.float(), vc2.float(), atol=tol[0], rtol=tol[1], equal_nan=True)
    if dtype == torch.float32:  # and both agree with float64 math
        q64 = A.qkv_proj_norm_rope_cache_reference(h.double(), w.double(), qn.double(), kn.double(), cos.double(),
                                                   sin.double(), pos, kc2.double(), vc2.double(), NH, 1e-6)
        torch.testing.assert_close(q.double(), q64, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_qkv_same_bits_when_gemv_is_exact_interpreter(interpreter, dtype):
    # Small-integer h and weight: every partial sum is exact in fp32, so the GEMV's summation order
    # cannot matter and the fused epilogue must reproduce the two-step path bit for bit.
    B, H, NH, KVH, D, S = 3, 64, 4, 2, 16, 24
    _, _, qn, kn, cos, sin, kc, vc = _fused_inputs(B, H, NH, KVH, D, S, dtype)
    h = torch.randint(-4, 5, (B, H)).to(dtype)
    w = torch.randint(-8, 9, ((NH + 2 * KVH) * D, H)).to(dtype)
    pos = torch.tensor([7, 23, 1])
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.qkv_proj_norm_rope_cache(h, w, qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    q_ref = _two_step(h, w, qn, kn, cos, sin, pos, kc2, vc2, NH)
    _check_written(kc, vc, pos)
    assert torch.equal(q, q_ref)
    torch.testing.assert_close(kc, kc2, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, vc2, atol=0, rtol=0, equal_nan=True)


def test_fused_qkv_opt_in_from_attention_decode(interpreter, monkeypatch):
    from ember.models._common import Attention, AttentionConfig, Linear
    H, NH, KVH, D, S, B = 64, 4, 2, 16, 24, 3
    cfg = AttentionConfig(hidden_size=H, num_heads=NH, num_kv_heads=KVH, head_dim=D, rope_theta=10000.0,
                          rms_norm_eps=1e-6)
    h, w, qn, kn, cos, sin, _, _ = _fused_inputs(B, H, NH, KVH, D, S, torch.float32)
    attn = Attention(cfg, Linear(w), Linear(torch.randn(H, NH * D) * 0.1), qn, kn)
    pos = torch.tensor([4, 11, 0])
    lens = (pos + 1).to(torch.int32)
    calls = []
    real = A.qkv_proj_norm_rope_cache
    monkeypatch.setattr(A, "qkv_proj_norm_rope_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("EMBER_FUSED_QKV", flag)
        cache = (torch.zeros(B, KVH, S, D), torch.zeros(B, KVH, S, D))
        outs[flag] = attn.decode(h, pos, lens, cos, sin, cache)
        assert len(calls) == int(flag)  # read per call: off, then on
    torch.testing.assert_close(outs["1"], outs["0"], atol=1e-5, rtol=1e-5)


def test_fused_qkv_bad_input():
    H, NH, KVH, D, S = 64, 4, 2, 16, 24
    h, w, qn, kn, cos, sin, kc, vc = _fused_inputs(1, H, NH, KVH, D, S, torch.float32)
    kc, vc = torch.zeros(9, KVH, S, D), torch.zeros(9, KVH, S, D)
    pos = torch.tensor([0])
    with pytest.raises(ValueError, match="h: expected 1 to 8 rows"):
        A.qkv_proj_norm_rope_cache(torch.randn(9, H), w, qn, kn, cos, sin, torch.zeros(9, dtype=torch.long), kc, vc,
                                   num_heads=NH)
    with pytest.raises(ValueError, match=r"weight: expected shape .*\[128, 64\], got \[128, 32\]"):
        A.qkv_proj_norm_rope_cache(h, w[:, :32], qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    with pytest.raises(TypeError, match="weight: expected dtype torch.float32"):
        A.qkv_proj_norm_rope_cache(h, w.bfloat16(), qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    with pytest.raises(ValueError, match="weight: expected a contiguous last dimension"):
        A.qkv_proj_norm_rope_cache(h, w.t().contiguous().t(), qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    with pytest.raises(ValueError, match="positions: expected length 1 \\(rows of h\\)"):
        A.qkv_proj_norm_rope_cache(h, w, qn, kn, cos, sin, torch.tensor([0, 1]), kc, vc, num_heads=NH)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_fused_qkv_real_shapes(cuda, B):
    H, NH, KVH, D, S = 2048, 32, 4, 128, 4096  # Qwen3-30B-A3B attention
    h, w, qn, kn, cos, sin, kc, vc = _fused_inputs(B, H, NH, KVH, D, S, torch.bfloat16, cuda)
    pos = torch.tensor([4095, 0, 17, 1000, 2048, 3, 511, 77][:B], device=cuda)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.qkv_proj_norm_rope_cache(h, w, qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    q_ref = _two_step(h, w, qn, kn, cos, sin, pos, kc2, vc2, NH)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(kc.float(), kc2.float(), atol=1e-2, rtol=8e-3, equal_nan=True)
    torch.testing.assert_close(vc.float(), vc2.float(), atol=1e-2, rtol=8e-3, equal_nan=True)
    _check_written(kc, vc, pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_combine_matches_two_launch_interpreter(interpreter, monkeypatch, dtype):
    """EMBER_ATTN_ONE_LAUNCH=1 (the last split program combines) gives the two-launch result."""
    B, NH, KVH, D, S = 3, 8, 2, 16, 130
    q = torch.randn(B, NH, D).to(dtype)
    kc, vc = torch.randn(B, KVH, S, D).to(dtype), torch.randn(B, KVH, S, D).to(dtype)
    lens = torch.tensor([1, 64, 130], dtype=torch.int32)
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "0")
    two = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "1")
    for _ in range(2):  # the second call proves the arrival counters were reset
        one = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
        torch.testing.assert_close(one.float(), two.float(), atol=1e-6 if dtype == torch.float32 else 8e-3, rtol=1e-5)
    ref = _attention_f64(q, kc, vc, lens.tolist(), D ** -0.5)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    torch.testing.assert_close(one.double(), ref, atol=tol[0], rtol=tol[1])


@pytest.mark.gpu
def test_one_launch_combine_real_shapes_in_graph(cuda, monkeypatch):
    NH, KVH, D, S, B = 32, 4, 128, 4096, 8
    lens = torch.tensor([1, 7, 128, 999, 4096, 33, 2048, 64], device=cuda, dtype=torch.int32)
    q = torch.randn(B, NH, D, device=cuda).bfloat16()
    kc, vc = torch.randn(B, KVH, S, D, device=cuda).bfloat16(), torch.randn(B, KVH, S, D, device=cuda).bfloat16()
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "1")
    out = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
    torch.testing.assert_close(out.float(), A.decode_attention_reference(q, kc, vc, lens, D ** -0.5).float(),
                               atol=1e-2, rtol=8e-3)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
    for i in range(200):
        q.copy_(torch.randn_like(q))
        g.replay()
        if i % 50 == 0:
            torch.testing.assert_close(out_g.float(), A.decode_attention_reference(q, kc, vc, lens, D ** -0.5).float(),
                                       atol=1e-2, rtol=8e-3)


# ----------------------------------------------------------------------------- one-launch combine (default)
def _kernels():
    from ember import _dispatch
    return _dispatch.kernels("attention")


def _both_paths(monkeypatch, q, kc, vc, lens, scale):
    """(one-launch, two-launch) outputs; asserts the arrival counters are back at 0 after the call."""
    K = _kernels()
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", flag)
        outs.append(A.decode_attention(q, kc, vc, lens, scale=scale))
    cnt = K.arrival_counters("decode_attention", q.device, q.shape[0] * kc.shape[1])
    assert int(cnt.abs().sum()) == 0
    return outs


def _assert_one_vs_two(one, two, dtype):
    # Same partials (same split code); the combines sum the live splits in different orders, so fp32
    # agrees to rounding and bf16 to at most one ulp (2^-7 relative) after the final rounding.
    assert torch.isfinite(one).all()
    if dtype == torch.float32:
        torch.testing.assert_close(one, two, atol=1e-7, rtol=1e-6)
    else:
        torch.testing.assert_close(one.float(), two.float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_live_splits_only_interpreter(interpreter, monkeypatch, dtype):
    """16 splits of 32 positions per (row, kv head): length 1 (one live split), 64 (exactly two
    blocks: a split boundary), 150 (5 of 16 live); then the same lengths tensor updated in place (as a
    graph replay sees it) to a full cache, a boundary and a length 0 < x < 32, reusing the counters."""
    B, NH, KVH, D, S = 3, 8, 2, 16, 512
    assert _kernels()._split_plan(S, B * KVH) == (16, 32)
    q = torch.randn(B, NH, D).to(dtype)
    kc, vc = torch.randn(B, KVH, S, D).to(dtype), torch.randn(B, KVH, S, D).to(dtype)
    lens = torch.tensor([1, 64, 150], dtype=torch.int32)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    for new_lens in ([1, 64, 150], [512, 32, 17]):
        lens.copy_(torch.tensor(new_lens))
        one, two = _both_paths(monkeypatch, q, kc, vc, lens, D ** -0.5)
        _assert_one_vs_two(one, two, dtype)
        torch.testing.assert_close(one.double(), _attention_f64(q, kc, vc, new_lens, D ** -0.5), atol=tol[0],
                                   rtol=tol[1])


def test_one_launch_strided_blocks_and_multi_step_combine_interpreter(interpreter, monkeypatch):
    """A plan of 4 splits over 7 blocks (split 0 takes blocks 0 and 4, split 3 only block 3) and a
    combine tile of 2 splits, so the live partials merge online over two steps."""
    K = _kernels()
    B, NH, KVH, D, S = 2, 8, 2, 16, 224
    monkeypatch.setattr(K, "_split_plan", lambda S, rows_x_heads: (4, 32))
    monkeypatch.setattr(K, "COMBINE_TILE", 2 * 4 * D)  # [4 heads, 2 splits, D]
    q = torch.randn(B, NH, D)
    kc, vc = torch.randn(B, KVH, S, D), torch.randn(B, KVH, S, D)
    for lens in ([200, 96], [33, 224]):  # 7 and 3 blocks; 2 blocks (one partial), all 7
        t = torch.tensor(lens, dtype=torch.int32)
        one, two = _both_paths(monkeypatch, q, kc, vc, t, D ** -0.5)
        _assert_one_vs_two(one, two, torch.float32)
        torch.testing.assert_close(one.double(), _attention_f64(q, kc, vc, lens, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_one_launch_default_by_split_count_and_env_switch(monkeypatch):
    K = _kernels()
    monkeypatch.delenv("EMBER_ATTN_ONE_LAUNCH", raising=False)
    assert K.one_launch(K.ONE_LAUNCH_MIN_SPLITS) and not K.one_launch(K.ONE_LAUNCH_MIN_SPLITS // 2)
    assert K.one_launch(K._split_plan(4096, 4)[0])      # batch-1 Qwen3-30B-A3B, 4096-token cache: 64 splits
    assert K.one_launch(K._split_plan(400, 4)[0])       # a 400-token cache: 16 splits
    assert not K.one_launch(K._split_plan(400, 32)[0])  # batch 8 (32 row x kv heads): 8 splits
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "0")
    assert not K.one_launch(64)
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "1")
    assert K.one_launch(1)


@pytest.mark.gpu
def test_one_launch_graph_replays_with_changing_lengths(cuda, monkeypatch):
    """Qwen3-30B-A3B batch-1 decode as the engine runs it: one graph captured at one length, replayed
    at others (most of the 64 splits empty, split boundaries, the full cache), vs the two-launch path."""
    NH, KVH, D, S = 32, 4, 128, 4096
    q = torch.randn(1, NH, D, device=cuda).bfloat16()
    kc, vc = torch.randn(1, KVH, S, D, device=cuda).bfloat16(), torch.randn(1, KVH, S, D, device=cuda).bfloat16()
    lens = torch.tensor([130], device=cuda, dtype=torch.int32)
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "1")
    A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
    cnt = _kernels().arrival_counters("decode_attention", q.device, KVH)
    for n in [130, 1, 31, 32, 33, 64, 257, 260, 2048, 4095, 4096] * 20:
        lens.fill_(n)
        q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert int(cnt.abs().sum()) == 0
        monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "0")
        two = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
        monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", "1")
        # one bf16 ulp apart at most; atol for outputs that cancel to ~0 (|v| ~ 1), where the two
        # fp32 combine orders differ by ~1e-9 absolute (measured on the H200), i.e. any relative amount
        torch.testing.assert_close(out_g.float(), two.float(), atol=1e-6, rtol=2 ** -7)
        torch.testing.assert_close(out_g.float(), A.decode_attention_reference(q, kc, vc, lens, D ** -0.5).float(),
                                   atol=1e-2, rtol=8e-3)


# ----------------------------------------------------------------------------- norm + RoPE folded into attention
def _rope_then_attend(qkv, qn, kn, cos, sin, pos, lens, kc, vc, NH, scale):
    """The unfused decode path: qk_norm_rope_cache (writes k, v), then decode_attention."""
    q = A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH)
    return A.decode_attention(q, kc, vc, lens, scale=scale)


@pytest.mark.parametrize("one_launch", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_attention_matches_two_step_interpreter(interpreter, monkeypatch, dtype, one_launch):
    """The fused op writes the same k, v into the caches and attends like the two ops, at positions
    inside, at the start and at the end of a 32-position block, with rows past their position."""
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", one_launch)
    B, NH, KVH, D, S = 4, 8, 2, 16, 70
    qkv, qn, kn, cos, sin, _, kc, vc = _rope_inputs(B, NH, KVH, D, S, dtype)
    pos = torch.tensor([0, 31, 32, 69])
    lens = torch.tensor([1, 32, 40, 70], dtype=torch.int32)  # row 2 also attends 7 older entries past pos
    kc2, vc2 = kc.clone(), vc.clone()
    out = A.qk_norm_rope_attention(qkv, qn, kn, cos, sin, pos, lens, kc, vc, num_heads=NH, scale=D ** -0.5)
    two = _rope_then_attend(qkv, qn, kn, cos, sin, pos, lens, kc2, vc2, NH, D ** -0.5)
    assert torch.equal(vc, vc2)
    if dtype == torch.float32:
        torch.testing.assert_close(kc, kc2, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out, two, atol=1e-5, rtol=1e-5)
    else:  # the norm's sum of squares runs in another order: at most one bf16 ulp on a k or q value
        torch.testing.assert_close(kc.float(), kc2.float(), atol=0, rtol=2 ** -7)
        torch.testing.assert_close(out.float(), two.float(), atol=1e-2, rtol=8e-3)
    kc3, vc3 = kc2.clone(), vc2.clone()
    ref = A.qk_norm_rope_attention_reference(qkv, qn, kn, cos, sin, pos, lens, kc3, vc3, NH, 1e-6, D ** -0.5)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1.6e-2)  # kernel rounds once, reference per op
    torch.testing.assert_close(out.float(), ref.float(), atol=tol[0], rtol=tol[1])


def test_rope_attention_bad_input():
    B, NH, KVH, D, S = 1, 4, 2, 16, 32
    qkv, qn, kn, cos, sin, pos, kc, vc = _rope_inputs(B, NH, KVH, D, S, torch.float32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens: expected length 1"):
        A.qk_norm_rope_attention(qkv, qn, kn, cos, sin, pos, lens.repeat(2), kc, vc, num_heads=NH, scale=0.25)
    with pytest.raises(TypeError, match="seq_lens"):
        A.qk_norm_rope_attention(qkv, qn, kn, cos, sin, pos, lens.float(), kc, vc, num_heads=NH, scale=0.25)
    with pytest.raises(ValueError, match="num_heads"):
        A.qk_norm_rope_attention(qkv, qn, kn, cos, sin, pos, lens, kc, vc, num_heads=3, scale=0.25)
    with pytest.raises(ValueError, match="scale"):
        A.qk_norm_rope_attention(qkv, qn, kn, cos, sin, pos, lens, kc, vc, num_heads=NH, scale=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", ["1", "0"])
def test_rope_attention_real_shapes_in_graph(cuda, monkeypatch, one_launch):
    """Qwen3-30B-A3B heads, batch 3, a 4096 cache: the fused op in a CUDA graph replayed at moving
    positions equals the two-step path (caches bit for bit apart from one-ulp norm differences)."""
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", one_launch)
    B, NH, KVH, D, S = 3, 32, 4, 128, 4096
    qkv, qn, kn, cos, sin, _, kc, vc = _rope_inputs(B, NH, KVH, D, S, torch.bfloat16, cuda)
    pos = torch.tensor([5, 500, 4000], device=cuda)
    lens = (pos + 1).to(torch.int32)
    kc2, vc2 = kc.clone(), vc.clone()
    A.qk_norm_rope_attention(qkv, qn, kn, cos, sin, pos, lens, kc, vc, num_heads=NH, scale=D ** -0.5)  # compile
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_g = A.qk_norm_rope_attention(qkv, qn, kn, cos, sin, pos, lens, kc, vc, num_heads=NH, scale=D ** -0.5)
    for step in range(40):
        qkv.copy_(torch.randn_like(qkv))
        g.replay()
        two = _rope_then_attend(qkv, qn, kn, cos, sin, pos, lens, kc2, vc2, NH, D ** -0.5)
        torch.testing.assert_close(out_g.float(), two.float(), atol=1e-2, rtol=8e-3)
        torch.testing.assert_close(kc.float(), kc2.float(), atol=0, rtol=2 ** -7)
        assert torch.equal(vc, vc2)
        pos += 1 + step % 3
        lens.copy_(pos + 1)
