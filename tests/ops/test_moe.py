import importlib

import pytest
import torch

import ember
from ember import tuning

# the module, not the public function ember.ops.moe of the same name
moe_ops = importlib.import_module("ember.ops.moe")
from tests.helpers import assert_close, force_triton_or_skip, poisoned

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
E, K, H, I = 8, 2, 64, 32  # tiny shapes for CPU and the interpreter
CPU = torch.device("cpu")


def kernels():
    """ember.kernels.moe (imported under the interpreter fixture)."""
    from ember.kernels import moe
    return moe


def moe_tiles(device=CPU, **changes):
    """``ember.tuning.override`` entries: the entries in use on ``device`` with some fields changed,
    e.g. ``moe_tiles(gemv_down=dict(SPLIT=2))``."""
    return tuning.override("moe", {key: {**kernels().tiles(key, device), **fields} for key, fields in changes.items()})


def t1_kernels(variant):
    """The T=1 expert GEMVs ``variant`` ("v1" or "v2") for every weight dtype."""
    return tuning.override("moe", {"t1": {"GEMV": variant, "GEMV_FP8": variant}})


# ------------------------------------------------------------------ independent float64 math
def float64_route(logits, top_k, renormalize=True):
    p = logits.double().softmax(-1)
    T, n = p.shape
    ids = torch.empty(T, top_k, dtype=torch.int64)
    for t in range(T):  # python sort on (-p, index): ties go to the lower index
        ids[t] = torch.tensor(sorted(range(n), key=lambda e: (-p[t, e].item(), e))[:top_k])
    w = p.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def float64_dequant(w, scale):
    if scale is None:
        return w.double()
    if scale.dim() == 1:
        return w.double() * scale.double()[:, None]
    N, Kd = w.shape
    rows = torch.arange(N) // 128
    cols = torch.arange(Kd) // 128
    return w.double() * scale.double()[rows][:, cols]


def float64_experts(x, wgu, wd, tw, tid, gs=None, ds=None):
    """Token by token, expert by expert; the activation rounded to x.dtype as the op specifies."""
    T, Hd = x.shape
    Id = wd.shape[2]
    out = torch.zeros(T, Hd, dtype=torch.float64)
    for t in range(T):
        for j in range(tid.shape[1]):
            e = int(tid[t, j])
            gu = float64_dequant(wgu[e], None if gs is None else gs[e]) @ x[t].double()
            g, u = gu[:Id], gu[Id:]
            h = (g / (1 + torch.exp(-g)) * u).to(x.dtype).double()
            out[t] += float(tw[t, j]) * (float64_dequant(wd[e], None if ds is None else ds[e]) @ h)
    return out


def make_weights(dtype, e=E, h=H, i=I, device="cpu", scale=None):
    """Weights with unit-order outputs: std 1/sqrt(fan_in) keeps every stage O(1)."""
    wgu = torch.randn(e, 2 * i, h, device=device) / h ** 0.5
    wd = torch.randn(e, h, i, device=device) / i ** 0.5
    if dtype != FP8:
        return wgu.to(dtype), wd.to(dtype), None, None
    return quantize(wgu, scale) + quantize(wd, scale)


def _one_token_inputs(wdtype, scale, k, h=100, i=48):
    """A T = 1 decode step's MoE inputs at ragged sizes: (x dtype, w_gate_up, w_down, their scales,
    x, residual, a norm weight, top-k weights and ids); fp8 weights take bf16 activations."""
    xdtype = torch.bfloat16 if wdtype == FP8 else wdtype
    if wdtype == FP8:
        wgu, gs, wd, ds = make_weights(FP8, h=h, i=i, scale=scale)
    else:
        wgu, wd, gs, ds = make_weights(wdtype, h=h, i=i)
    x, res = torch.randn(1, h).to(xdtype), torch.randn(1, h).to(xdtype)
    lnw = (torch.rand(h) + 0.5).to(xdtype)
    tw, tid = moe_ops.moe_route_reference(torch.randn(1, E), k)
    return xdtype, wgu, wd, gs, ds, x, res, lnw, tw, tid


def quantize(w, layout):
    """fp8 weights and their decode scale, per row or per 128x128 block (amax / 448)."""
    E_, N, Kd = w.shape
    if layout == "row":
        s = w.abs().amax(-1).clamp_min(1e-12) / 448.0
        return (w / s[..., None]).to(FP8), s
    nb, kb = -(-N // 128), -(-Kd // 128)
    pad = torch.zeros(E_, nb * 128, kb * 128, device=w.device)
    pad[:, :N, :Kd] = w
    s = pad.view(E_, nb, 128, kb, 128).abs().amax((2, 4)).clamp_min(1e-12) / 448.0
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :N, :Kd]
    return (w / full).to(FP8), s


def snr_db(actual, expected):
    err = (actual.double() - expected.double()).pow(2).sum()
    return float(10 * torch.log10(expected.double().pow(2).sum() / err.clamp_min(1e-30)))


# ------------------------------------------------------------------ reference vs float64
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_reference_matches_float64(dtype, renormalize):
    logits = torch.randn(9, 16).to(dtype)
    w, ids = ember.ops.moe_route(logits, 4, renormalize=renormalize)
    ew, eids = float64_route(logits, 4, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (9, 4)
    assert torch.equal(ids.long(), eids)
    torch.testing.assert_close(w.double(), ew, atol=1e-6, rtol=1e-6)


def test_route_ties_go_to_lower_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    w, ids = ember.ops.moe_route(logits, 2)
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(w, torch.full((2, 2), 0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_experts_reference_matches_float64(dtype, T):
    x = torch.randn(T, H).to(dtype)
    wgu, wd, _, _ = make_weights(dtype)
    tw, tid = ember.ops.moe_route(torch.randn(T, E), K)
    out = ember.ops.moe_experts(x, wgu, wd, tw, tid)
    assert out.dtype == dtype and out.shape == (T, H)
    assert_close(out, float64_experts(x, wgu, wd, tw, tid), dtype)


@pytest.mark.parametrize("layout", ["row", "block"])
def test_experts_reference_fp8_matches_float64(layout):
    h, i = 256, 160  # several 128-blocks per dim, ragged last block
    x = torch.randn(5, h).bfloat16()
    wgu, gs, wd, ds = make_weights(FP8, h=h, i=i, scale=layout)
    tw, tid = ember.ops.moe_route(torch.randn(5, E), K)
    out = ember.ops.moe_experts(x, wgu, wd, tw, tid, gate_up_scale=gs, down_scale=ds)
    assert_close(out, float64_experts(x, wgu, wd, tw, tid, gs, ds), torch.bfloat16)


def test_moe_is_route_then_experts():
    x = torch.randn(6, H)
    logits = torch.randn(6, E)
    wgu, wd, _, _ = make_weights(torch.float32)
    tw, tid = float64_route(logits, K)
    assert_close(moe_ops.moe(x, logits, wgu, wd, K), float64_experts(x, wgu, wd, tw, tid), torch.float32)


def test_experts_accept_int64_ids_and_repeated_experts():
    x = torch.randn(2, H)
    wgu, wd, _, _ = make_weights(torch.float32)
    tid = torch.tensor([[3, 3], [0, 7]])  # token 0 lists expert 3 twice: both pairs count
    tw = torch.tensor([[0.25, 0.5], [1.0, 0.0]])
    assert_close(ember.ops.moe_experts(x, wgu, wd, tw, tid), float64_experts(x, wgu, wd, tw, tid), torch.float32)


# ------------------------------------------------------------------ kernels (interpreter) vs reference
@pytest.fixture
def poisoned_buffers(monkeypatch):
    """Every buffer the kernel launchers allocate with torch.empty starts as NaN (or max int)."""
    kernels()  # imported under the interpreter fixture, before torch.empty is replaced
    real_empty = torch.empty

    def poison(shape, dtype, device):
        t = real_empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max)

    def empty(*shape, dtype=None, device=None, **kw):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        return poison(tuple(shape), dtype or torch.get_default_dtype(), device or "cpu")

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", lambda t, dtype=None, **kw: poison(t.shape, dtype or t.dtype, t.device))
    yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 3, 17])
def test_kernels_match_reference_interpreter(interpreter, poisoned_buffers, dtype, T):
    x = torch.randn(T, H).to(dtype)
    wgu, wd, _, _ = make_weights(dtype)
    logits = torch.randn(T, E)
    tw, tid = ember.ops.moe_route(logits, K)  # the routing kernel
    rw, rid = moe_ops.moe_route_reference(logits, K)
    assert torch.equal(tid, rid)
    torch.testing.assert_close(tw, rw, atol=1e-6, rtol=1e-6)
    expected = moe_ops.moe_experts_reference(x, wgu, wd, rw, rid)
    assert_close(ember.ops.moe_experts(x, wgu, wd, tw, tid), expected, dtype)
    assert_close(moe_ops.moe(x, logits, wgu, wd, K), expected, dtype)  # routing fused into dispatch


def test_long_prompt_runs_in_token_chunks_interpreter(interpreter, poisoned_buffers, monkeypatch):
    """Past pair_rows_chunk tokens the grouped path runs chunk by chunk (its per-pair rows stay under
    PAIR_ROWS_BYTES); a short last chunk takes the decode grouping. Same result as one pass."""
    kmod = kernels()
    assert kmod.pair_rows_chunk(8, 2048) * 8 * 2048 * 4 <= kmod.PAIR_ROWS_BYTES
    monkeypatch.setattr(kmod, "PAIR_ROWS_BYTES", 1)     # the floor: 17 tokens a chunk
    assert kmod.pair_rows_chunk(K, H) == kmod.DECODE_MAX_TOKENS + 1
    calls = []
    real = kmod.experts_grouped
    monkeypatch.setattr(kmod, "experts_grouped", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    T = 40
    x = torch.randn(T, H).bfloat16()
    wgu, wd, _, _ = make_weights(torch.bfloat16)
    tw, tid = ember.ops.moe_route(torch.randn(T, E), K)
    out = ember.ops.moe_experts(x, wgu, wd, tw, tid)
    assert calls == [17, 17, 6]
    assert_close(out, moe_ops.moe_experts_reference(x, wgu, wd, tw, tid), torch.bfloat16)


@pytest.mark.parametrize("T", [1, 3, 17])
def test_kernels_fp8_row_scale_interpreter(interpreter, poisoned_buffers, T):
    x = torch.randn(T, H).bfloat16()
    wgu, gs, wd, ds = make_weights(FP8, scale="row")
    logits = torch.randn(T, E)
    got = moe_ops.moe(x, logits, wgu, wd, K, gate_up_scale=gs, down_scale=ds)
    assert_close(got, moe_ops.moe_reference(x, logits, wgu, wd, K, True, gs, ds), torch.bfloat16)


@pytest.mark.parametrize("T", [1, 5])  # the prefill path meets block scales on the GPU (T=512)
def test_kernels_fp8_block_scale_interpreter(interpreter, poisoned_buffers, T):
    h, i = 256, 96  # scale blocks: 2 x 2 in w_gate_up (the last ragged), 2 x 1 in w_down
    x = torch.randn(T, h).bfloat16()
    wgu, gs, wd, ds = make_weights(FP8, h=h, i=i, scale="block")
    logits = torch.randn(T, E)
    got = moe_ops.moe(x, logits, wgu, wd, K, gate_up_scale=gs, down_scale=ds)
    assert_close(got, moe_ops.moe_reference(x, logits, wgu, wd, K, True, gs, ds), torch.bfloat16)


def test_route_kernel_ties_and_no_renormalize_interpreter(interpreter):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [0.0] * 5, [-1.0, 2.0, -1.0, 2.0, 7.0]])
    for renorm in (True, False):
        w, ids = ember.ops.moe_route(logits, 3, renormalize=renorm)
        ew, eids = float64_route(logits, 3, renorm)
        assert torch.equal(ids.long(), eids)
        torch.testing.assert_close(w.double(), ew, atol=1e-6, rtol=1e-6)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [4, 1, 3]]


@pytest.mark.parametrize("T", [1, 2, 17])
def test_kernels_repeated_expert_in_a_row_interpreter(interpreter, poisoned_buffers, T):
    x = torch.randn(T, H)
    wgu, wd, _, _ = make_weights(torch.float32)
    tid = torch.randint(0, E, (T, K))
    tid[0] = 5  # token 0 lists expert 5 twice; both pairs count with their own weights
    tw = torch.rand(T, K)
    assert_close(ember.ops.moe_experts(x, wgu, wd, tw, tid), float64_experts(x, wgu, wd, tw, tid), torch.float32)


def test_kernels_strided_inputs_interpreter(interpreter):
    base = torch.randn(3, 2 * H)
    x = base[:, :H]  # row stride 2H
    wgu, wd, _, _ = make_weights(torch.float32)
    logits = torch.randn(3, 2 * E)[:, ::2]  # non-contiguous logits
    assert_close(moe_ops.moe(x, logits, wgu, wd, K), moe_ops.moe_reference(x, logits, wgu, wd, K), torch.float32)


def test_public_op_takes_kernel_under_force_triton(interpreter, monkeypatch):
    kmod = kernels()
    calls = []
    real = kmod.moe
    monkeypatch.setattr(kmod, "moe", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(1, H)
    wgu, wd, _, _ = make_weights(torch.float32)
    moe_ops.moe(x, torch.randn(1, E), wgu, wd, K)
    assert calls == [(1, H)]


# ------------------------------------------------------------------ compile
def test_torch_compile_fullgraph_cpu():
    x, logits = torch.randn(3, H), torch.randn(3, E)
    wgu, wd, _, _ = make_weights(torch.float32)

    def f(x, logits):
        w, ids = ember.ops.moe_route(logits, K)
        return ember.ops.moe_experts(x, wgu, wd, w, ids, check=False) + moe_ops.moe(x, logits, wgu, wd, K)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, logits), f(x, logits))


@pytest.mark.parametrize("force", [True, False])
def test_add_rmsnorm_route_compile_fullgraph_cpu(monkeypatch, force):
    """The registered op and its fake under torch.compile: the kernel (forced Triton) or the reference."""
    force_triton_or_skip(monkeypatch, force)
    x, res, lnw, router = torch.randn(2, H), torch.randn(2, H), 1 + 0.1 * torch.randn(H), torch.randn(E, H) / 8

    def f(x, res):
        normed, new_res, w, ids = moe_ops.add_rmsnorm_route_hidden(x, res, lnw, router, K)
        return normed * 2, new_res, w.sum(-1), ids

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, res)
    for a, b in zip(got, f(x, res)):
        assert torch.equal(a, b)


# ------------------------------------------------------------------ bad input
def _args(**over):
    a = dict(x=torch.randn(2, H), w_gate_up=torch.randn(E, 2 * I, H), w_down=torch.randn(E, H, I),
             topk_weights=torch.rand(2, K), topk_ids=torch.zeros(2, K, dtype=torch.int32))
    a.update(over)
    return a


def _experts(**over):
    a = _args(**over)
    kw = {k: a.pop(k) for k in ("gate_up_scale", "down_scale", "check") if k in a}
    return ember.ops.moe_experts(a["x"], a["w_gate_up"], a["w_down"], a["topk_weights"], a["topk_ids"], **kw)


q8 = torch.randn(E, 2 * I, H).to(FP8)
d8 = torch.randn(E, H, I).to(FP8)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _experts(x=torch.randn(2, H + 1)), ValueError, "w_gate_up: expected shape"),
    (lambda: _experts(x=torch.randn(2, 3, H)), ValueError, "x: expected a 2-d"),
    (lambda: _experts(x=torch.randint(0, 3, (2, H))), TypeError, "x: expected dtype"),
    (lambda: _experts(w_gate_up=torch.randn(E, 2 * I, H).half()), TypeError, "w_gate_up: expected dtype"),
    (lambda: _experts(w_gate_up=torch.randn(E, 2 * I + 1, H)), ValueError, "w_gate_up: expected an even"),
    (lambda: _experts(w_down=torch.randn(E, H, I + 1)), ValueError, "w_down: expected shape"),
    (lambda: _experts(w_down=torch.randn(E - 1, H, I)), ValueError, "w_down: expected shape"),
    (lambda: _experts(w_down=torch.randn(E, H, I).half()), TypeError, "w_down: expected dtype"),
    (lambda: _experts(topk_ids=torch.zeros(3, K, dtype=torch.int32)), ValueError, "topk_ids: expected 2 rows"),
    (lambda: _experts(topk_ids=torch.zeros(2, K)), TypeError, "topk_ids: expected dtype"),
    (lambda: _experts(topk_weights=torch.rand(2, K + 1)), ValueError, "topk_weights: expected shape"),
    (lambda: _experts(topk_ids=torch.full((2, K), E, dtype=torch.int32)), ValueError, r"topk_ids: expected ids in \[0, 8\)"),
    (lambda: _experts(topk_ids=torch.full((2, K), -1, dtype=torch.int32)), ValueError, "topk_ids: expected ids"),
    (lambda: _experts(w_gate_up=q8, w_down=d8), ValueError, "gate_up_scale: expected a scale"),
    (lambda: _experts(w_gate_up=q8, w_down=d8, gate_up_scale=torch.ones(E, 2 * I)), ValueError, "down_scale: expected a scale"),
    (lambda: _experts(w_gate_up=q8, w_down=d8, gate_up_scale=torch.ones(E, 2 * I, 1), down_scale=torch.ones(E, H)),
     ValueError, "gate_up_scale: expected shape"),
    (lambda: _experts(gate_up_scale=torch.ones(E, 2 * I)), ValueError, "gate_up_scale: expected None"),
    (lambda: ember.ops.moe_route(torch.randn(2, E), 0), ValueError, "top_k"),
    (lambda: ember.ops.moe_route(torch.randn(2, E), E + 1), ValueError, "top_k"),
    (lambda: ember.ops.moe_route(torch.randn(2, E), 2.0), TypeError, "top_k"),
    (lambda: ember.ops.moe_route(torch.randn(2, E, 1), 2), ValueError, "router_logits"),
    (lambda: ember.ops.moe_route(torch.randint(0, 2, (2, E)), 2), TypeError, "router_logits"),
    (lambda: moe_ops.moe(torch.randn(2, H), torch.randn(3, E), torch.randn(E, 2 * I, H), torch.randn(E, H, I), K),
     ValueError, "router_logits: expected 2 rows"),
    (lambda: moe_ops.moe(torch.randn(2, H), torch.randn(2, E + 1), torch.randn(E, 2 * I, H), torch.randn(E, H, I), K),
     ValueError, "router_logits: expected 8 columns"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_out_of_range_ids_pass_unchecked_with_check_false():
    # check=False skips the syncing range check; the reference then fails on its own (no silent success)
    with pytest.raises(IndexError):
        _experts(topk_ids=torch.full((2, K), E, dtype=torch.int32), check=False)


def test_device_mismatch_named():
    with pytest.raises(ValueError, match="w_down: expected device cpu"):
        _experts(w_down=torch.randn(E, H, I, device="meta"))


# ------------------------------------------------------------------ GPU (Qwen3-30B-A3B shapes)
QE, QK, QH, QI = 128, 8, 2048, 768


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 512])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, "row", "block"])
def test_gpu_qwen3_shapes(cuda, T, wdtype):
    x = torch.randn(T, QH, device=cuda).bfloat16()
    logits = torch.randn(T, QE, device=cuda)
    if wdtype == torch.bfloat16:
        wgu, wd, gs, ds = make_weights(wdtype, QE, QH, QI, device=cuda)
    else:
        wgu, gs, wd, ds = make_weights(FP8, QE, QH, QI, device=cuda, scale=wdtype)
    tw, tid = ember.ops.moe_route(logits, QK)
    rw, rid = moe_ops.moe_route_reference(logits, QK)
    assert torch.equal(tid, rid)
    torch.testing.assert_close(tw, rw, atol=1e-6, rtol=1e-6)
    expected = moe_ops.moe_experts_reference(x, wgu, wd, rw, rid, gs, ds)
    assert_close(ember.ops.moe_experts(x, wgu, wd, tw, tid, gate_up_scale=gs, down_scale=ds), expected)
    assert_close(moe_ops.moe(x, logits, wgu, wd, QK, gate_up_scale=gs, down_scale=ds), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [2, 8, 16, 512])
def test_gpu_experts_bitwise_reproducible(cuda, dtype, T):
    """Batched decode and prefill give the same bits on every call: a token's expert rows are summed
    in a fixed order (an atomic combine once made greedy decoding differ between runs)."""
    x = torch.randn(T, QH, device=cuda).to(dtype)
    wgu, wd, _, _ = make_weights(dtype, QE, QH, QI, device=cuda)
    tw, tid = ember.ops.moe_route(torch.randn(T, QE, device=cuda), QK)
    first = ember.ops.moe_experts(x, wgu, wd, tw, tid)
    for _ in range(20):
        assert torch.equal(ember.ops.moe_experts(x, wgu, wd, tw, tid), first)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_gpu_other_dtypes(cuda, dtype, T):
    x = torch.randn(T, 256, device=cuda).to(dtype)
    wgu, wd, _, _ = make_weights(dtype, 16, 256, 96, device=cuda)
    logits = torch.randn(T, 16, device=cuda)
    assert_close(moe_ops.moe(x, logits, wgu, wd, 4), moe_ops.moe_reference(x, logits, wgu, wd, 4), dtype)


@pytest.mark.gpu
def test_gpu_compile_fullgraph(cuda):
    wgu, wd, _, _ = make_weights(torch.bfloat16, QE, QH, QI, device=cuda)
    x, logits = torch.randn(4, QH, device=cuda).bfloat16(), torch.randn(4, QE, device=cuda)
    f = torch.compile(lambda x, l: moe_ops.moe(x, l, wgu, wd, QK), fullgraph=True)
    assert_close(f(x, logits), moe_ops.moe_reference(x, logits, wgu, wd, QK))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 512])
def test_gpu_cuda_graph_capture(cuda, T):
    wgu, wd, _, _ = make_weights(torch.bfloat16, QE, QH, QI, device=cuda)
    x, logits = torch.randn(T, QH, device=cuda).bfloat16(), torch.randn(T, QE, device=cuda)
    moe_ops.moe(x, logits, wgu, wd, QK)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_ops.moe(x, logits, wgu, wd, QK)
    for _ in range(2):  # new inputs, new routing: the graph must follow them
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        g.replay()
        assert_close(out, moe_ops.moe_reference(x, logits, wgu, wd, QK))


@pytest.mark.parametrize("scale", ["row", "block"])
def test_gemv_loop_variants_interpreter(interpreter, poisoned_buffers, scale):
    """The v1 GEMVs' K-loop form the other tests do not use (the interpreter tiles unroll gate_up, not down)."""
    flip = {name: dict(UNROLL=not kernels().tiles(name, CPU)["UNROLL"]) for name in ("gemv_gate_up", "gemv_down")}
    h, i = (256, 96) if scale == "block" else (H, I)
    x = torch.randn(1, h).bfloat16()
    wgu, gs, wd, ds = make_weights(FP8, h=h, i=i, scale=scale)
    logits = torch.randn(1, E)
    with t1_kernels("v1"), moe_tiles(**flip):
        got = moe_ops.moe(x, logits, wgu, wd, K, gate_up_scale=gs, down_scale=ds)
    assert_close(got, moe_ops.moe_reference(x, logits, wgu, wd, K, True, gs, ds), torch.bfloat16)


# ------------------------------------------------------------------ T=1 v2 GEMV kernels (entry "t1": v2)
V2_CASES = [(torch.bfloat16, None, 64, 32), (torch.float16, None, 100, 48), (torch.float32, None, 100, 48),
            (torch.bfloat16, None, 100, 48), (FP8, "row", 64, 32), (FP8, "row", 100, 48),
            (FP8, "block", 100, 48), (FP8, "block", 256, 96)]


@pytest.fixture
def t1_v2(monkeypatch):
    """Select the v2 T=1 kernels; the v1 GEMV launcher fails the test if it is reached."""
    kmod = kernels()
    monkeypatch.setattr(kmod, "experts_gemv", lambda *a, **kw: pytest.fail("the v1 T=1 kernels ran"))
    with t1_kernels("v2"):
        yield kmod


@pytest.mark.parametrize("wdtype,scale,h,i", V2_CASES)
def test_t1_v2_kernels_interpreter(interpreter, poisoned_buffers, t1_v2, wdtype, scale, h, i):
    xdtype = torch.bfloat16 if wdtype == FP8 else wdtype
    if wdtype == FP8:
        wgu, gs, wd, ds = make_weights(FP8, h=h, i=i, scale=scale)
    else:
        wgu, wd, gs, ds = make_weights(wdtype, h=h, i=i)
    x = torch.randn(1, h).to(xdtype)
    logits = torch.randn(1, E)
    rw, rid = moe_ops.moe_route_reference(logits, K)
    expected = moe_ops.moe_experts_reference(x, wgu, wd, rw, rid, gs, ds)
    assert_close(moe_ops.moe(x, logits, wgu, wd, K, gate_up_scale=gs, down_scale=ds), expected, xdtype)
    got = ember.ops.moe_experts(x, wgu, wd, rw, rid, gate_up_scale=gs, down_scale=ds)
    assert_close(got, expected, xdtype)
    # and against the independent float64 math (the reference itself is checked against it above)
    assert_close(got, float64_experts(x, wgu, wd, rw, rid, gs, ds).to(xdtype), xdtype)


def test_t1_v2_repeated_expert_and_other_tiles_interpreter(interpreter, poisoned_buffers, t1_v2):
    x = torch.randn(1, 100)
    wgu, wd, _, _ = make_weights(torch.float32, h=100, i=48)
    tid = torch.tensor([[5, 5]])  # one expert listed twice: both pairs count with their own weights
    tw = torch.tensor([[0.7, 0.2]])
    expected = float64_experts(x, wgu, wd, tw, tid)
    assert_close(ember.ops.moe_experts(x, wgu, wd, tw, tid), expected, torch.float32)
    for gw, gr, dw, dr in ((1, 1, 1, 1), (2, 2, 1, 4)):  # what a sweep sets: warps and rows of each GEMV
        with moe_tiles(gemv_v2_gate_up=dict(num_warps=gw, ROWS=gr), gemv_v2_down=dict(num_warps=dw, ROWS=dr)):
            assert_close(ember.ops.moe_experts(x, wgu, wd, tw, tid), expected, torch.float32)
    with moe_tiles(gemv_v2_gate_up=dict(ROWS=3)), pytest.raises(ValueError, match="power of 2"):
        ember.ops.moe_experts(x, wgu, wd, tw, tid)


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("wdtype,scale", [(torch.bfloat16, None), (FP8, "block")])
def test_t1_down_split_interpreter(interpreter, poisoned_buffers, variant, wdtype, scale):
    """The T = 1 down GEMVs split over expert groups (SPLIT / SPLIT_FP8 of their entry): every split
    gives the float64 result, twice in a row (the arrival counters reset), and with the add_scale
    epilogue; a split that does not divide top_k runs unsplit; a split outside 1, 2, 4, 8 is named."""
    xdtype = torch.bfloat16
    if wdtype == FP8:
        wgu, gs, wd, ds = make_weights(FP8, h=100, i=48, scale=scale)
    else:
        wgu, wd, gs, ds = make_weights(wdtype, h=100, i=48)
    k = 4
    down = "gemv_down" if variant == "v1" else "gemv_v2_down"
    for split in (1, 2, 4, 8):  # 8 does not divide k = 4
        with t1_kernels(variant), moe_tiles(**{down: dict(SPLIT=split, SPLIT_FP8=split)}):
            for _ in range(2):
                x, res = torch.randn(1, 100).to(xdtype), torch.randn(1, 100).to(xdtype)
                tw, tid = moe_ops.moe_route_reference(torch.randn(1, E), k)
                got = ember.ops.moe_experts(x, wgu, wd, tw, tid, gate_up_scale=gs, down_scale=ds)
                assert_close(got, float64_experts(x, wgu, wd, tw, tid, gs, ds).to(xdtype), xdtype)
                lnw = (torch.rand(100) + 0.5).to(xdtype)
                h, scaled = ember.ops.moe_experts_add_scale(x, wgu, wd, tw, tid, res, lnw, gate_up_scale=gs,
                                                            down_scale=ds)
                eh, es = moe_ops.moe_experts_add_scale_reference(x, wgu, wd, tw, tid, res, lnw, gs, ds)
                assert_close(h, eh, xdtype)
                assert torch.equal(scaled, (h.float() * lnw.float()).to(xdtype))
    with t1_kernels(variant), moe_tiles(**{down: dict(SPLIT=3, SPLIT_FP8=3)}):
        with pytest.raises(ValueError, match="SPLIT and SPLIT_FP8 must be 1, 2, 4 or 8"):
            ember.ops.moe_experts(x, wgu, wd, tw, tid, gate_up_scale=gs, down_scale=ds)


@pytest.mark.parametrize("folder", ["sm_90-nvidia-h200", "generic"])
def test_shipped_tuning_entries_are_valid(folder):
    """Every shipped moe entry passes the launchers' checks (and the keys are the ones they read);
    malformed entries are named."""
    import json
    entries = json.loads((tuning.DATA_DIR / folder / "moe.json").read_text())
    # the keys the launchers read (ember.kernels.moe's docstring); "router" is a rule in code
    assert set(entries) == {"t1", "gemv_gate_up", "gemv_down", "gemv_v2_gate_up", "gemv_v2_down", "grouped_decode",
                            "prefill", "prefill:large_smem"}
    with tuning.override("moe", entries):
        for key in entries:
            assert kernels().tiles(key, CPU) == entries[key]
        assert kernels().t1_variant(CPU, fp8=False) in ("v1", "v2")
    bad = {"t1": {"GEMV": "v3", "GEMV_FP8": "v2"}, "grouped_decode": dict(entries["grouped_decode"], BLOCK_K=256),
           "prefill": dict(entries["prefill"], max_block_m=48), "gemv_down": {"BLOCK_N": 2}}
    for key, entry in bad.items():
        with tuning.override("moe", {key: entry}), pytest.raises(ValueError, match=f"moe tuning entry '{key}'"):
            kernels().tiles(key, CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, "row", "block"])
def test_gpu_t1_qwen3_shapes_and_graph(cuda, wdtype, split, variant):
    down = "gemv_down" if variant == "v1" else "gemv_v2_down"
    with t1_kernels(variant), moe_tiles(cuda, **{down: dict(SPLIT=split, SPLIT_FP8=split)}):
        _t1_qwen3_shapes_and_graph(cuda, wdtype)


def _t1_qwen3_shapes_and_graph(cuda, wdtype):
    x = torch.randn(1, QH, device=cuda).bfloat16()
    logits = torch.randn(1, QE, device=cuda)
    if wdtype == torch.bfloat16:
        wgu, wd, gs, ds = make_weights(wdtype, QE, QH, QI, device=cuda)
    else:
        wgu, gs, wd, ds = make_weights(FP8, QE, QH, QI, device=cuda, scale=wdtype)
    run = lambda: moe_ops.moe(x, logits, wgu, wd, QK, gate_up_scale=gs, down_scale=ds)  # noqa: E731
    assert_close(run(), moe_ops.moe_reference(x, logits, wgu, wd, QK, True, gs, ds))
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    g.replay()
    assert_close(out, moe_ops.moe_reference(x, logits, wgu, wd, QK, True, gs, ds))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_t1_v2_other_dtypes(cuda, dtype):
    x = torch.randn(1, 256, device=cuda).to(dtype)
    wgu, wd, _, _ = make_weights(dtype, 16, 256, 96, device=cuda)
    logits = torch.randn(1, 16, device=cuda)
    with t1_kernels("v2"):
        got = moe_ops.moe(x, logits, wgu, wd, 4)
    assert_close(got, moe_ops.moe_reference(x, logits, wgu, wd, 4), dtype)


# ------------------------------------------------------------------ router GEMV + routing in one launch
def float64_route_hidden(x, router, top_k, renormalize=True):
    """Logits as F.linear returns them (float64 dot, rounded once to x.dtype), then float64 routing."""
    logits = (x.double() @ router.double().t()).to(x.dtype)
    return float64_route(logits, top_k, renormalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,e,h,k", [(1, 8, 64, 2), (3, 60, 100, 4), (2, 128, 64, 8)])
def test_route_hidden_kernel_interpreter(interpreter, dtype, T, e, h, k):
    kmod = kernels()
    router = (torch.randn(e, h) / h ** 0.5).to(dtype)
    for _ in range(2):  # the second call proves the arrival counters were reset by the first
        x = torch.randn(T, h).to(dtype)
        w, ids = kmod.route_hidden(x, router, k, True)
        w64, ids64 = float64_route_hidden(x, router, k)
        assert torch.equal(ids.long(), ids64)
        assert_close(w, w64.float())
    from ember.kernels._common import arrival_counters
    assert int(arrival_counters("moe_router", x.device, T)[:T].abs().sum()) == 0


@pytest.mark.parametrize("rows,warps", [(1, 1), (4, 2)])
def test_route_hidden_router_tile_override_interpreter(interpreter, rows, warps):
    """Other router tiles (entry "router", what a decode-step sweep sets) give the same routing."""
    router = torch.randn(61, 100) / 10  # 61 experts: the last program's rows are partly past E
    x = torch.randn(3, 100)
    with tuning.override("moe", {"router": {"BLOCK_R": rows, "num_warps": warps}}):
        w, ids = moe_ops.moe_route_hidden(x, router, 4)
    w64, ids64 = float64_route_hidden(x, router, 4)
    assert torch.equal(ids.long(), ids64)
    assert_close(w, w64.float())
    with tuning.override("moe", {"router": {"BLOCK_R": 3, "num_warps": 4}}):
        with pytest.raises(ValueError, match="moe tuning entry 'router'"):
            moe_ops.moe_route_hidden(x, router, 4)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_route_hidden_ties_go_to_the_lower_index_interpreter(interpreter, scoring):
    """Duplicated router rows give bit-equal logits: the lower expert index is ranked first, as in
    the float64 references (a python sort on (-value, index))."""
    kmod = kernels()
    e, h, k = 16, 64, 5
    x = torch.randn(3, h)
    router = torch.randn(e, h) / h ** 0.5
    router[2] = x[0].sign() * 0.5  # token 0's largest logit, by far ...
    router[[9, 12, 14]] = router[2].clone()  # ... in a four-way tie: 2, 9, 12, 14
    router[7] = router[3].clone()  # another tie lower down
    if scoring == "softmax":
        w, ids = kmod.route_hidden(x, router, k, True)
        w64, ids64 = float64_route_hidden(x, router, k)
    else:
        w, ids = kmod.route_hidden(x, router, k, True, "sigmoid", None, 1.0)
        w64, ids64 = float64_sigmoid_route(x, router, k, None, True, 1.0)
    assert ids[0, :4].tolist() == [2, 9, 12, 14]
    assert torch.equal(ids.long(), ids64)
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=1e-6)


def test_route_hidden_public_op_paths(interpreter, monkeypatch):
    x, router = torch.randn(2, 64), torch.randn(8, 64)
    w, ids = moe_ops.moe_route_hidden(x, router, 3, renormalize=False)  # the kernel (forced Triton)
    w_ref, ids_ref = moe_ops.moe_route_hidden_reference(x, router, 3, False)
    assert torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, atol=1e-6)
    monkeypatch.setenv("EMBER_FORCE_TRITON", "0")  # the reference path
    w2, ids2 = moe_ops.moe_route_hidden(x, router, 3, renormalize=False)
    assert torch.equal(ids2, ids_ref) and torch.equal(w2, w_ref)


@pytest.mark.parametrize("make,match", [
    (lambda: (torch.randn(1, 64), torch.randn(8, 64).double(), 2), "router_weight"),
    (lambda: (torch.randn(1, 64), torch.randn(8, 32), 2), "router_weight"),
    (lambda: (torch.randn(1, 64), torch.randn(8, 64), 9), "top_k"),
    (lambda: (torch.randn(64), torch.randn(8, 64), 2), "x"),
    (lambda: (torch.randint(0, 3, (1, 64)), torch.randn(8, 64), 2), "x"),
])
def test_route_hidden_bad_input(make, match):
    x, router, k = make()
    with pytest.raises((ValueError, TypeError), match=match):
        moe_ops.moe_route_hidden(x, router, k)


def clear_rows(scores: torch.Tensor, k: int, margin: torch.Tensor) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th largest ``scores`` are apart by more than ``margin`` (same shape):
    there no rounding of the inputs within the margin can change which k are chosen."""
    order = scores.double().sort(-1, descending=True)
    m = margin.double().gather(-1, order.indices)
    return (order.values[:, k - 1] - order.values[:, k]) > m[:, k - 1] + m[:, k]


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |v| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(v.double().abs().clamp_min(2.0 ** -126))) - 7)


def assert_same_routing(w, ids, w_ref, ids_ref, clear, rtol, descending=True):
    """On the ``clear`` rows: the same experts (compared as sets: the order within them may differ by
    a near tie), each with its reference weight; with ``descending``, every row's weights in order."""
    assert clear.sum() >= clear.numel() // 2, "too few rows to compare"
    ids_s, perm = ids[clear].sort(-1)
    ref_s, ref_perm = ids_ref[clear].sort(-1)
    assert torch.equal(ids_s, ref_s)
    torch.testing.assert_close(w[clear].gather(-1, perm), w_ref[clear].gather(-1, ref_perm), rtol=rtol, atol=1e-6)
    assert not descending or (w[:, :-1] >= w[:, 1:]).all()


def bf16_logits_and_margin(x, router):
    """The reference's logits (F.linear in bf16) and how far the kernel's may lie from each: its fp32
    sum in another order rounds to the same bf16 value or a neighbour, one ulp away."""
    logits = torch.nn.functional.linear(x, router).float()
    return logits, bf16_ulp(logits)


@pytest.mark.gpu
def test_gpu_route_hidden_qwen3_shapes_in_graph(cuda):
    router = (torch.randn(QE, QH, device=cuda) / QH ** 0.5).bfloat16()
    for T in (1, 8, 64):
        x = torch.randn(T, QH, device=cuda).bfloat16()
        w, ids = moe_ops.moe_route_hidden(x, router, QK)
        w_ref, ids_ref = moe_ops.moe_route_hidden_reference(x, router, QK)
        logits, margin = bf16_logits_and_margin(x, router)
        # a logit one ulp off moves a renormalised weight by up to ~2 ulps of the largest logit (relative)
        rtol = 2 * float(bf16_ulp(logits.abs().max()))
        assert_same_routing(w, ids, w_ref, ids_ref, clear_rows(logits, QK, margin), rtol)
    x = torch.zeros(64, QH, device=cuda, dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_ops.moe_route_hidden(x, router, QK)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        w_g, ids_g = moe_ops.moe_route_hidden(x, router, QK)
    for i in range(100):
        x.copy_(torch.randn(64, QH, device=cuda))
        g.replay()
        if i % 10 == 0:
            w_ref, ids_ref = moe_ops.moe_route_hidden_reference(x, router, QK)
            logits, margin = bf16_logits_and_margin(x, router)
            rtol = 2 * float(bf16_ulp(logits.abs().max()))
            assert_same_routing(w_g, ids_g, w_ref, ids_ref, clear_rows(logits, QK, margin), rtol)


# ------------------------------------------------------------------ post-attention add_rmsnorm + router, one launch
def float64_add_rmsnorm(x, residual, weight, eps):
    """The norm's spec in float64: the residual sum rounded once to x.dtype (what the stream carries)."""
    h = (x.double() + residual.double()).to(x.dtype)
    hd = h.double()
    return (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()), h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,e,h,k", [(1, 8, 100, 2), (3, 16, 64, 4)])
def test_add_rmsnorm_route_kernel_interpreter(interpreter, dtype, T, e, h, k):
    kmod = kernels()
    router = (torch.randn(e, h) / h ** 0.5).to(dtype)
    lnw = (1 + 0.1 * torch.randn(h)).to(dtype)
    for _ in range(2):  # the second call proves the arrival counters were reset by the first
        x, res = torch.randn(T, h).to(dtype), torch.randn(T, h).to(dtype)
        normed, new_res = poisoned((T, h), dtype, "cpu"), poisoned((T, h), dtype, "cpu")
        w, ids = kmod.route_hidden(x, router, k, True, add_norm=(res, lnw, 1e-6, normed, new_res))
        n64, h_exp = float64_add_rmsnorm(x, res, lnw, 1e-6)
        assert torch.equal(new_res, h_exp)
        assert_close(normed, n64, dtype)
        # routing of the rows the kernel normalised (checked just above), in float64
        w64, ids64 = float64_route_hidden(normed, router, k)
        assert torch.equal(ids.long(), ids64)
        assert_close(w, w64.float())


@pytest.mark.parametrize("scoring,shared", [("softmax", False), ("sigmoid", False), ("softmax", True)])
def test_add_rmsnorm_route_public_op_matches_the_two_ops(interpreter, monkeypatch, scoring, shared):
    x, res, lnw = torch.randn(2, 64), torch.randn(2, 64), 1 + 0.1 * torch.randn(64)
    router = torch.randn(9, 64) / 8
    kw = dict(eps=1e-5, renormalize=True, scoring=scoring, shared_expert_gate=shared)
    if scoring == "sigmoid":
        kw.update(expert_bias=0.1 * torch.randn(9), scaling=2.0)
    got = moe_ops.add_rmsnorm_route_hidden(x, res, lnw, router, 3, **kw)  # the fused kernel (forced Triton)
    ref = moe_ops.add_rmsnorm_route_hidden_reference(x, res, lnw, router, 3, **kw)
    assert torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0], atol=1e-5)
    assert torch.equal(got[3], ref[3]) and torch.allclose(got[2], ref[2], atol=1e-5)
    monkeypatch.setenv("EMBER_FORCE_TRITON", "0")  # the reference path: the two ops, exactly
    two = moe_ops.add_rmsnorm_route_hidden(x, res, lnw, router, 3, **kw)
    assert all(torch.equal(a, b) for a, b in zip(two, ref))


@pytest.mark.parametrize("make,match", [
    (lambda: (torch.randn(1, 64), torch.randn(1, 32), torch.ones(64)), "residual"),
    (lambda: (torch.randn(1, 64), torch.randn(1, 64).double(), torch.ones(64)), "residual"),
    (lambda: (torch.randn(1, 64), torch.randn(1, 64), torch.ones(32)), "weight"),
])
def test_add_rmsnorm_route_bad_input(make, match):
    x, res, lnw = make()
    with pytest.raises((ValueError, TypeError), match=match):
        moe_ops.add_rmsnorm_route_hidden(x, res, lnw, torch.randn(8, 64), 2)


@pytest.mark.gpu
def test_gpu_add_rmsnorm_route_qwen3_shapes_in_graph(cuda):
    router = (torch.randn(QE, QH, device=cuda) / QH ** 0.5).bfloat16()
    lnw = (1 + 0.1 * torch.randn(QH, device=cuda)).bfloat16()
    x, res = torch.zeros(1, QH, device=cuda, dtype=torch.bfloat16), torch.zeros(1, QH, device=cuda, dtype=torch.bfloat16)
    moe_ops.add_rmsnorm_route_hidden(x, res, lnw, router, QK)  # compile outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_ops.add_rmsnorm_route_hidden(x, res, lnw, router, QK)
    for i in range(300):
        x.copy_(torch.randn(1, QH, device=cuda))
        res.copy_(torch.randn(1, QH, device=cuda))
        g.replay()
        if i % 30 == 0:
            n_ref, r_ref = ember.ops.add_rmsnorm(x, res, lnw, 1e-6)
            assert torch.equal(out[1], r_ref)
            torch.testing.assert_close(out[0].float(), n_ref.float(), rtol=8e-3, atol=1e-2)  # 1 bf16 ulp
            # routing of the kernel's own rows by the router launch without the norm: the same
            # products in the same order (same tiles), so the same logits and the same bits
            w_ref, ids_ref = moe_ops.moe_route_hidden(out[0], router, QK)
            assert torch.equal(out[3], ids_ref) and torch.equal(out[2], w_ref)


def float64_sigmoid_route(x, router, top_k, bias, renormalize, scaling):
    """LFM2 routing in float64 from logits rounded once to x.dtype (what F.linear returns)."""
    s = (x.double() @ router.double().t()).to(x.dtype).double().sigmoid()
    choose = s if bias is None else s + bias.double()
    T, n = s.shape
    ids = torch.tensor([sorted(range(n), key=lambda e: (-choose[t, e].item(), e))[:top_k] for t in range(T)])
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-6)
    return w * scaling, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,k,with_bias,renormalize,scaling", [(8, 2, True, True, 2.5), (32, 4, False, True, 1.0),
                                                                (60, 4, True, False, 1.0)])
def test_route_hidden_sigmoid_kernel_interpreter(interpreter, dtype, e, k, with_bias, renormalize, scaling):
    kmod = kernels()
    h = 64
    router = (torch.randn(e, h) / h ** 0.5).to(dtype)
    bias = torch.randn(e) * 0.3 if with_bias else None
    for T in (1, 3):
        x = torch.randn(T, h).to(dtype)
        w, ids = kmod.route_hidden(x, router, k, renormalize, "sigmoid", bias, scaling)
        w64, ids64 = float64_sigmoid_route(x, router, k, bias, renormalize, scaling)
        assert torch.equal(ids.long(), ids64)
        torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=1e-6)
        ref_w, ref_ids = moe_ops.moe_route_hidden_reference(x, router, k, renormalize, "sigmoid", bias, scaling)
        assert torch.equal(ref_ids, ids) and torch.allclose(ref_w, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw,match", [
    (dict(scoring="tanh"), "scoring"),
    (dict(expert_bias=torch.zeros(8)), "expert_bias"),
    (dict(scoring="sigmoid", expert_bias=torch.zeros(7)), "expert_bias"),
    (dict(scoring="sigmoid", expert_bias=torch.zeros(8, 1)), "expert_bias"),
    (dict(scoring="sigmoid", scaling=0.0), "scaling"),
    (dict(scoring="sigmoid", scaling=float("nan")), "scaling"),
    (dict(scaling=2.0), "scaling"),
])
def test_route_hidden_sigmoid_bad_input(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        moe_ops.moe_route_hidden(torch.randn(1, 64), torch.randn(8, 64), 2, **kw)


@pytest.mark.gpu
def test_gpu_route_hidden_sigmoid_lfm2_shapes(cuda):
    E_, H_, K_ = 32, 2048, 4  # LFM2-8B-A1B
    router = (torch.randn(E_, H_, device=cuda) / H_ ** 0.5).bfloat16()
    bias = torch.randn(E_, device=cuda) * 0.1
    x = torch.randn(64, H_, device=cuda).bfloat16()
    w, ids = moe_ops.moe_route_hidden(x, router, K_, scoring="sigmoid", expert_bias=bias, scaling=2.5)
    w_ref, ids_ref = moe_ops.moe_route_hidden_reference(x, router, K_, True, "sigmoid", bias, 2.5)
    logits, margin = bf16_logits_and_margin(x, router)
    # selection by sigmoid(logit) + bias: a logit one ulp off moves that by at most a quarter ulp
    # (the sigmoid's slope), plus float32 rounding
    clear = clear_rows(logits.sigmoid() + bias, K_, margin / 4 + 1e-6)
    # the weights are the unbiased scores, ordered by the biased ones
    assert_same_routing(w, ids, w_ref, ids_ref, clear, 2 * float(bf16_ulp(logits.abs().max())), descending=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e,k", [(9, 2), (33, 8)])
def test_route_hidden_shared_gate_kernel_interpreter(interpreter, dtype, e, k):
    """The last router row gates a shared expert: appended as id e-1 with weight sigmoid(logit)."""
    kmod = kernels()
    h = 64
    router = (torch.randn(e, h) / h ** 0.5).to(dtype)
    for T in (1, 2):
        x = torch.randn(T, h).to(dtype)
        w, ids = kmod.route_hidden(x, router, k, True, shared_expert_gate=True)
        assert w.shape == ids.shape == (T, k + 1)
        logits = (x.double() @ router.double().t()).to(dtype)
        w64, ids64 = float64_route(logits[:, :-1], k)
        assert torch.equal(ids[:, :k].long(), ids64) and (ids[:, k] == e - 1).all()
        torch.testing.assert_close(w[:, :k].double(), w64, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w[:, k].double(), logits[:, -1].double().sigmoid(), rtol=1e-5, atol=1e-6)
        ref_w, ref_ids = moe_ops.moe_route_hidden_reference(x, router, k, True, shared_expert_gate=True)
        assert torch.equal(ref_ids, ids) and torch.allclose(ref_w, w, rtol=1e-5, atol=1e-6)


def test_route_hidden_shared_gate_bad_input():
    with pytest.raises(ValueError, match="top_k"):
        moe_ops.moe_route_hidden(torch.randn(1, 64), torch.randn(8, 64), 8, shared_expert_gate=True)  # 7 experts
    with pytest.raises(ValueError, match="shared_expert_gate"):
        moe_ops.moe_route_hidden(torch.randn(1, 64), torch.randn(8, 64), 2, scoring="sigmoid", shared_expert_gate=True)
    with pytest.raises(TypeError, match="shared_expert_gate"):
        moe_ops.moe_route_hidden(torch.randn(1, 64), torch.randn(8, 64), 2, shared_expert_gate=1)


@pytest.mark.gpu
def test_gpu_route_hidden_shared_gate_qwen35_shapes(cuda):
    E_, H_, K_ = 257, 2048, 8  # Qwen3.5-35B-A3B: 256 experts + the shared expert's gate row
    router = (torch.randn(E_, H_, device=cuda) / H_ ** 0.5).bfloat16()
    x = torch.randn(64, H_, device=cuda).bfloat16()
    w, ids = moe_ops.moe_route_hidden(x, router, K_, shared_expert_gate=True)
    w_ref, ids_ref = moe_ops.moe_route_hidden_reference(x, router, K_, True, shared_expert_gate=True)
    assert (ids[:, K_] == E_ - 1).all()
    logits, margin = bf16_logits_and_margin(x, router)
    rtol = 2 * float(bf16_ulp(logits.abs().max()))
    torch.testing.assert_close(w[:, K_], w_ref[:, K_], rtol=rtol, atol=1e-6)  # the shared expert's gate
    clear = clear_rows(logits[:, :-1], K_, margin[:, :-1])
    assert_same_routing(w[:, :K_], ids[:, :K_], w_ref[:, :K_], ids_ref[:, :K_], clear, rtol)


@pytest.mark.parametrize("bn,bk,warps", [(8, 128, 2), (4, 64, 1)])
def test_t1_with_overridden_tiles_interpreter(interpreter, bn, bk, warps):
    """The v1 T=1 GEMVs give the reference result with other tiles (what the step sweep runs)."""
    torch.manual_seed(0)
    E, H, I, k = 8, 256, 192, 2
    x = torch.randn(1, H)
    wgu, wd = torch.randn(E, 2 * I, H) / 16, torch.randn(E, H, I) / 16
    logits = torch.randn(1, E)
    tile = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    with t1_kernels("v1"), moe_tiles(gemv_gate_up=tile, gemv_down=tile):
        got = ember.ops.moe(x, logits, wgu, wd, k, renormalize=True)
    want = moe_ops.moe_reference(x, logits, wgu, wd, k, renormalize=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _grouped_tile(bn, bk, warps=1, stages=1):
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("gate_up,down,max_block_m", [((32, 32), (16, 16), 16), ((16, 64), (64, 32), 32)])
def test_prefill_with_overridden_tiles_interpreter(interpreter, gate_up, down, max_block_m):
    """The prefill path gives the reference result with separate gate_up / down tiles and a smaller
    row block (what the prefill sweep runs), bf16-exact operands so the float32 sums agree closely."""
    torch.manual_seed(1)
    E, H, I, k, T = 8, 128, 96, 2, 160  # ~40 pairs an expert: the cap sets the row block
    x = torch.randn(T, H).bfloat16().float()
    wgu = (torch.randn(E, 2 * I, H) / 16).bfloat16().float()
    wd = (torch.randn(E, H, I) / 16).bfloat16().float()
    logits = torch.randn(T, E)
    entry = dict(gate_up=_grouped_tile(*gate_up), down=_grouped_tile(*down), max_block_m=max_block_m)
    with tuning.override("moe", {"prefill": entry}):
        assert kernels().prefill_configs(CPU) == entry
        got = ember.ops.moe(x, logits, wgu, wd, k, renormalize=True)
    want = moe_ops.moe_reference(x, logits, wgu, wd, k, renormalize=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_grouped_decode_with_overridden_tiles_interpreter(interpreter):
    torch.manual_seed(3)
    x = torch.randn(5, H).bfloat16().float()
    wgu, wd, _, _ = make_weights(torch.float32)
    tw, tid = moe_ops.moe_route_reference(torch.randn(5, E), K)
    with tuning.override("moe", {"grouped_decode": _grouped_tile(32, 16)}):
        got = ember.ops.moe_experts(x, wgu, wd, tw, tid)
    assert_close(got, float64_experts(x, wgu, wd, tw, tid), torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("experts", [8, 300])
def test_prefill_matches_float64_interpreter(interpreter, dtype, experts):
    """Prefill (pair rows in the activation dtype) matches the float64 experts at the dtype's
    tolerance, with the align kernels (8 experts) and the torch align (300: more than they take)."""
    torch.manual_seed(2)
    H, I, k, T = 96, 64, 3, 48
    x = torch.randn(T, H).to(dtype)
    wgu, wd = (torch.randn(experts, 2 * I, H) / 8).to(dtype), (torch.randn(experts, H, I) / 8).to(dtype)
    tw, tid = moe_ops.moe_route_reference(torch.randn(T, experts), k)
    got = ember.ops.moe_experts(x, wgu, wd, tw, tid)
    assert_close(got, float64_experts(x, wgu, wd, tw, tid).to(dtype), dtype)


@pytest.mark.parametrize("T,k,E,block_m,route", [(40, 2, 8, 16, "random"), (100, 8, 128, 32, "random"),
                                                   (17, 3, 5, 16, "random"), (300, 8, 256, 64, "random"),
                                                   (64, 4, 64, 128, "one"), (33, 4, 24, 16, "repeats")])
def test_align_kernels_match_torch_interpreter(interpreter, T, k, E, block_m, route):
    """The three align kernels give the torch form's sorted pairs and block experts bit for bit (a
    stable sort by expert): random routing, every pair on one expert, tokens repeating an expert."""
    from ember.kernels.moe import align
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    if route == "one":
        ids[:] = E - 1
    elif route == "repeats":
        ids[:, 1] = ids[:, 0]
    sorted_pairs, block_expert, n_blocks = align.align(ids, E, block_m)
    want_pairs, want_experts, want_n = align.align_torch(ids, E, block_m)
    assert n_blocks == want_n
    assert torch.equal(sorted_pairs, want_pairs) and torch.equal(block_expert, want_experts)


def test_sort_key_dtype():
    from ember.kernels.moe import align
    assert [align.sort_key_dtype(e) for e in (8, 256, 257, 1 << 15, (1 << 15) + 1)] == \
        [torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32]


# ------------------------------------------------------------------ experts + residual + next norm scale (one token)
def float64_add_scale(x, wgu, wd, tw, tid, res, lnw, gs=None, ds=None):
    """The experts' sum rounded to x.dtype, plus the residual rounded again (add_rmsnorm's residual
    rule), and that times the norm weight in float64 rounded once."""
    y = float64_experts(x, wgu, wd, tw, tid, gs, ds).to(x.dtype)
    h = (y.double() + res.double()).to(x.dtype)
    return h, (h.double() * lnw.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_add_scale_reference_matches_float64(dtype):
    x, res, lnw = torch.randn(1, H).to(dtype), torch.randn(1, H).to(dtype), (torch.rand(H) + 0.5).to(dtype)
    wgu, wd, _, _ = make_weights(dtype)
    tw, tid = moe_ops.moe_route_reference(torch.randn(1, E), K)
    h, scaled = moe_ops.moe_experts_add_scale_reference(x, wgu, wd, tw, tid, res, lnw)
    eh, es = float64_add_scale(x, wgu, wd, tw, tid, res, lnw)
    assert_close(h, eh, dtype)
    assert_close(scaled, es, dtype)
    # the next layer's add_rmsnorm is scaled / rms(h): the residual output is add_rmsnorm's
    normed, new_res = ember.ops.add_rmsnorm_reference(moe_ops.moe_experts_reference(x, wgu, wd, tw, tid), res, lnw, 1e-6)
    assert torch.equal(new_res, h)
    inv = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert_close((scaled.float() * inv).to(dtype), normed, dtype)


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("wdtype,scale", [(torch.float32, None), (torch.bfloat16, None), (FP8, "row"),
                                          (FP8, "block")])
def test_experts_add_scale_kernels_interpreter(interpreter, poisoned_buffers, variant, wdtype, scale):
    xdtype, wgu, wd, gs, ds, x, res, lnw, tw, tid = _one_token_inputs(wdtype, scale, K)
    with t1_kernels(variant):
        h, scaled = ember.ops.moe_experts_add_scale(x, wgu, wd, tw, tid, res, lnw, gate_up_scale=gs, down_scale=ds)
    eh, es = moe_ops.moe_experts_add_scale_reference(x, wgu, wd, tw, tid, res, lnw, gs, ds)
    assert_close(h, eh, xdtype)
    assert_close(scaled, es, xdtype)
    # scaled is h * lnw rounded from the h the kernel stored: exact, whatever the GEMV's summation order
    assert torch.equal(scaled, (h.float() * lnw.float()).to(xdtype))


@pytest.mark.parametrize("wdtype,scale", [(torch.float32, None), (torch.bfloat16, None), (FP8, "block")])
def test_experts_add_scale_grouped_interpreter(interpreter, poisoned_buffers, wdtype, scale):
    """3 tokens (the decode path's grouped kernels): the fold sits in the combine kernel's epilogue."""
    xdtype = torch.bfloat16 if wdtype == FP8 else wdtype
    if wdtype == FP8:
        wgu, gs, wd, ds = make_weights(FP8, scale=scale)
    else:
        wgu, wd, gs, ds = make_weights(wdtype)
    x, res = torch.randn(3, H).to(xdtype), torch.randn(3, H).to(xdtype)
    lnw = (torch.rand(H) + 0.5).to(xdtype)
    tw, tid = moe_ops.moe_route_reference(torch.randn(3, E), K)
    h, scaled = ember.ops.moe_experts_add_scale(x, wgu, wd, tw, tid, res, lnw, gate_up_scale=gs, down_scale=ds)
    eh, es = float64_add_scale(x, wgu, wd, tw, tid, res, lnw, gs, ds)
    assert_close(h, eh, xdtype)
    assert_close(scaled, es, xdtype)
    assert torch.equal(scaled, (h.float() * lnw.float()).to(xdtype))
    # and the plain combine still writes the experts' sum
    assert_close(ember.ops.moe_experts(x, wgu, wd, tw, tid, gate_up_scale=gs, down_scale=ds),
                 moe_ops.moe_experts_reference(x, wgu, wd, tw, tid, gs, ds), xdtype)


def test_experts_add_scale_compile_fullgraph_cpu():
    x, res, lnw = torch.randn(1, H), torch.randn(1, H), torch.rand(H) + 0.5
    wgu, wd, _, _ = make_weights(torch.float32)

    def f(x, res, logits):
        w, ids = ember.ops.moe_route(logits, K)
        h, scaled = ember.ops.moe_experts_add_scale(x, wgu, wd, w, ids, res, lnw, check=False)
        return h + scaled

    torch._dynamo.reset()
    logits = torch.randn(1, E)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, res, logits), f(x, res, logits))


def _add_scale(**over):
    a = dict(x=torch.randn(1, H), w_gate_up=torch.randn(E, 2 * I, H), w_down=torch.randn(E, H, I),
             topk_weights=torch.rand(1, K), topk_ids=torch.zeros(1, K, dtype=torch.int32),
             residual=torch.randn(1, H), norm_weight=torch.ones(H))
    a.update(over)
    return ember.ops.moe_experts_add_scale(**a)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _add_scale(x=torch.randn(17, H), topk_weights=torch.rand(17, K), topk_ids=torch.zeros(17, K, dtype=torch.int32),
                        residual=torch.randn(17, H)), ValueError, "x: moe_experts_add_scale takes 1 to 16 tokens"),
    (lambda: _add_scale(residual=torch.randn(1, H + 1)), ValueError, "residual: expected shape"),
    (lambda: _add_scale(residual=torch.randn(1, H).half()), TypeError, "residual: expected dtype"),
    (lambda: _add_scale(residual=[0.0] * H), TypeError, "residual: expected a torch.Tensor"),
    (lambda: _add_scale(norm_weight=torch.ones(H - 1)), ValueError, "norm_weight: expected length 64"),
    (lambda: _add_scale(norm_weight=torch.ones(1, H)), ValueError, "norm_weight: expected a 1-d"),
    (lambda: _add_scale(norm_weight=torch.ones(H, device="meta")), ValueError, "norm_weight: expected device cpu"),
    (lambda: _add_scale(topk_ids=torch.full((1, K), E, dtype=torch.int32)), ValueError, "topk_ids: expected ids"),
])
def test_experts_add_scale_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("variant,T", [("v1", 1), ("v2", 1), ("v1", 4)])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, "block"])
def test_gpu_experts_add_scale_qwen3_shapes(cuda, variant, T, wdtype):
    x, res = torch.randn(T, QH, device=cuda).bfloat16(), torch.randn(T, QH, device=cuda).bfloat16()
    lnw = (torch.rand(QH, device=cuda) + 0.5).bfloat16()
    if wdtype == torch.bfloat16:
        wgu, wd, gs, ds = make_weights(wdtype, QE, QH, QI, device=cuda)
    else:
        wgu, gs, wd, ds = make_weights(FP8, QE, QH, QI, device=cuda, scale=wdtype)
    tw, tid = moe_ops.moe_route_reference(torch.randn(T, QE, device=cuda), QK)
    with t1_kernels(variant):
        h, scaled = ember.ops.moe_experts_add_scale(x, wgu, wd, tw, tid, res, lnw, gate_up_scale=gs, down_scale=ds)
    eh, es = moe_ops.moe_experts_add_scale_reference(x, wgu, wd, tw, tid, res, lnw, gs, ds)
    assert_close(h, eh)
    assert_close(scaled, es)
    assert torch.equal(scaled, (h.float() * lnw.float()).bfloat16())
