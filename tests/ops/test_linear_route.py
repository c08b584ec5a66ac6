"""ember.ops.linear_add_rmsnorm_route_hidden: a decoder layer's output projection, post-attention
add_rmsnorm and softmax routing in one launch (ember.kernels.linear_route)."""
import importlib

import pytest
import torch

import ember

moe_ops = importlib.import_module("ember.ops.moe")
FP8 = torch.float8_e4m3fn


def _inputs(dtype, K, N, E, fp8=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(1, K, generator=g).to(dtype)
    res = torch.randn(1, N, generator=g).to(dtype)
    lnw = (torch.rand(N, generator=g) + 0.5).to(dtype)
    router = torch.randn(E, N, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    scale = None
    if fp8:
        w, scale = ember.ops.quantize_fp8(w, "row")
        scale = scale.reshape(N)
    else:
        w = w.to(dtype)
    return a, w, scale, res, lnw, router


def _float64_route(a, w, scale, res, lnw, router, top_k, eps=1e-6):
    """Independent float64 math (no roundings): the new residual, the normalised row, the top-k ids."""
    wd = w.double() if scale is None else w.double() * scale.double()[:, None]
    h = a.double() @ wd.T + res.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * lnw.double()
    logits = normed @ router.double().T
    return h, normed, logits.topk(top_k, -1).indices.sort(-1).values, logits


def _ulp(t):
    return {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}[t.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("K,N,E,top_k", [(96, 80, 12, 3), (64, 32, 8, 2), (128, 48, 5, 5)])
def test_kernel_matches_the_two_op_spec_interpreter(interpreter, dtype, fp8, K, N, E, top_k):
    """N not a multiple of the 16-row programs, K not of the step, E not a power of two; row-scaled
    fp8 and plain weights. The new residual is the spec's bit for bit (the same roundings); the
    normalised row within one ulp of the I/O dtype (1 / rms summed in another order); the picks are
    the spec's and float64's (no near ties in these seeds); the weights within the logits' rounding."""
    a, w, scale, res, lnw, router = _inputs(dtype, K, N, E, fp8)
    normed, new_res, tw, ids = moe_ops.linear_add_rmsnorm_route_hidden(a, w, res, lnw, router, top_k,
                                                                       weight_scale=scale)
    r_normed, r_res, r_tw, r_ids = moe_ops.linear_add_rmsnorm_route_hidden_reference(a, w, res, lnw, router, top_k,
                                                                                     scale)
    if dtype == torch.float32:  # the projection's sum order differs from F.linear's
        torch.testing.assert_close(new_res, r_res, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(new_res, r_res)
    assert ((normed.double() - r_normed.double()).abs() <= _ulp(normed) * r_normed.double().abs() + 1e-6).all()
    assert torch.equal(ids.long().sort(-1).values, r_ids.long().sort(-1).values)
    _, _, ids64, logits64 = _float64_route(a, w, scale, res, lnw, router, top_k)
    assert torch.equal(ids.long().sort(-1).values, ids64)
    # a weight moves by exp(d_i - d_j) when two logits move by d_i, d_j: up to one ulp of the largest
    # logit each (the logits are rounded to the I/O dtype)
    torch.testing.assert_close(tw, r_tw, rtol=2 * _ulp(normed) * logits64.abs().max().item(), atol=1e-6)
    assert abs(tw.sum().item() - 1.0) < 1e-5  # renormalised


def test_without_renormalisation_interpreter(interpreter):
    a, w, scale, res, lnw, router = _inputs(torch.bfloat16, 64, 48, 10)
    _, _, tw, ids = moe_ops.linear_add_rmsnorm_route_hidden(a, w, res, lnw, router, 4, renormalize=False)
    _, _, r_tw, r_ids = moe_ops.linear_add_rmsnorm_route_hidden_reference(a, w, res, lnw, router, 4,
                                                                          renormalize=False)
    assert torch.equal(ids, r_ids)
    _, _, _, logits64 = _float64_route(a, w, scale, res, lnw, router, 4)
    torch.testing.assert_close(tw, r_tw, rtol=2 * 2 ** -8 * logits64.abs().max().item(), atol=1e-6)
    assert tw.sum().item() < 1.0


def test_repeated_calls_reset_the_arrival_counter_interpreter(interpreter):
    """Every launch's last program resets the shared counter: a second call (another layer) routes too."""
    first = _inputs(torch.bfloat16, 64, 48, 10, seed=1)
    second = _inputs(torch.bfloat16, 64, 48, 10, seed=2)
    for args in (first, second, first):
        a, w, scale, res, lnw, router = args
        got = moe_ops.linear_add_rmsnorm_route_hidden(a, w, res, lnw, router, 3)
        ref = moe_ops.linear_add_rmsnorm_route_hidden_reference(a, w, res, lnw, router, 3)
        assert torch.equal(got[3], ref[3])


@pytest.mark.parametrize("tile", ["16,1,4", "32,2,4", "8,4,2"])
def test_tile_override_gives_the_same_picks_interpreter(interpreter, monkeypatch, tile):
    a, w, scale, res, lnw, router = _inputs(torch.bfloat16, 96, 80, 12, fp8=True)
    base = moe_ops.linear_add_rmsnorm_route_hidden(a, w, res, lnw, router, 3, weight_scale=scale)
    monkeypatch.setenv("EMBER_LINEAR_ROUTE_TILE", tile)
    got = moe_ops.linear_add_rmsnorm_route_hidden(a, w, res, lnw, router, 3, weight_scale=scale)
    assert torch.equal(got[1], base[1]) and torch.equal(got[3], base[3])


def test_tile_override_errors_name_the_variable(interpreter, monkeypatch):
    a, w, scale, res, lnw, router = _inputs(torch.bfloat16, 64, 48, 10)
    monkeypatch.setenv("EMBER_LINEAR_ROUTE_TILE", "24,1,4")
    with pytest.raises(ValueError, match="EMBER_LINEAR_ROUTE_TILE.*BLOCK_N a power of 2"):
        moe_ops.linear_add_rmsnorm_route_hidden(a, w, res, lnw, router, 3)


def test_cpu_path_is_the_spec():
    """Without Triton on CPU the op is the reference composition, bit for bit."""
    a, w, scale, res, lnw, router = _inputs(torch.float32, 64, 48, 10)
    got = moe_ops.linear_add_rmsnorm_route_hidden(a, w, res, lnw, router, 3)
    ref = moe_ops.linear_add_rmsnorm_route_hidden_reference(a, w, res, lnw, router, 3)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def _bad(**change):
    a, w, scale, res, lnw, router = _inputs(torch.bfloat16, 64, 48, 10)
    kw = dict(a=a, weight=w, residual=res, norm_weight=lnw, router_weight=router, top_k=3, weight_scale=None)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change,match", [
    (dict(a=torch.randn(2, 64, dtype=torch.bfloat16)), r"a: expected one row \[1, K\]"),
    (dict(weight=torch.randn(48, 32, dtype=torch.bfloat16)), r"weight: expected shape \[N, 64\]"),
    (dict(weight=torch.randn(48, 64)), "weight"),
    (dict(weight=torch.zeros(48, 64).to(FP8)), "weight"),  # fp8 without its scale
    (dict(weight=torch.zeros(48, 64).to(FP8), weight_scale=torch.ones(40)), r"weight_scale: expected shape \[48\]"),
    (dict(residual=torch.randn(1, 40, dtype=torch.bfloat16)), r"residual: expected shape \[1, 48\]"),
    (dict(residual=torch.randn(1, 48)), "dtype"),
    (dict(norm_weight=torch.ones(40, dtype=torch.bfloat16)), "norm_weight: expected length 48"),
    (dict(router_weight=torch.randn(10, 40, dtype=torch.bfloat16)), "router_weight: expected shape"),
    (dict(top_k=11), "top_k"),
])
def test_bad_input_names_the_culprit(change, match):
    kw = _bad(**change)
    with pytest.raises((ValueError, TypeError), match=match):
        moe_ops.linear_add_rmsnorm_route_hidden(kw.pop("a"), kw.pop("weight"), kw.pop("residual"),
                                                kw.pop("norm_weight"), kw.pop("router_weight"), kw.pop("top_k"),
                                                **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_qwen3_30b_shapes_match_the_spec_and_replay_in_a_graph(cuda, fp8):
    """Qwen3-30B-A3B's o_proj (2048 x 4096), 128 experts, top-8: the kernel against the two-op spec,
    eagerly and replayed in a CUDA graph (the same bits), and the picks against float64 where the
    8th and 9th float64 logits are apart by more than the logits' rounding."""
    a, w, scale, res, lnw, router = _inputs(torch.bfloat16, 4096, 2048, 128, fp8=fp8, seed=3)
    args = [t if t is None else t.to(cuda) for t in (a, w, res, lnw, router)]
    scale = None if scale is None else scale.to(cuda)
    got = moe_ops.linear_add_rmsnorm_route_hidden(*args, 8, weight_scale=scale)
    ref = moe_ops.linear_add_rmsnorm_route_hidden_reference(*args, 8, scale)
    assert torch.equal(got[1], ref[1])
    assert ((got[0].double() - ref[0].double()).abs() <= 2 ** -8 * ref[0].double().abs() + 1e-6).all()
    _, _, ids64, logits64 = _float64_route(*(t.cpu() if t is not None else t for t in (a, w, scale, res, lnw, router)), 8)
    top = logits64.sort(-1, descending=True).values[0]
    if (top[7] - top[8]).item() > 2 ** -7 * top[0].abs().item():
        assert torch.equal(got[3].cpu().long().sort(-1).values, ids64)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = moe_ops.linear_add_rmsnorm_route_hidden(*args, 8, weight_scale=scale)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    for c, e in zip(captured, got):
        assert torch.equal(c, e)
