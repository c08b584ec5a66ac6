"""Decode attention ops: reference vs float64 math, Triton kernels (interpreter on CPU, real shapes on GPU)."""

import pytest
import torch

from ember import tuning
from ember.models._common import rope_tables
from ember.ops import attention as A

# tuning entries that force where the decode-attention splits combine (any split count is <= 64)
ONE_LAUNCH = {"decode_split": {"one_launch_min_splits": 1}}
TWO_LAUNCHES = {"decode_split": {"one_launch_min_splits": 1024}}


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


def _whole_cache_attention(q, kc, vc, lens, scale):
    """Masked attention over every cache position (what the reference computed before it read only the
    live length)."""
    B, NH, D = q.shape
    kvh, S = kc.shape[1], kc.shape[2]
    scores = torch.einsum("bhgd,bhsd->bhgs", q.float().reshape(B, kvh, NH // kvh, D), kc[:B].float()) * scale
    live = torch.arange(S)[None, :] < lens[:, None]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    return torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), vc[:B].float()).reshape(B, NH * D)


def test_reference_reads_only_the_live_length():
    """The reference attends over the cache only below the longest row's length: what lies past it
    (NaN here) is never read, and the result equals the whole-cache computation on a finite cache."""
    q = torch.randn(2, 8, 16)
    kc, vc = torch.randn(3, 2, 4096, 16), torch.randn(3, 2, 4096, 16)
    lens = torch.tensor([37, 100], dtype=torch.int32)
    full = _whole_cache_attention(q, kc, vc, lens, 0.25)
    torch.testing.assert_close(full.double(), _attention_f64(q, kc, vc, lens.tolist(), 0.25), atol=1e-5, rtol=1e-5)
    got = A.decode_attention_reference(q, kc, vc, lens, 0.25)
    torch.testing.assert_close(got, full, atol=1e-6, rtol=1e-6)  # float32, sums over fewer zeros
    kc[:, :, 100:], vc[:, :, 100:] = float("nan"), float("nan")
    assert torch.equal(A.decode_attention_reference(q, kc, vc, lens, 0.25), got)
    assert torch.isnan(A.decode_attention_reference(q, kc, vc, torch.tensor([37, 101]), 0.25)).any()


def test_reference_length_zero_and_past_the_cache():
    """Length 0 gives NaN (no position to attend, as the kernel gives); a length past the cache attends
    over all of it."""
    q, kc, vc = torch.randn(2, 4, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    out = A.decode_attention_reference(q, kc, vc, torch.tensor([0, 50]), 0.25)
    assert torch.isnan(out[0]).all()
    torch.testing.assert_close(out[1:].double(), _attention_f64(q[1:], kc[1:], vc[1:], [40], 0.25), atol=1e-5,
                               rtol=1e-5)


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


def test_prefill_rope_tile_override_interpreter(interpreter):
    """A "prefill_rope" tuning entry (sweeps) changes only how token rows are grouped into programs: the
    same bits as the default tile; a BLOCK_T that is not a power of 2 is named."""
    B, T, NH, KVH, D, S = 2, 5, 4, 2, 16, 8
    qkv, qn, kn, cos, sin, kc, vc = _prefill_inputs(B, T, NH, KVH, D, S, torch.bfloat16)
    kc2, vc2 = kc.clone(), vc.clone()
    q = A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc, vc, num_heads=NH)
    with tuning.override("attention", {"prefill_rope": {"BLOCK_T": 2, "num_warps": 1}}):
        q2 = A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc2, vc2, num_heads=NH)
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    with tuning.override("attention", {"prefill_rope": {"BLOCK_T": 3}}):
        with pytest.raises(ValueError, match="attention/prefill_rope: BLOCK_T must be a power of 2"):
            A.prefill_qk_norm_rope_cache(qkv, qn, kn, cos, sin, kc2, vc2, num_heads=NH)
    with tuning.override("attention", {"prefill_rope": {"BLOCK_ROWS": 4}}):
        with pytest.raises(ValueError, match="tuning entry attention/prefill_rope"):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_combine_matches_two_launch_interpreter(interpreter, dtype):
    """The splits combined by their last program (one launch) give the two-launch result."""
    B, NH, KVH, D, S = 3, 8, 2, 16, 130
    q = torch.randn(B, NH, D).to(dtype)
    kc, vc = torch.randn(B, KVH, S, D).to(dtype), torch.randn(B, KVH, S, D).to(dtype)
    lens = torch.tensor([1, 64, 130], dtype=torch.int32)
    with tuning.override("attention", TWO_LAUNCHES):
        two = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
    with tuning.override("attention", ONE_LAUNCH):
        for _ in range(2):  # the second call proves the arrival counters were reset
            one = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
            torch.testing.assert_close(one.float(), two.float(), atol=1e-6 if dtype == torch.float32 else 8e-3,
                                       rtol=1e-5)
    ref = _attention_f64(q, kc, vc, lens.tolist(), D ** -0.5)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 8e-3)
    torch.testing.assert_close(one.double(), ref, atol=tol[0], rtol=tol[1])


@pytest.mark.gpu
def test_one_launch_combine_real_shapes_in_graph(cuda):
    NH, KVH, D, S, B = 32, 4, 128, 4096, 8
    lens = torch.tensor([1, 7, 128, 999, 4096, 33, 2048, 64], device=cuda, dtype=torch.int32)
    q = torch.randn(B, NH, D, device=cuda).bfloat16()
    kc, vc = torch.randn(B, KVH, S, D, device=cuda).bfloat16(), torch.randn(B, KVH, S, D, device=cuda).bfloat16()
    with tuning.override("attention", ONE_LAUNCH):
        out = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
        torch.testing.assert_close(out.float(), A.decode_attention_reference(q, kc, vc, lens, D ** -0.5).float(),
                                   atol=1e-2, rtol=8e-3)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_g = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
    for i in range(200):  # replayed outside the override: the graph keeps the tile it was captured with
        q.copy_(torch.randn_like(q))
        g.replay()
        if i % 50 == 0:
            torch.testing.assert_close(out_g.float(), A.decode_attention_reference(q, kc, vc, lens, D ** -0.5).float(),
                                       atol=1e-2, rtol=8e-3)


# ----------------------------------------------------------------------------- where the splits combine
def _kernels():
    from ember import _dispatch
    _dispatch.prepare_triton()
    from ember.kernels import attention
    return attention


class _LaunchSpy:
    """Stands in for a Triton kernel and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _both_paths(q, kc, vc, lens, scale):
    """(one-launch, two-launch) outputs; asserts the arrival counters are back at 0 after the call."""
    K = _kernels()
    outs = []
    for entries in (ONE_LAUNCH, TWO_LAUNCHES):
        with tuning.override("attention", entries):
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
def test_one_launch_live_splits_only_interpreter(interpreter, dtype):
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
        one, two = _both_paths(q, kc, vc, lens, D ** -0.5)
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
        one, two = _both_paths(q, kc, vc, t, D ** -0.5)
        _assert_one_vs_two(one, two, torch.float32)
        torch.testing.assert_close(one.double(), _attention_f64(q, kc, vc, lens, D ** -0.5), atol=1e-5, rtol=1e-5)


def test_combine_launch_follows_the_tuning_entry(monkeypatch):
    """``one_launch_min_splits`` decides whether the second (combine) launch happens: read at each call,
    per split count; a malformed entry is a ValueError naming it."""
    K = _kernels()
    spy = _LaunchSpy(K._decode_attention_combine_kernel)
    monkeypatch.setattr(K, "_decode_attention_combine_kernel", spy)
    q, kc, vc = torch.randn(1, 4, 16), torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    lens = torch.tensor([200], dtype=torch.int32)
    nsplit = K._split_plan(256, 2)[0]
    out = torch.empty(1, 64)
    for min_splits, launches in ((nsplit, 0), (nsplit + 1, 1)):
        with tuning.override("attention", {"decode_split": {"one_launch_min_splits": min_splits}}):
            K.decode_attention(q, kc, vc, lens, 0.25, out)
        assert spy.launches == launches
        torch.testing.assert_close(out.double(), _attention_f64(q, kc, vc, [200], 0.25), atol=1e-5, rtol=1e-5)
    for bad in ({"one_launch_min_splits": 0}, {"warps": 4}, {"num_warps": 2.0}):
        with tuning.override("attention", {"decode_split": bad}), pytest.raises(ValueError, match="attention/decode_split"):
            K.decode_attention(q, kc, vc, lens, 0.25, out)


def test_shipped_h200_entries_are_well_formed():
    """The H200's measured entries parse as the kernels read them (every field known, a valid tile)."""
    K = _kernels()
    h200 = tuning.DeviceInfo("NVIDIA H200", (9, 0))
    for key, rule in (("decode_split", K.DECODE_SPLIT_RULE), ("prefill_rope", K.PREFILL_ROPE_RULE)):
        entry = tuning.lookup("attention", key, h200)
        assert entry is not None, key
        t = K.tile(key, rule, h200)
        assert set(t) == set(rule) and all(isinstance(v, int) and v >= 1 for v in t.values())
        if key == "prefill_rope":
            assert t["BLOCK_T"] & (t["BLOCK_T"] - 1) == 0


@pytest.mark.gpu
def test_one_launch_graph_replays_with_changing_lengths(cuda):
    """Qwen3-30B-A3B batch-1 decode as the engine runs it: one graph captured at one length, replayed
    at others (most of the 64 splits empty, split boundaries, the full cache), vs the two-launch path."""
    NH, KVH, D, S = 32, 4, 128, 4096
    q = torch.randn(1, NH, D, device=cuda).bfloat16()
    kc, vc = torch.randn(1, KVH, S, D, device=cuda).bfloat16(), torch.randn(1, KVH, S, D, device=cuda).bfloat16()
    lens = torch.tensor([130], device=cuda, dtype=torch.int32)
    with tuning.override("attention", ONE_LAUNCH):
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
        with tuning.override("attention", TWO_LAUNCHES):
            two = A.decode_attention(q, kc, vc, lens, scale=D ** -0.5)
        # one bf16 ulp apart at most; atol for outputs that cancel to ~0 (|v| ~ 1), where the two
        # fp32 combine orders differ by ~1e-9 absolute (measured on the H200), i.e. any relative amount
        torch.testing.assert_close(out_g.float(), two.float(), atol=1e-6, rtol=2 ** -7)
        torch.testing.assert_close(out_g.float(), A.decode_attention_reference(q, kc, vc, lens, D ** -0.5).float(),
                                   atol=1e-2, rtol=8e-3)
