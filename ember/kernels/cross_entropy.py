"""Triton kernels of the fused linear + cross-entropy (``ember.ops.linear_cross_entropy``).

Forward: ``lse_partials`` tiles (rows x vocab) with ``tl.dot`` and keeps, per row and per vocab
split, an online logsumexp (running max, running sum of exp), the target's logit and the sum of the
logits (for label smoothing), all float32. The [N, V] logits never exist; the splits are combined by
the caller (a few [S, N] vectors).

Backward, one vocab chunk at a time (the chunk's width keeps its buffer small):
``grad_logits`` recomputes the chunk's logits and writes ``g = scale_row * (softmax - target
distribution)`` (times the softcap's derivative) in the input dtype; then ``grad_W[chunk] = g^T @ x``
is one cuBLAS GEMM straight into grad_W (its K = N reduction is inside the GEMM: no atomics, no
float32 [V, H] buffer) and ``grad_x += g @ W[chunk]`` is ``mm_accumulate`` into one float32 [N, H]
accumulator (cuBLAS cannot add a bf16 product into a float32 output on every torch we support).

Tiles per kernel (``lse``, ``grad``, ``mm``) and dtype: ``ember.tuning.lookup("cross_entropy",
"<kernel>:<bf16|fp16|fp32>", device)`` (``ember tune cross_entropy`` sweeps them on a GPU), else the
rule in ``_rule_tiles``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember import tuning
from ember.kernels._common import round_to

FAMILY = "cross_entropy"
KERNELS = ("lse", "grad", "mm")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@triton.jit
def _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, rmask, cmask, H, sxn, swv, softcap,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """float32 [BM, BN] logits of rows x cols (bias added, soft-capped), and the tanh of the cap."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, H, BK):
        kk = k + tl.arange(0, BK)
        kmask = kk < H
        xt = tl.load(x_ptr + rows[:, None] * sxn + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wt = tl.load(w_ptr + cols[:, None] * swv + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
        if PREC == "ieee":  # float32 inputs, or the interpreter (it mis-multiplies bf16 / fp16 dots)
            xt, wt = xt.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    th = acc
    if SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): saturates to +-1 without overflow to NaN
        th = 1.0 - 2.0 / (tl.exp(2.0 * acc / softcap) + 1.0)
        acc = softcap * th
    return acc, th


@triton.jit
def _lse_partials_kernel(x_ptr, w_ptr, b_ptr, t_ptr, m_ptr, s_ptr, zt_ptr, zsum_ptr,
                         N, V, H, sxn, swv, softcap, num_splits,
                         HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
                         PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < N
    tgt = tl.load(t_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    n_tiles = tl.cdiv(V, BN)
    per_split = tl.cdiv(n_tiles, num_splits)
    first = split * per_split
    last = tl.minimum(first + per_split, n_tiles)
    m = tl.full((BM,), float("-inf"), tl.float32)
    s = tl.zeros((BM,), tl.float32)
    zt = tl.zeros((BM,), tl.float32)
    zs = tl.zeros((BM,), tl.float32)
    for tile in range(first, last):
        cols = (tile * BN + tl.arange(0, BN)).to(tl.int64)
        cmask = cols < V
        z, _ = _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, rmask, cmask, H, sxn, swv, softcap,
                            HAS_BIAS, SOFTCAP, PREC, BM, BN, BK)
        zm = tl.where(cmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(zm, axis=1))  # finite: every tile has a column < V
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new[:, None]), axis=1)
        m = m_new
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        if SMOOTH:
            zs += tl.sum(tl.where(cmask[None, :], z, 0.0), axis=1)
    out = split * N + rows
    tl.store(m_ptr + out, m, mask=rmask)
    tl.store(s_ptr + out, s, mask=rmask)
    tl.store(zt_ptr + out, zt, mask=rmask)
    if SMOOTH:
        tl.store(zsum_ptr + out, zs, mask=rmask)


@triton.jit
def _grad_logits_kernel(x_ptr, w_ptr, b_ptr, t_ptr, lse_ptr, scale_ptr, g_ptr,
                        N, V, H, v0, Vc, sxn, swv, sgn, softcap, on_target, uniform,
                        HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, PREC: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """g[:, c] for the chunk's columns c (vocab v0 + c): scale_row * (p - on_target*[v == t] - uniform)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < N
    local = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    cols = v0 + local
    cmask = (local < Vc) & (cols < V)
    z, th = _logits_tile(x_ptr, w_ptr, b_ptr, rows, cols, rmask, cmask, H, sxn, swv, softcap,
                         HAS_BIAS, SOFTCAP, PREC, BM, BN, BK)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=rmask, other=0.0)  # 0 on ignored rows
    tgt = tl.load(t_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    g = tl.exp(z - lse[:, None]) - uniform - tl.where(cols[None, :] == tgt[:, None], on_target, 0.0)
    g = g * scale[:, None]
    if SOFTCAP:
        g = g * (1.0 - th * th)  # d(cap * tanh(u / cap)) / du
    mask = rmask[:, None] & cmask[None, :]
    tl.store(g_ptr + rows[:, None] * sgn + local[None, :], round_to(g, g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mm_accumulate_kernel(a_ptr, b_ptr, c_ptr, M, Nn, K, sam, sbk, scm, PREC: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[M, Nn] (float32) += a[M, K] @ b[K, Nn]; unit stride in the last dim of each."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mmask = rm < M
    nmask = rn < Nn
    cptr = c_ptr + rm[:, None] * scm + rn[None, :]
    cmask = mmask[:, None] & nmask[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        kk = k + tl.arange(0, BK)
        kmask = kk < K
        a = tl.load(a_ptr + rm[:, None] * sam + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + kk[:, None] * sbk + rn[None, :], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if PREC == "ieee":
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(cptr, tl.load(cptr, mask=cmask, other=0.0) + acc, mask=cmask)


# ----------------------------------------------------------------------------- launch helpers
def tile_key(kernel: str, dtype: torch.dtype) -> str:
    """The tuning key of ``kernel``'s tiles for ``dtype`` inputs, e.g. ``"lse:bf16"``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    return f"{kernel}:{_DTYPE_NAMES[dtype]}"


def _rule_tiles(dtype: torch.dtype) -> dict:
    """Without tuning data: Hopper-sized for bf16 / fp16 (128x128 wgmma tiles, 64-deep K steps, 3
    stages: 96 KB of shared memory), halved for float32 (its ieee dot runs on the FMA units and its
    operands take twice the shared memory)."""
    if dtype == torch.float32:
        return dict(BM=64, BN=64, BK=32, num_warps=4, num_stages=2)
    return dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)


def gpu_tiles(kernel: str, dtype: torch.dtype, device) -> dict:
    """``kernel``'s tiles on a GPU (a ``torch.device`` or ``tuning.DeviceInfo``): the tuning entry, else
    the rule."""
    entry = tuning.lookup(FAMILY, tile_key(kernel, dtype), device)
    return dict(entry) if entry else _rule_tiles(dtype)


def _tiles(t: torch.Tensor, kernel: str) -> dict:
    """The launch tiles of ``kernel`` for ``t``'s dtype and device: small under the interpreter (its
    cost is per element of every tile, masked or not)."""
    if t.device.type == "cuda":
        return gpu_tiles(kernel, t.dtype, t.device)
    return dict(BM=16, BN=32, BK=32)


def _precision(t: torch.Tensor) -> str:
    """"ieee" (float32 operands and products) for float32 inputs, which tl.dot would round to tf32,
    and under the interpreter, which mis-multiplies bf16 / fp16 dots; "tf32" (the tensor cores'
    bf16 / fp16 MMA, float32 accumulation) otherwise."""
    return "ieee" if t.dtype == torch.float32 or t.device.type != "cuda" else "tf32"


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def lse_partials(x2, weight, bias, target, softcap, smooth: bool):
    """Per-split online-logsumexp state of every row: (max, sum of exp, target logit, sum of logits),
    each [S, N] float32 (sum of logits only with ``smooth``)."""
    N, H = x2.shape
    V = weight.shape[0]
    cfg = _tiles(x2, "lse")
    BM, BN = cfg["BM"], cfg["BN"]
    row_blocks, n_tiles = triton.cdiv(N, BM), triton.cdiv(V, BN)
    # enough (row block, vocab split) programs for ~16 per SM, so the last wave is a small tail
    splits = max(1, min(n_tiles, triton.cdiv(16 * _sm_count(x2.device), row_blocks)))
    splits = triton.cdiv(n_tiles, triton.cdiv(n_tiles, splits))  # no split left without a tile
    m, s, zt = (torch.empty(splits, N, dtype=torch.float32, device=x2.device) for _ in range(3))
    zs = torch.empty(splits, N, dtype=torch.float32, device=x2.device) if smooth else m
    _lse_partials_kernel[(row_blocks, splits)](
        x2, weight, bias if bias is not None else weight, target, m, s, zt, zs,
        N, V, H, x2.stride(0), weight.stride(0), float(softcap or 1.0), splits,
        HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, SMOOTH=smooth,
        PREC=_precision(x2), **cfg)
    return m, s, zt, (zs if smooth else None)


def grad_logits(x2, weight, bias, target, lse, scale, softcap, on_target: float, uniform: float,
                v0: int, g: torch.Tensor) -> None:
    """Write the [N, Vc] gradient of the logits of vocab columns v0 .. v0 + Vc into ``g``."""
    N, H = x2.shape
    V = weight.shape[0]
    Vc = g.shape[1]
    cfg = _tiles(x2, "grad")
    grid = (triton.cdiv(N, cfg["BM"]), triton.cdiv(Vc, cfg["BN"]))
    _grad_logits_kernel[grid](
        x2, weight, bias if bias is not None else weight, target, lse, scale, g,
        N, V, H, v0, Vc, x2.stride(0), weight.stride(0), g.stride(0), float(softcap or 1.0),
        float(on_target), float(uniform), HAS_BIAS=bias is not None, SOFTCAP=softcap is not None,
        PREC=_precision(x2), **cfg)


def mm_accumulate(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """``c += a @ b`` with float32 ``c``, products accumulated in float32."""
    M, K = a.shape
    Nn = b.shape[1]
    cfg = _tiles(a, "mm")
    grid = (triton.cdiv(M, cfg["BM"]), triton.cdiv(Nn, cfg["BN"]))
    _mm_accumulate_kernel[grid](a, b, c, M, Nn, K, a.stride(0), b.stride(0), c.stride(0),
                                PREC=_precision(a), **cfg)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
