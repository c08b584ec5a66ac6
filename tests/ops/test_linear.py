import math

import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _dispatch
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
GEMV_CONFIGS = [dict(GEMV=True, BLOCK_N=4, CHUNKS=2, KW=256, num_warps=4),
                dict(GEMV=True, BLOCK_N=16, CHUNKS=4, KW=64, num_warps=2),
                dict(GEMV=True, BLOCK_N=8, CHUNKS=1, KW=128, num_warps=4),
                dict(GEMV=True, BLOCK_N=8, CHUNKS=4, KW=64, num_warps=4, STEP_REDUCE=True)]


@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("N, K", [(16, 1024), (37, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_configs_write_every_output_interpreter(interpreter, config, N, K, dtype):
    x, w, b = operands(N, K, dtype)
    out = poisoned((1, N), dtype, "cpu")
    got = _dispatch.kernels("gemv").linear(x, w, b, config=config, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, float64_linear(x, w, b), dtype)


def test_gemv_config_rule():
    cfg = _dispatch.kernels("gemv").gemv_config
    # the measured fp8 picks (ember.kernels.gemv docstring): (BLOCK_N, CHUNKS, KW, num_warps)
    pick = {shape: tuple(cfg(*shape, 1)[k] for k in ("BLOCK_N", "CHUNKS", "KW", "num_warps"))
            for shape in [(8192, 8192), (4096, 4096), (1536, 2048), (2048, 768)]}
    assert pick == {(8192, 8192): (8, 1, 512, 4), (4096, 4096): (8, 2, 512, 4),
                    (1536, 2048): (4, 4, 512, 4), (2048, 768): (8, 2, 512, 4)}
    # the same rule in bytes: 512 bytes of K per warp-row, one chunk from 8 KiB rows
    assert cfg(5120, 1024, 2)["KW"] == 256 and cfg(5120, 1024, 2)["CHUNKS"] == 2
    assert cfg(2048, 8192, 2)["CHUNKS"] == 1 and cfg(2048, 4096, 4)["KW"] == 128
    # swept bf16 shapes take their measured tiles (ember.kernels.gemv.MEASURED_2BYTE)
    assert cfg(2048, 4096, 2) == dict(GEMV=True, BLOCK_N=8, CHUNKS=16, KW=256, num_warps=8, STEP_REDUCE=True)
    assert cfg(5120, 2048, 2) == dict(GEMV=True, BLOCK_N=2, CHUNKS=4, KW=256, num_warps=1, STEP_REDUCE=True)
    assert cfg(151936, 2048, 2)["STEP_REDUCE"] and cfg(151936, 2048, 2)["CHUNKS"] == 8
    # short rows: several rows per warp, so BLOCK_N grows to keep every thread loading
    assert cfg(100, 7, 2) == dict(GEMV=True, BLOCK_N=128, CHUNKS=1, KW=8, num_warps=4)


def test_gemv_takes_only_shapes_that_beat_cublas():
    k = _dispatch.kernels("gemv")
    assert k.beats_cublas(5120, 2048, 2) and k.beats_cublas(151936, 2048, 2)  # 4 KB rows: measured wins
    assert k.beats_cublas(2048, 4096, 2)  # 8 KB rows, but swept with its own tiles
    assert not k.beats_cublas(8192, 8192, 2) and not k.beats_cublas(4096, 4096, 2)  # measured / unswept losses
    assert not k.beats_cublas(2048, 4096, 4)  # fp32 rows of 16 KB


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


@pytest.mark.parametrize("force", [True, False])
def test_add_rmsnorm_linear_compile_fullgraph_cpu(monkeypatch, force):
    """The registered op and its fake under torch.compile: the folded GEMV (forced Triton) or the two ops."""
    force_triton_or_skip(monkeypatch, force)
    x, w, b = operands(40, 200, torch.float32)
    res, lnw = torch.randn(1, 200), 1 + 0.1 * torch.randn(200)

    def f(x):
        y, new_res = ember.ops.add_rmsnorm_linear(x, res, lnw, w, b)
        return y * 2, new_res

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    for a, e in zip(got, f(x)):
        torch.testing.assert_close(a, e, atol=0, rtol=0)


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
    assert linear_mod._gemv_shape(x, w) and linear_mod._gemv_beats_cublas(x, w)
    got = ember.ops.linear(x, w)
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


# ------------------------------------------------------------------ pre-attention add_rmsnorm folded into the GEMV
def float64_add_rmsnorm_linear(x, res, lnw, w, b, eps=1e-6):
    """float64 spec: the residual sum rounded once to x.dtype, the norm rounded once (as add_rmsnorm
    stores it, what the unfused linear reads), then the product in float64."""
    h = (x.double() + res.double()).to(x.dtype)
    hd = h.double()
    normed = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * lnw.double()).to(x.dtype)
    return float64_linear(normed, w, b), h


@pytest.mark.parametrize("config", GEMV_CONFIGS)
@pytest.mark.parametrize("N, K", [(16, 1024), (37, 520)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_add_norm_configs_interpreter(interpreter, config, N, K, dtype):
    x, w, b = operands(N, K, dtype)
    res = torch.randn(1, K).to(dtype)
    lnw = (1 + 0.1 * torch.randn(K)).to(dtype)
    new_res = poisoned((K,), dtype, "cpu")
    out = poisoned((1, N), dtype, "cpu")
    _dispatch.kernels("gemv").linear(x, w, b, config=config, out=out, add_norm=(res.view(K), lnw, 1e-6, new_res))
    y64, h = float64_add_rmsnorm_linear(x, res, lnw, w, b)
    assert torch.equal(new_res, h.view(K))
    # the kernel normalises in fp32 with its own reduction order: a normalised element may round to
    # the neighbouring value, so compare with one extra rounding's worth of slack
    assert_close(out, y64, dtype)


def test_add_rmsnorm_linear_public_op_paths(interpreter, monkeypatch):
    x, w, b = operands(48, 96, torch.float32)
    res, lnw = torch.randn(1, 96), 1 + 0.1 * torch.randn(96)
    y, new_res = ember.ops.add_rmsnorm_linear(x, res, lnw, w, b)  # the folded GEMV (forced Triton)
    y_ref, res_ref = linear_mod.add_rmsnorm_linear_reference(x, res, lnw, w, b)
    assert torch.equal(new_res, res_ref) and torch.allclose(y, y_ref, atol=1e-5)
    x2 = torch.randn(3, 96)  # several rows: the two ops
    y2, r2 = ember.ops.add_rmsnorm_linear(x2, torch.randn(3, 96), lnw, w)
    assert y2.shape == (3, 48) and r2.shape == (3, 96)
    monkeypatch.setenv("EMBER_FORCE_TRITON", "0")  # the reference path: the two ops, exactly
    y3, r3 = ember.ops.add_rmsnorm_linear(x, res, lnw, w, b)
    normed, r_exp = ember.ops.add_rmsnorm(x, res, lnw)
    assert torch.equal(r3, r_exp) and torch.equal(y3, ember.ops.linear(normed, w, b))


@pytest.mark.parametrize("make,match", [
    (lambda: (torch.randn(1, 64), torch.randn(1, 32), torch.ones(64), torch.randn(8, 64)), "residual"),
    (lambda: (torch.randn(1, 64), torch.randn(1, 64), torch.ones(32), torch.randn(8, 64)), "weight"),
    (lambda: (torch.randn(1, 64), torch.randn(1, 64), torch.ones(64), torch.randn(8, 32)), "weight"),
])
def test_add_rmsnorm_linear_bad_input(make, match):
    x, res, lnw, w = make()
    with pytest.raises((ValueError, TypeError), match=match):
        ember.ops.add_rmsnorm_linear(x, res, lnw, w)


@pytest.mark.gpu
@pytest.mark.parametrize("N, K", [(5120, 2048), (4096, 4096), (1000, 300)])
def test_gpu_add_rmsnorm_linear_vs_two_ops(cuda, N, K):
    x, w, _ = operands(N, K, torch.bfloat16, bias=False, device=cuda)
    res = torch.randn(1, K, device=cuda).bfloat16()
    lnw = (1 + 0.1 * torch.randn(K, device=cuda)).bfloat16()
    y, new_res = ember.ops.add_rmsnorm_linear(x, res, lnw, w)
    y64, h = float64_add_rmsnorm_linear(x, res, lnw, w, None)
    assert torch.equal(new_res.cpu(), h.cpu())
    assert_close(y, y64, torch.bfloat16)
    out = check_compile_and_graph(lambda t: ember.ops.add_rmsnorm_linear(t, res, lnw, w)[0], x)
    assert out.shape == (1, N)


def test_gemv_tiles_env_override_interpreter(interpreter, monkeypatch):
    """EMBER_GEMV_TILES (decode-step sweeps) sets the tile of one weight shape; results stay right;
    a malformed entry names the variable."""
    K_mod = _dispatch.kernels("gemv")
    monkeypatch.setenv("EMBER_GEMV_TILES", "40x512=4,2,2,0;8x8=1,1,1,1")
    cfg = K_mod.env_config(40, 512)
    assert (cfg["BLOCK_N"], cfg["CHUNKS"], cfg["num_warps"], cfg["STEP_REDUCE"]) == (4, 2, 2, False)
    assert K_mod.env_config(41, 512) is None
    x, w, b = operands(40, 512, torch.bfloat16)
    assert_close(ember.ops.linear(x, w, b), float64_linear(x, w, b), torch.bfloat16)
    monkeypatch.setenv("EMBER_GEMV_TILES", "40x512=4,2")
    with pytest.raises(ValueError, match="EMBER_GEMV_TILES"):
        ember.ops.linear(x, w, b)


# ----------------------------------------------------------------------------- few rows (batched decode)
@pytest.mark.parametrize("M,N,K", [(2, 70, 96), (8, 64, 300), (16, 130, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [(32, 1, 2), (32, 3, 2)])  # (BLOCK_K, SPLIT_K, num_stages): unsplit, split K
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_kernel_matches_float64_interpreter(interpreter, M, N, K, dtype, tile, bias):
    from ember.kernels import fp8 as kf
    x, w, b = operands(N, K, dtype, bias=bias, lead=(M,))
    cfg = dict(BLOCK_N=64, BLOCK_K=tile[0], SPLIT_K=tile[1], num_warps=1, num_stages=tile[2])
    got = kf.few_rows_linear(x, w, b, cfg)
    assert got.shape == (M, N) and got.dtype == dtype
    assert_close(got, float64_linear(x, w, b).to(dtype), dtype)
    xs = torch.randn(M, 2 * K).to(dtype)[:, ::2]  # rows with a stride along K of 2
    assert_close(kf.few_rows_linear(xs, w, b, cfg), float64_linear(xs, w, b).to(dtype), dtype)


def test_few_rows_config_table_and_env(monkeypatch):
    from ember.kernels import fp8 as kf
    monkeypatch.delenv("EMBER_LINEAR_FEW_ROWS_TILE", raising=False)
    monkeypatch.setattr(kf, "FEW_ROWS_MEASURED", {(64, 32): (128, 2, 4)})
    assert kf.few_rows_config(64, 32) == dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=4)
    assert kf.few_rows_config(64, 64) is None  # not measured: cuBLAS
    monkeypatch.setenv("EMBER_LINEAR_FEW_ROWS_TILE", "64x64=256,1,3")  # replaces the table
    assert kf.few_rows_config(64, 64)["BLOCK_K"] == 256 and kf.few_rows_config(64, 32) is None
    monkeypatch.setenv("EMBER_LINEAR_FEW_ROWS", "0")
    assert kf.few_rows_config(64, 64) is None
    monkeypatch.delenv("EMBER_LINEAR_FEW_ROWS")
    for bad in ("64x64=256,1", "64=256,1,3", "axb=1,1,1", "64x64=0,1,1"):
        monkeypatch.setenv("EMBER_LINEAR_FEW_ROWS_TILE", bad)
        with pytest.raises(ValueError, match="EMBER_LINEAR_FEW_ROWS_TILE"):
            kf.few_rows_config(64, 64)


def test_few_rows_path_is_cuda_only():
    """On CPU, 2..16 rows stay F.linear bit for bit (the CPU oracle tests against transformers)."""
    x, w, b = operands(48, 64, torch.bfloat16, lead=(8,))
    assert linear_mod._few_rows_config(x, w) is None
    assert torch.equal(ember.ops.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096)])
@pytest.mark.parametrize("M", [2, 8, 16])
def test_gpu_few_rows_qwen3_shapes(cuda, monkeypatch, N, K, M):
    """The few-row kernel through ember.ops.linear (tiles forced, split and unsplit) against float64,
    eager and replayed in a CUDA graph."""
    x, w, b = operands(N, K, torch.bfloat16, device=cuda, lead=(M, 1))
    want = float64_linear(x.reshape(M, K), w, b).reshape(M, 1, N).to(torch.bfloat16)
    for tile in ("128,1,4", "128,2,4"):
        monkeypatch.setenv("EMBER_LINEAR_FEW_ROWS_TILE", f"{N}x{K}={tile}")
        assert_close(ember.ops.linear(x, w, b).cpu(), want, torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = ember.ops.linear(x, w, b)
        g.replay()
        assert_close(y.cpu(), want, torch.bfloat16)
