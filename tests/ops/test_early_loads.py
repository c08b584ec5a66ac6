"""EMBER_EARLY_LOADS: the kernels that load unchanging inputs before the dependent-launch wait (the
decode attention's row lengths, the router's norm weight) compute the same values as with the loads
after it: the same bits, in the interpreter (CI) and on the GPU (where the order is real)."""
import importlib

import pytest
import torch

import ember
from ember.kernels._common import EARLY_LOAD_KINDS, EARLY_LOADS_DEFAULT, early_loads
from ember.models._common import rope_tables
from ember.ops import attention as A
from tests.ops.test_moe import quantize

moe_ops = importlib.import_module("ember.ops.moe")  # the module (ember.ops.moe is also the op's name)


def test_switch_parsing(monkeypatch):
    monkeypatch.delenv("EMBER_EARLY_LOADS", raising=False)
    assert [k for k in EARLY_LOAD_KINDS if early_loads(k)] == EARLY_LOADS_DEFAULT.split(",")
    monkeypatch.setenv("EMBER_EARLY_LOADS", "all")
    assert all(early_loads(k) for k in EARLY_LOAD_KINDS)
    monkeypatch.setenv("EMBER_EARLY_LOADS", "none")
    assert not any(early_loads(k) for k in EARLY_LOAD_KINDS)
    monkeypatch.setenv("EMBER_EARLY_LOADS", " router ")
    assert [k for k in EARLY_LOAD_KINDS if early_loads(k)] == ["router"]
    monkeypatch.setenv("EMBER_EARLY_LOADS", "attn,gemv")
    with pytest.raises(ValueError, match=r"EMBER_EARLY_LOADS: unknown kind\(s\) \['gemv'\]"):
        early_loads("attn")


def _both(monkeypatch, run):
    """run() with every kind early, then with none; the outputs (tuples of tensors)."""
    got = []
    for mode in ("all", "none"):
        monkeypatch.setenv("EMBER_EARLY_LOADS", mode)
        got.append(tuple(t.clone() for t in run()))
    return got


def _assert_same_bits(early, late):
    assert len(early) == len(late)
    for a, b in zip(early, late):
        assert torch.equal(a, b)


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
    kc, vc = kc.clone(), vc.clone()
    q = A.qk_norm_rope_cache(qkv, qn, kn, cos, sin, pos, kc, vc, num_heads=NH, prenorm=(h, 1e-6))
    out = A.decode_attention(q, kc, vc, (pos + 1).int(), scale=0.25)
    return q, kc, vc, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_launch", ["0", "1"])
def test_rope_and_attention_same_bits_interpreter(interpreter, monkeypatch, dtype, one_launch):
    monkeypatch.setenv("EMBER_ATTN_ONE_LAUNCH", one_launch)
    case = _rope_case("cpu", dtype)
    early, late = _both(monkeypatch, lambda: _rope_and_attention(*case))
    _assert_same_bits(early, late)
    qkv, qn, kn, cos, sin, pos, kc, vc, h, NH = case
    kc, vc = kc.clone(), vc.clone()
    q_ref = A.qk_norm_rope_cache_reference(qkv, qn, kn, cos, sin, pos, kc, vc, NH, 1e-6, prenorm_h=h,
                                           prenorm_eps=1e-6)
    out_ref = A.decode_attention_reference(q_ref, kc, vc, (pos + 1).int(), 0.25)
    torch.testing.assert_close(early[0].float(), q_ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(early[3].float(), out_ref.float(), atol=1e-2, rtol=1e-2)


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


def _route_and_experts(wgu, gs, wd, ds, x, res, lnw, router, k):
    normed, new_res, tw, tid = moe_ops.add_rmsnorm_route_hidden(x, res, lnw, router, k, eps=1e-6)
    y = ember.ops.moe_experts(normed, wgu, wd, tw, tid, gate_up_scale=gs, down_scale=ds)
    y2, scaled = ember.ops.moe_experts_add_scale(normed, wgu, wd, tw, tid, new_res, lnw, gate_up_scale=gs,
                                                 down_scale=ds)
    return normed, new_res, tw, tid, y, y2, scaled


@pytest.mark.parametrize("scale", ["row", "block"])
@pytest.mark.parametrize("split", ["1", "2"])
def test_router_and_t1_experts_same_bits_interpreter(interpreter, monkeypatch, scale, split):
    """The router's norm weight early and its block-0 residual sum kept (on CPU the router steps
    through K in blocks, so the later blocks' path runs too), then the fp8 expert GEMVs."""
    from ember.kernels import moe as kmod
    monkeypatch.setenv("EMBER_MOE_T1", "v2")
    monkeypatch.setenv("EMBER_MOE_DOWN_SPLIT", split)
    monkeypatch.setattr(kmod, "_experts_gemv", lambda *a, **kw: pytest.fail("the v1 T=1 kernels ran"))
    case = _moe_case("cpu", scale)
    early, late = _both(monkeypatch, lambda: _route_and_experts(*case))
    _assert_same_bits(early, late)
    ref = moe_ops.add_rmsnorm_route_hidden_reference(case[4], case[5], case[6], case[7], case[8], eps=1e-6)
    assert torch.equal(early[1], ref[1]) and torch.equal(early[3], ref[3])  # new residual, expert ids
    wgu, gs, wd, ds = case[:4]
    y_ref = moe_ops.moe_experts_reference(early[0], wgu, wd, early[2], early[3], gs, ds)
    torch.testing.assert_close(early[4].float(), y_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gpu_early_loads_same_bits(cuda, monkeypatch, dtype):
    """Real launches (dependent launch on sm_90+), Qwen3-30B-A3B attention shapes: every kind early vs
    none, the same bits."""
    case = _rope_case("cuda", dtype, B=1, NH=32, KVH=4, D=128, S=400)
    _assert_same_bits(*_both(monkeypatch, lambda: _rope_and_attention(*case)))
    for scale in ("row", "block"):
        case = _moe_case("cuda", scale)
        _assert_same_bits(*_both(monkeypatch, lambda: _route_and_experts(*case)))
