"""Triton GEMV: one row of activations times a K-contiguous weight, y[n] = sum_k a[k] * w[n, k].

Batch-1 decode turns every dense projection into this (M == 1), a pure weight stream: the floor is
the weight bytes / 4.15 TB/s. One kernel serves two callers:

* ``ember.ops.linear`` (bf16 / fp16 / fp32 weight [N, K], no scale): ``linear`` below.
* ``ember.ops.scaled_mm`` at M == 1 with ``b = w.t()`` (float8_e4m3fn weight with a tensor,
  per-column or 128x128-block scale, and optionally an fp8 activation scale): ``launch`` through
  ``ember.kernels.fp8``.

The weight is addressed as rows ``b_ptr + n * stride_bn + k`` (unit stride along K); the activation
as ``a_ptr + k * stride_ak`` (any stride). One launch, no split-K, no shared memory in the loop.

Tiles (``ember.tuning`` family ``"gemv"``): key ``"<bf16|fp16|fp32|fp8>:<N>x<K>"``, the weight's dtype
and shape (``key``), e.g. ``"bf16:2048x4096"``; entry ``{"BLOCK_N", "CHUNKS", "num_warps",
"STEP_REDUCE"}`` (KW is always 512 bytes of K per warp-row). 128-block-scaled fp8 weights (KW = 128)
read no entry. Without an entry the kernel's rule applies (``gemv_config``). For an unscaled weight an
entry also routes the shape to the GEMV where rows are too long for the rule to beat cuBLAS
(``one_row_config``). The tuner lists tiles with ``candidates(N, K, elsize)`` and times one with
``linear(x, w, b, config=entry_config(entry, elsize))`` (or ``tuning.override``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember import tuning
from ember.kernels._common import pdl_options, pdl_start, round_to

SCALE_BLOCK = 128  # fp8 block scales: 128x128 weight blocks, 1x128 activation blocks
ROW_BYTES = 512  # K bytes one warp loads per row and step: 32 threads x 16-byte vectors


@triton.jit
def _weight_tile(rows, ks, mask_rows, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_N and EVEN_K:
        w = tl.load(rows + ks)
    else:
        w = tl.load(rows + ks, mask=mask_rows & ((ks < K) | EVEN_K), other=0.0)
    return w


@triton.jit
def _accumulate(acc, w, a_ptr, ks, k0, K, stride_ak, sa_ptr, sb_ptr, stride_sak, stride_sbk, stride_sbn,
                offs_c, offs_n, mask_n, shape: tl.constexpr, A_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr,
                SB_N_GROUP: tl.constexpr, EVEN_K: tl.constexpr, STEP_REDUCE: tl.constexpr):
    """One K step: the activation slice in the weight tile's shape, products into ``acc``."""
    a_ptrs = tl.broadcast_to(a_ptr + ks * stride_ak, shape)
    if EVEN_K:
        a = tl.load(a_ptrs)
    else:
        a = tl.load(a_ptrs, mask=tl.broadcast_to(ks < K, shape), other=0.0)
    prod = w.to(tl.float32) * a.to(tl.float32)
    if K_BLOCKED:  # KW == 128 and k0 % 128 == 0: chunk c is scale block k0 // 128 + c
        kb = k0 // 128 + offs_c
        mask_kb = kb * 128 < K
        s = tl.load(sb_ptr + kb[None, :] * stride_sbk + (offs_n // SB_N_GROUP)[:, None] * stride_sbn,
                    mask=mask_n[:, None] & mask_kb[None, :], other=0.0)
        if A_SCALED:
            s = s * tl.load(sa_ptr + kb * stride_sak, mask=mask_kb, other=0.0)[None, :]
        acc += tl.sum(prod, axis=2) * s
    elif STEP_REDUCE:
        acc += tl.sum(prod, axis=2)
    else:
        acc += prod
    return acc


@triton.jit
def gemv_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, N, K,
                stride_ak, stride_bn, stride_on, stride_sak, stride_sbk, stride_sbn,
                A_SCALED: tl.constexpr, B_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr,
                SB_N_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                CHUNKS: tl.constexpr, KW: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                STEP_REDUCE: tl.constexpr, PDL: tl.constexpr = False):
    """One program owns BLOCK_N outputs and all of K.

    A step reads a [BLOCK_N, CHUNKS, KW] tile, k = k0 + chunk * KW + j, K fastest: each thread loads
    16 contiguous weight bytes per vector (KW = 512 bytes / element size), one warp per row, and
    each thread keeps one row and CHUNKS vectors (so its `a` values are not reloaded per row). `a`
    is loaded with the weight tile's shape so that Triton gives both the same layout (no
    shared-memory move in the loop). Products accumulate elementwise in fp32 and are reduced over K
    once, after the loop; with 128x128 block scales (fp8, KW == 128) each chunk is one scale block,
    reduced per step inside a warp. B_SCALED=False (bf16/fp16/fp32 weights) loads no scale at all.
    EVEN_N / EVEN_K drop the masks (and the zero fill of masked lanes) when the tiles divide N / K.
    STEP_REDUCE reduces each step's products over KW at once (an accumulator of [BLOCK_N, CHUNKS]
    instead of [BLOCK_N, CHUNKS, KW]), so many chunks (many loads in flight) fit in registers.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = (offs_n < N) | EVEN_N
    # rows before chunks: Triton orders ties in contiguity by dimension, so warps go to rows first
    rows = (b_ptr + offs_n.to(tl.int64) * stride_bn)[:, None, None]  # [BN, 1, 1]: each weight row
    mask_rows = mask_n[:, None, None]
    offs_c = tl.arange(0, CHUNKS)
    offs_k = offs_c[None, :, None] * KW + tl.arange(0, KW)[None, None, :]  # [1, C, KW]
    shape: tl.constexpr = (BLOCK_N, CHUNKS, KW)
    if K_BLOCKED or STEP_REDUCE:
        acc = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, CHUNKS, KW], dtype=tl.float32)
    # The first step's weight tile is loaded before waiting for the previous kernel (no kernel writes
    # weights): under dependent launch it streams in while that kernel finishes.
    w = _weight_tile(rows, offs_k, mask_rows, K, EVEN_N, EVEN_K)
    pdl_start(PDL)
    acc = _accumulate(acc, w, a_ptr, offs_k, 0, K, stride_ak, sa_ptr, sb_ptr, stride_sak, stride_sbk, stride_sbn,
                      offs_c, offs_n, mask_n, shape, A_SCALED, K_BLOCKED, SB_N_GROUP, EVEN_K, STEP_REDUCE)
    for k0 in range(CHUNKS * KW, K, CHUNKS * KW):
        ks = k0 + offs_k
        w = _weight_tile(rows, ks, mask_rows, K, EVEN_N, EVEN_K)
        acc = _accumulate(acc, w, a_ptr, ks, k0, K, stride_ak, sa_ptr, sb_ptr, stride_sak, stride_sbk, stride_sbn,
                          offs_c, offs_n, mask_n, shape, A_SCALED, K_BLOCKED, SB_N_GROUP, EVEN_K, STEP_REDUCE)
    if K_BLOCKED:
        out = tl.sum(acc, axis=1)
    else:
        if STEP_REDUCE:
            out = tl.sum(acc, axis=1)
        else:
            out = tl.sum(tl.sum(acc, axis=2), axis=1)
        if B_SCALED:
            # per-column (or tensor) weight scale and the activation scale: once, after the K reduction
            out = out * tl.load(sb_ptr + offs_n * stride_sbn, mask=mask_n, other=0.0)
            if A_SCALED:
                out = out * tl.load(sa_ptr)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n * stride_on, round_to(out, out_ptr.dtype.element_ty), mask=mask_n)


# ----------------------------------------------------------------------------- configuration
FAMILY = "gemv"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}
ENTRY_FIELDS = ("BLOCK_N", "CHUNKS", "num_warps", "STEP_REDUCE")
# The H200 entries (ember/tuning/data/sm_90-nvidia-h200/gemv.json) were swept inside the decode step
# (bench/results/h200/step_tiles_b1.json, step_tiles_fp8_b1.json, gemv_step_reduce_sweep.json): bf16
# o_proj 2048 x 4096 6.89 us against F.linear's 9.66 and the rule's 16.0; qkv 5120 x 2048 step 2.348 ms
# against the rule's 2.389; fp8 qkv / o_proj step 2.080 / 2.034 ms against the rule's 2.118.
# Unscaled weights on CUDA: the GEMV takes rows of at most this many bytes with the rule, and the shapes
# that have an entry (the entry is the tile that beat cuBLAS there). H200, bf16, M=1, graph-timed against
# F.linear in the same run (ember bench linear): K=2048 wins (N=5120: 7.11 vs 8.20 us; N=151936: 136.6
# vs 143.9 us), K=4096 and 8192 lose with the rule (N=2048: 16.0 vs 9.7 us; N=8192: 39.4 vs 34.0 us).
MAX_ROW_BYTES_UNSWEPT = 4096


def key(dtype: torch.dtype, N: int, K: int) -> str:
    """The tuning key of an N x K weight of ``dtype``, e.g. ``"bf16:2048x4096"``."""
    return f"{DTYPE_NAMES[dtype]}:{N}x{K}"


def entry_config(entry: dict, elsize: int) -> dict:
    """The launch config of a tuning entry (``ENTRY_FIELDS``); KW is 512 bytes of K per warp-row."""
    missing = [f for f in ENTRY_FIELDS if f not in entry]
    if missing or min(int(entry["BLOCK_N"]), int(entry["CHUNKS"]), int(entry["num_warps"])) < 1:
        raise ValueError(f"gemv tuning entry {entry!r}: expected {', '.join(ENTRY_FIELDS)} "
                         "(BLOCK_N, CHUNKS, num_warps >= 1)")
    return dict(BLOCK_N=int(entry["BLOCK_N"]), CHUNKS=int(entry["CHUNKS"]), KW=ROW_BYTES // elsize,
                num_warps=int(entry["num_warps"]), STEP_REDUCE=bool(entry["STEP_REDUCE"]))


def tile(N: int, K: int, dtype: torch.dtype, device, k_blocked: bool = False) -> dict:
    """The tile for an N x K weight of ``dtype`` on ``device``: its tuning entry, else :func:`gemv_config`
    (the rule). 128-block-scaled fp8 weights (``k_blocked``, KW fixed at 128) always take the rule."""
    if not k_blocked:
        entry = tuning.lookup(FAMILY, key(dtype, N, K), device)
        if entry is not None:
            return entry_config(entry, dtype.itemsize)
    return gemv_config(N, K, dtype.itemsize, k_blocked)


def one_row_config(N: int, K: int, dtype: torch.dtype, device) -> dict | None:
    """``ember.ops.linear``'s one-row tile for an unscaled N x K weight on ``device`` (a torch device or
    ``tuning.DeviceInfo``), or None where cuBLAS measured faster (a GPU, rows over
    MAX_ROW_BYTES_UNSWEPT bytes and no tuning entry). Off CUDA (the interpreter) always the GEMV."""
    entry = tuning.lookup(FAMILY, key(dtype, N, K), device)
    if entry is not None:
        return entry_config(entry, dtype.itemsize)
    on_gpu = isinstance(device, tuning.DeviceInfo) or torch.device(device).type == "cuda"
    if on_gpu and K * dtype.itemsize > MAX_ROW_BYTES_UNSWEPT:
        return None
    return gemv_config(N, K, dtype.itemsize)


def candidates(N: int, K: int, elsize: int) -> list[dict]:
    """Tuning entries worth timing for an N x K weight of ``elsize``-byte elements (``ember tune``):
    the rule's tile first, then the space the H200 sweeps covered."""
    rule = gemv_config(N, K, elsize)
    first = {f: rule.get(f, False) for f in ENTRY_FIELDS}
    out = [first]
    chunks_max = max(1, triton.next_power_of_2(-(-K // (ROW_BYTES // elsize))))
    for warps in (1, 2, 4, 8):
        for block_n in (1, 2, 4, 8, 16):
            if block_n < warps:
                continue
            for chunks in (1, 2, 4, 8, 16):
                if chunks > chunks_max:
                    continue
                for step_reduce in (True, False):
                    e = dict(BLOCK_N=block_n, CHUNKS=chunks, num_warps=warps, STEP_REDUCE=step_reduce)
                    if e != first:
                        out.append(e)
    return out


@functools.lru_cache(maxsize=1024)
def gemv_config(N: int, K: int, elsize: int, k_blocked: bool = False) -> dict:
    """Tile choice for an N x K weight of ``elsize``-byte elements: BLOCK_N, CHUNKS, KW, num_warps.

    Measured on the H200 (triton 3.6), fp8 row-scaled weight, bf16 activation, M = 1, graph-timed;
    config = (BLOCK_N, CHUNKS, KW, num_warps), time in us (floor = N*K bytes / 4.15 TB/s):

    =============  ===========================================================  =======
    N x K          configs                                                      floor
    =============  ===========================================================  =======
    8192 x 8192    (16,1,512,8) 19.49, (8,1,512,4) 19.89, (8,2,512,4) 20.97,    16.2
                   (4,4,512,4) 21.45 [the previous default]
    4096 x 4096    (8,2,512,4) 6.87, (16,2,512,8) 6.88, (4,4,512,4) 7.75         4.0
    1536 x 2048    (4,4,512,4) 3.28, (8,2,512,4) 3.58                            0.76
    2048 x 768     (8,2,512,4) 2.87, (4,2,512,4) 2.94                            0.38
    =============  ===========================================================  =======

    The rule (it picks the best or within 2% of it on each shape): 4 warps; BLOCK_N = 8 rows when
    N >= 2048 (enough programs either way), else 4 (more programs for the small-N shapes); CHUNKS =
    1 when a row is >= 8 KiB (the per-thread fp32 accumulator stays small and there are enough K
    steps to pipeline), else up to 2 (N >= 2048) or 4 chunks of the row per step. KW is 512 bytes of
    K per warp-row (fp8: 512 elements, bf16/fp16: 256, fp32: 128) so every thread loads 16 bytes per
    vector, and the rule is written in bytes: bf16/fp16/fp32 weights use it unmeasured.
    Rows shorter than 512 bytes get a narrower KW with several rows per warp (BLOCK_N grows to keep
    every thread busy). 128x128 block scales (fp8) need KW == 128: that case keeps the previous rule
    (BLOCK_N 16, up to 4 chunks), not re-measured.

    Why this kernel: the split-K kernel it replaced (fp8) reached 33% of the floor (each 256x64 K
    step moved its whole weight tile through shared memory and reduced across warps, then a second
    launch summed an fp32 workspace). Here there is one launch, no shared memory or barrier in the
    loop, 16-byte loads, no spills (sm_90 SASS, triton 3.6).
    """
    warps = 4
    if k_blocked:
        kw = SCALE_BLOCK
        chunks = min(4, triton.next_power_of_2(-(-K // kw)))
        block_n = 16
    else:
        kw = min(ROW_BYTES // elsize, max(16 // elsize, triton.next_power_of_2(K)))
        if K * elsize >= 8192:
            chunks = 1
        else:
            chunks = min(triton.next_power_of_2(-(-K // kw)), 2 if N >= 2048 else 4)
        block_n = 8 if N >= 2048 else 4
    # a warp spans 32 x 16 bytes of K, or several shorter rows
    rows_per_warp = 32 // min(32, kw * elsize // 16)
    block_n = max(block_n, warps * rows_per_warp)
    return dict(BLOCK_N=block_n, CHUNKS=chunks, KW=kw, num_warps=warps)


# ----------------------------------------------------------------------------- launchers
def launch(a: torch.Tensor, stride_ak: int, b: torch.Tensor, stride_bn: int, N: int, K: int,
           out: torch.Tensor, stride_on: int, bias: torch.Tensor | None, cfg: dict, *,
           scale_a: torch.Tensor | None = None, stride_sak: int = 0,
           scale_b: torch.Tensor | None = None, stride_sbk: int = 0, stride_sbn: int = 0,
           sb_n_group: int = 1, k_blocked: bool = False) -> torch.Tensor:
    """out[n * stride_on] = sum_k a[k * stride_ak] * b[n * stride_bn + k] (* scales) (+ bias[n]).

    ``b`` has unit stride along K; N, K >= 1. Scale strides: 0 broadcasts (see ember.kernels.fp8).
    """
    bn, chunks, kw = cfg["BLOCK_N"], cfg["CHUNKS"], cfg["KW"]
    if k_blocked and kw != SCALE_BLOCK:
        raise ValueError(f"config: 128-block scales need KW == {SCALE_BLOCK}, got {kw}")
    gemv_kernel[(triton.cdiv(N, bn),)](
        a, b, scale_a if scale_a is not None else b, scale_b if scale_b is not None else b,  # unused pointers
        bias if bias is not None else out, out, N, K,
        stride_ak, stride_bn, stride_on, stride_sak, stride_sbk, stride_sbn,
        A_SCALED=scale_a is not None, B_SCALED=scale_b is not None, K_BLOCKED=k_blocked,
        SB_N_GROUP=sb_n_group, HAS_BIAS=bias is not None,
        BLOCK_N=bn, CHUNKS=chunks, KW=kw, EVEN_N=N % bn == 0, EVEN_K=K % (chunks * kw) == 0,
        STEP_REDUCE=cfg.get("STEP_REDUCE", False), num_warps=cfg["num_warps"], num_stages=1,
        **pdl_options(out.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias for one row of x (validated by ``ember.ops.linear``).

    ``x`` [..., K] holds a single row (every leading dim is 1, any stride along K); ``weight`` [N, K]
    has unit stride along K. ``config``: the tile (:func:`one_row_config`, or
    ``entry_config(entry, elsize)`` of an explicit tuning entry), else :func:`tile`'s; ``out`` is a
    buffer of x.shape[:-1] + (N,) with unit stride along N.
    """
    N, K = weight.shape
    if out is None:
        out = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype, device=x.device)
    cfg = config or tile(N, K, weight.dtype, weight.device)
    return launch(x, x.stride(-1), weight, weight.stride(0), N, K, out, 1, bias, cfg)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
