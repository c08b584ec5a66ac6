"""Decode kernels that load inputs no running kernel writes before their dependent-launch wait (the
decode attention's row lengths, the router's norm weight and first K block): their outputs against
the references, in the interpreter (CI) and on the GPU (where the launch order is real and the lengths
are written two kernels before the attention, as the engine writes them)."""
import importlib

import pytest
import torch

import ember
from ember import tuning
from ember.models._common import rope_tables
from ember.ops import attention as A
from tests.ops.test_moe import quantize

moe_ops = importlib.import_module("ember.ops.moe")  # the module (ember.ops.moe is also the op's name)

# tuning entries that force where the decode-attention splits combine (any split count is <= 64)
COMBINE = {"one_launch": {"decode_split": {"one_launch_min_splits": 1}},
           "two_launches": {"decode_split": {"one_launch_min_splits": 1024}}}


def _rope_case(device, dtype, B=2, NH=8, KVH=2, D=16, S=70):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, (NH + 2 * KVH) * D, generator=g).to(device, dtype)
    qn, kn = (torch.rand(D, generator=g) + 0.5).to(device, dtype), (torch.rand(D, generator=g) + 0.5).to(device, dtype)
    cos, sin = rope_tables(D, 10000.0, S, device)
    pos = torch.tensor([5, S - 1][:B], device=device)
    kc = torch.randn(B, KVH, S, D, generator=g).to(device, dtype)
    vc = torch.randn(B, KVH, S, D, generator=g).to(device, dtype)
    h = torch.randn(B, 48, generator=g).to(device, dtype)
    return qkv, qn, kn, cos, sin, pos, kc, vc, h, NH


def _rope_and_attention(qkv, qn, kn, cos, sin, pos, kc, vc, h, NH):
    """The decode order: lengths written, then the norm + RoPE launch, then attention reading them."""
    kc, vc = kc.clone(), vc.clone()
    lens = (pos + 1).int()
    q = A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH, prenorm=(h, 1e-6))
    out = A.decode_attention(q, kc, vc, lens, scale=0.25)
    return q, kc, vc, out


def _assert_rope_and_attention_match_reference(case, tol):
    q, kc_out, vc_out, out = _rope_and_attention(*case)
    qkv, qn, kn, cos, sin, pos, kc, vc, h, NH = case
    kc, vc = kc.clone(), vc.clone()
    q_ref = A.qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, pos, kc, vc, NH, 1e-6, prenorm_h=h,
                                           prenorm_eps=1e-6)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(kc_out.float(), kc.float(), atol=tol, rtol=tol)
    # attention against its reference on the kernel's own q and cache: at the Qwen3 shape (400 cached
    # positions) q's one-ulp bf16 differences from q_ref alone moved one output in 4096 by 0.0127 (H200)
    out_ref = A.decode_attention_reference(q, kc_out, vc_out, (pos + 1).int(), 0.25)
    torch.testing.assert_close(out.float(), out_ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("combine", sorted(COMBINE))
def test_rope_and_attention_match_reference_interpreter(interpreter, dtype, combine):
    # bf16: the kernel rounds once where the reference rounds per op (one ulp, 2^-7 relative)
    with tuning.override("attention", COMBINE[combine]):
        _assert_rope_and_attention_match_reference(_rope_case("cpu", dtype),
                                                   1e-5 if dtype == torch.float32 else 1e-2)


def _moe_case(device, scale):
    g = torch.Generator().manual_seed(2)
    E, H, I, k = 8, 100, 48, 4
    wgu, gs = quantize(torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, scale)
    wd, ds = quantize(torch.randn(E, H, I, generator=g) / I ** 0.5, scale)
    x, res = torch.randn(1, H, generator=g).to(torch.bfloat16), torch.randn(1, H, generator=g).to(torch.bfloat16)
    lnw = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16)
    router = (torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return (*to(wgu, gs, wd, ds, x, res, lnw, router), k)


def _assert_route_and_experts_match_reference(wgu, gs, wd, ds, x, res, lnw, router, k):
    """The router with the post-attention norm folded in (H = 100: on CPU it steps through K in
    blocks, so the later blocks' path runs too), then the fp8 expert GEMVs."""
    normed, new_res, tw, tid = moe_ops.add_rmsnorm_route_hidden(x, res, lnw, router, k, eps=1e-6)
    ref = moe_ops.add_rmsnorm_route_hidden_reference(x, res, lnw, router, k, eps=1e-6)
    assert torch.equal(new_res, ref[1]) and torch.equal(tid, ref[3])  # new residual, expert ids
    torch.testing.assert_close(normed.float(), ref[0].float(), atol=1e-2, rtol=1e-2)
    y = ember.ops.moe_experts(normed, wgu, wd, tw, tid, gate_up_scale=gs, down_scale=ds)
    y_ref = moe_ops.moe_experts_reference(normed, wgu, wd, tw, tid, gs, ds)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("scale", ["row", "block"])
def test_router_and_experts_match_reference_interpreter(interpreter, scale):
    _assert_route_and_experts_match_reference(*_moe_case("cpu", scale))


@pytest.mark.gpu
@pytest.mark.parametrize("combine", sorted(COMBINE))
def test_gpu_early_loads_match_reference(cuda, combine):
    """Real launches (dependent launch on sm_90+), Qwen3-30B-A3B attention shapes, then the router and
    fp8 experts."""
    with tuning.override("attention", COMBINE[combine]):
        _assert_rope_and_attention_match_reference(_rope_case("cuda", torch.bfloat16, B=1, NH=32, KVH=4, D=128,
                                                              S=400), 1e-2)
    for scale in ("row", "block"):
        _assert_route_and_experts_match_reference(*_moe_case("cuda", scale))
