import math

import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _dispatch, tuning
from tests.helpers import assert_close, check_compile_and_graph, force_triton_or_skip, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
linear_mod = __import__("ember.ops.linear", fromlist=["linear"])


def operands(N, K, dtype, *, bias=True, device="cpu", lead=(1,)):
    """x [*lead, K], weight [N, K] scaled so outputs are O(1), bias [N] (or None)."""
    x = torch.randn(*lead, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / math.sqrt(max(K, 1))).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    return x, w, b


def float64_linear(x, w, b):
    """Independent float64 math on the (already rounded) operands."""
    out = x.double().cpu() @ w.double().cpu().T
    return out if b is None else out + b.double().cpu()


def gemv_calls(monkeypatch):
    """Record every launch of the GEMV kernel's ``linear`` launcher."""
    k = _dispatch.kernels("gemv")
    calls, real = [], k.linear
    monkeypatch.setattr(k, "linear", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    return calls


# ------------------------------------------------------------------ reference and the non-Triton path
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_reference_matches_float64(dtype, bias):
    x, w, b = operands(100, 768, dtype, bias=bias, lead=(3, 5))
    got = linear_mod.linear_reference(x, w, b)
    assert got.dtype == dtype and got.shape == (3, 5, 100)
    assert_close(got, float64_linear(x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1,), (4,), (2, 3)])
def test_cpu_path_is_f_linear_bit_for_bit(dtype, lead):
    # the models' oracle tests vs transformers rely on the CPU path being exactly F.linear
    x, w, b = operands(64, 100, dtype, lead=lead)
    assert torch.equal(ember.ops.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(ember.ops.linear(x, w), F.linear(x, w))


# ------------------------------------------------------------------ GEMV kernel (interpreter) vs float64
SHAPES = [(1, 1), (7, 100), (100, 7), (64, 768), (768, 64), (1, 2053), (2053, 7), (64, 2053)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", SHAPES)
def test_gemv_matches_float64_interpreter(interpreter, monkeypatch, dtype, N, K):
    calls = gemv_calls(monkeypatch)
    for bias in (True, False):
        x, w, b = operands(N, K, dtype, bias=bias)
        got = ember.ops.linear(x, w, b)
        assert got.dtype == dtype and got.shape == (1, N)
        assert_close(got, float64_linear(x, w, b), dtype)
    assert len(calls) == 2  # both went through the Triton GEMV


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_non_contiguous_x_interpreter(interpreter, monkeypatch, dtype):
    calls = gemv_calls(monkeypatch)
    _, w, b = operands(37, 300, dtype)
    wide = torch.randn(2, 1, 900).to(dtype)
    x = wide[1:, :, ::3]  # [1, 1, 300], stride 3 along K, non-zero storage offset
    assert not x.is_contiguous()
    got = ember.ops.linear(x, w, b)
    assert got.shape == (1, 1, 37)
    assert_close(got, float64_linear(x.reshape(1, 300), w, b).reshape(1, 1, 37), dtype)
    x1 = torch.randn(300, 2).to(dtype)[:, 0]  # a 1-d x with stride 2
    assert_close(ember.ops.linear(x1, w), float64_linear(x1[None], w, None)[0], dtype)
    assert len(calls) == 2


# several rows per warp (KW below a warp's 512 bytes), several chunks and K steps, tiles that divide N
# and K (no masks) and tiles that do not
GEMV_CONFIGS = [dict(BLOCK_N=4, CHUNKS=2, KW=256, num_warps=4),
                dict(BLOCK_N=16, CHUNKS=4, KW=64, num_warps=2),
                dict(BLOCK_N=8, CHUNKS=1, KW=128, num_warps=4),
                dict(BLOCK_N=8, CHUNKS=4, KW=64, num_warps=4, STEP_REDUCE=True)]


@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("N, K", [(16, 1024), (37, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_configs_write_every_output_interpreter(interpreter, config, N, K, dtype):
    x, w, b = operands(N, K, dtype)
    out = poisoned((1, N), dtype, "cpu")
    got = _dispatch.kernels("gemv").linear(x, w, b, config=config, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, float64_linear(x, w, b), dtype)


@pytest.mark.parametrize("elsize", [1, 2, 4])
@pytest.mark.parametrize("N, K", [(100, 7), (2048, 768), (5120, 2048), (2048, 8192)])
def test_gemv_rule_tiles_cover_a_row(N, K, elsize):
    """The rule's tile (no tuning entry): 16-byte vectors, a warp's 32 threads all loading, a K step
    no longer than the padded row."""
    cfg = _dispatch.kernels("gemv").gemv_config(N, K, elsize)
    kw, bn, warps = cfg["KW"], cfg["BLOCK_N"], cfg["num_warps"]
    assert kw * elsize <= 512 and kw * elsize >= min(16, triton_pow2(K) * elsize)
    rows_per_warp = max(1, 32 // (kw * elsize // 16))
    assert bn % (warps * rows_per_warp) == 0
    assert cfg["CHUNKS"] * kw <= max(kw, triton_pow2(K))


def triton_pow2(n):
    return 1 << (n - 1).bit_length()


def test_gemv_tuning_entry_routes_and_tiles_interpreter(interpreter, monkeypatch):
    """A ``gemv`` tuning entry is the tile ember.ops.linear launches, also while it is captured
    (read per call); on a GPU, long rows take the GEMV only with an entry (cuBLAS measured faster
    under the rule)."""
    k = _dispatch.kernels("gemv")
    entry = dict(BLOCK_N=4, CHUNKS=2, num_warps=2, STEP_REDUCE=False)
    key = k.key(torch.bfloat16, 40, 512)
    assert key == "bf16:40x512"
    launched, real = [], k.launch
    monkeypatch.setattr(k, "launch", lambda *a, **kw: launched.append(a[9]) or real(*a, **kw))
    x, w, b = operands(40, 512, torch.bfloat16)
    with tuning.override("gemv", {key: entry}):
        assert_close(ember.ops.linear(x, w, b), float64_linear(x, w, b), torch.bfloat16)
    ember.ops.linear(x, w, b)
    assert launched == [k.entry_config(entry, 2), k.gemv_config(40, 512, 2)]
    gpu = tuning.DeviceInfo("Some GPU", (8, 0))
    assert k.one_row_config(40, 8192, torch.bfloat16, gpu) is None  # 16 KB rows: cuBLAS
    assert k.one_row_config(40, 1024, torch.bfloat16, gpu) == k.gemv_config(40, 1024, 2)
    with tuning.override("gemv", {"bf16:40x8192": entry}):
        assert k.one_row_config(40, 8192, torch.bfloat16, gpu) == k.entry_config(entry, 2)
        assert k.one_row_config(40, 8192, torch.float16, gpu) is None  # entries are per dtype
    with tuning.override("gemv", {key: dict(BLOCK_N=4, CHUNKS=2)}), pytest.raises(ValueError, match="gemv tuning entry"):
        ember.ops.linear(x, w, b)


def test_gemv_candidates_run_interpreter(interpreter):
    k = _dispatch.kernels("gemv")
    entries = k.candidates(24, 300, 2)
    assert entries[0] == {f: k.gemv_config(24, 300, 2).get(f, False) for f in k.ENTRY_FIELDS}
    assert len({tuple(sorted(e.items())) for e in entries}) == len(entries)
    x, w, b = operands(24, 300, torch.bfloat16)
    for entry in entries[:: max(1, len(entries) // 4)]:
        got = k.linear(x, w, b, config=k.entry_config(entry, 2))
        assert_close(got, float64_linear(x, w, b), torch.bfloat16)


@pytest.mark.parametrize("family", ["gemv", "linear"])
def test_shipped_tuning_entries_are_valid(family):
    """Every shipped entry of this family parses with the documented key format and is a tile the
    kernel accepts (whatever the values a re-tune writes)."""
    files = sorted(tuning.DATA_DIR.glob(f"*/{family}.json"))
    assert files, f"no shipped {family} entries"
    import json
    import re
    for path in files:
        for key, entry in json.loads(path.read_text()).items():
            if family == "gemv":
                m = re.fullmatch(r"(bf16|fp16|fp32|fp8):(\d+)x(\d+)", key)
                assert m, (path, key)
                elsize = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}[m.group(1)]
                _dispatch.kernels("gemv").entry_config(entry, elsize)
            else:
                assert re.fullmatch(r"\d+x\d+", key), (path, key)
                _dispatch.kernels("linear").entry_config(entry)


# ------------------------------------------------------------------ dispatch
def test_dispatch_gemv_only_for_one_row_and_k_contiguous_weight(interpreter, monkeypatch):
    calls = gemv_calls(monkeypatch)
    x, w, b = operands(24, 96, torch.bfloat16, lead=(2,))
    assert torch.equal(ember.ops.linear(x, w, b), F.linear(x, w, b))  # 2 rows: F.linear
    w_rows_strided = w.t().contiguous().t()  # same values, stride 24 along K
    assert torch.equal(ember.ops.linear(x[:1], w_rows_strided, b), F.linear(x[:1], w, b))
    assert calls == []
    ember.ops.linear(x[:1], w, b)
    assert calls == [w.shape]


def test_empty_products(interpreter):
    x, w, b = torch.randn(1, 0), torch.randn(5, 0), torch.randn(5)
    assert torch.equal(ember.ops.linear(x, w, b), b[None])
    assert ember.ops.linear(torch.randn(1, 8), torch.randn(0, 8)).shape == (1, 0)
    assert ember.ops.linear(torch.randn(0, 8), torch.randn(3, 8)).shape == (0, 3)


@pytest.mark.parametrize("force", [True, False])
def test_torch_compile_fullgraph_cpu(monkeypatch, force):
    force_triton_or_skip(monkeypatch, force)
    x, w, b = operands(40, 200, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ember.ops.linear(x, w, b) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), ember.ops.linear(x, w, b) * 2, atol=0, rtol=0)


# ------------------------------------------------------------------ bad input
def _bad(**kw):
    x, w, b = operands(8, 16, torch.bfloat16)
    args = dict(x=x, weight=w, bias=b)
    args.update(kw)
    return lambda: ember.ops.linear(args["x"], args["weight"], args["bias"])


@pytest.mark.parametrize("call, exc, words", [
    (_bad(x=[1.0] * 16), TypeError, "x: expected a torch.Tensor"),
    (_bad(x=torch.ones(1, 16, dtype=torch.int32)), TypeError, "x: expected dtype"),
    (_bad(x=torch.tensor(1.0, dtype=torch.bfloat16)), ValueError, "x: expected at least 1"),
    (_bad(weight=torch.randn(8, 16)), TypeError, "weight: expected dtype torch.bfloat16 (the dtype of x)"),
    (_bad(weight=torch.randn(16, dtype=torch.bfloat16)), ValueError, "weight: expected a 2-d tensor"),
    (_bad(weight=torch.randn(8, 15, dtype=torch.bfloat16)), ValueError, "weight: expected 16 columns"),
    (_bad(weight=torch.randn(8, 16).to(torch.float8_e4m3fn)), TypeError, "weight: expected dtype in"),
    (_bad(bias=torch.randn(8)), TypeError, "bias: expected dtype torch.bfloat16 (the dtype of x)"),
    (_bad(bias=torch.randn(9, dtype=torch.bfloat16)), ValueError, "bias: expected length 8"),
    (_bad(bias=torch.randn(1, 8, dtype=torch.bfloat16)), ValueError, "bias: expected a 1-d tensor"),
    (_bad(weight=torch.randn(8, 16, dtype=torch.bfloat16, device="meta")), ValueError, "weight: expected device cpu"),
    (_bad(bias=torch.randn(8, dtype=torch.bfloat16, device="meta")), ValueError, "bias: expected device cpu"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as e:
        call()
    assert words in str(e.value)


# ------------------------------------------------------------------ GPU
QWEN3_30B_A3B_SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048)]  # qkv, o, router, lm_head


@pytest.mark.gpu
@pytest.mark.parametrize("N, K", QWEN3_30B_A3B_SHAPES)
def test_gpu_qwen3_30b_a3b_shapes(cuda, N, K):
    x, w, _ = operands(N, K, torch.bfloat16, bias=False, device=cuda, lead=(1, 1))
    k = _dispatch.kernels("gemv")
    launched, real = [], k.linear
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(k, "linear", lambda *a, **kw: launched.append(1) or real(*a, **kw))
        got = ember.ops.linear(x, w)
    assert bool(launched) == (k.one_row_config(N, K, torch.bfloat16, cuda) is not None)
    assert got.shape == (1, 1, N)
    exp64 = float64_linear(x.reshape(1, K), w, None).reshape(1, 1, N)
    assert_close(got, exp64, torch.bfloat16)  # fp32 sums, one rounding to bf16
    assert_close(got, F.linear(x, w), torch.bfloat16)  # within bf16 rounding of cuBLAS


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N, K", [(37, 300), (2053, 2061), (1024, 8192)])
def test_gpu_dtypes_bias_and_strided_x(cuda, dtype, N, K):
    _, w, b = operands(N, K, dtype, device=cuda)
    x = torch.randn(1, 2 * K, device=cuda).to(dtype)[:, ::2]
    got = ember.ops.linear(x, w, b)
    assert_close(got, float64_linear(x, w, b), dtype)


@pytest.mark.gpu
def test_gpu_cuda_graph_and_compile_fullgraph(cuda):
    x, w, b = operands(5120, 2048, torch.bfloat16, device=cuda, lead=(1, 1))

    def f(x):
        return ember.ops.linear(x, w, b) * 2

    out = check_compile_and_graph(f, x)
    assert_close(out / 2, float64_linear(x.reshape(1, -1), w, b).reshape(1, 1, -1), torch.bfloat16)


# ----------------------------------------------------------------------------- few rows (batched decode)
@pytest.mark.parametrize("M,N,K", [(2, 70, 96), (8, 64, 300), (16, 130, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [(32, 1, 2), (32, 3, 2)])  # (BLOCK_K, SPLIT_K, num_stages): unsplit, split K
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_kernel_matches_float64_interpreter(interpreter, M, N, K, dtype, tile, bias):
    kl = _dispatch.kernels("linear")
    x, w, b = operands(N, K, dtype, bias=bias, lead=(M,))
    cfg = dict(BLOCK_N=64, BLOCK_K=tile[0], SPLIT_K=tile[1], num_warps=1, num_stages=tile[2])
    got = kl.few_rows_linear(x, w, b, cfg)
    assert got.shape == (M, N) and got.dtype == dtype
    assert_close(got, float64_linear(x, w, b).to(dtype), dtype)
    xs = torch.randn(M, 2 * K).to(dtype)[:, ::2]  # rows with a stride along K of 2
    assert_close(kl.few_rows_linear(xs, w, b, cfg), float64_linear(xs, w, b).to(dtype), dtype)


def test_few_rows_tuning_entries(interpreter):
    """A ``linear`` tuning entry (key "NxK") is the few-row tile for that weight shape; no entry: cuBLAS."""
    kl = _dispatch.kernels("linear")
    entry = dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=4)
    assert kl.few_rows_config(64, 32, "cpu") is None
    with tuning.override("linear", {kl.key(64, 32): entry}):
        assert kl.few_rows_config(64, 32, "cpu") == entry
        assert kl.few_rows_config(64, 64, "cpu") is None
    for bad in (dict(entry, BLOCK_K=0), {k: v for k, v in entry.items() if k != "SPLIT_K"}, dict(entry, num_warps="x")):
        with tuning.override("linear", {"64x32": bad}), pytest.raises(ValueError, match="linear tuning entry"):
            kl.few_rows_config(64, 32, "cpu")
    assert all(kl.entry_config(e) == e for e in kl.candidates(2048, 4096))


def test_few_rows_path_is_cuda_only(interpreter):
    """On CPU, 2..16 rows stay F.linear bit for bit (the CPU oracle tests against transformers), even
    with a few-row tuning entry for the shape."""
    x, w, b = operands(48, 64, torch.bfloat16, lead=(8,))
    with tuning.override("linear", {"48x64": dict(BLOCK_N=64, BLOCK_K=32, SPLIT_K=1, num_warps=1, num_stages=1)}):
        assert torch.equal(ember.ops.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096)])
@pytest.mark.parametrize("M", [2, 8, 16])
def test_gpu_few_rows_qwen3_shapes(cuda, N, K, M):
    """The few-row kernel through ember.ops.linear (tiles set by tuning entries, split and unsplit)
    against float64, eager and replayed in a CUDA graph captured under the entry."""
    x, w, b = operands(N, K, torch.bfloat16, device=cuda, lead=(M, 1))
    want = float64_linear(x.reshape(M, K), w, b).reshape(M, 1, N).to(torch.bfloat16)
    for split in (1, 2):
        entry = dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, num_warps=4, num_stages=4)
        with tuning.override("linear", {f"{N}x{K}": entry}):
            assert_close(ember.ops.linear(x, w, b).cpu(), want, torch.bfloat16)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = ember.ops.linear(x, w, b)
        g.replay()
        assert_close(y.cpu(), want, torch.bfloat16)
