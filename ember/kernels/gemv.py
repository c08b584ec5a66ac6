"""Triton GEMV: one row of activations times a K-contiguous weight, y[n] = sum_k a[k] * w[n, k].

Batch-1 decode turns every dense projection into this (M == 1), a pure weight stream: the floor is
the weight bytes / 4.15 TB/s. One kernel serves two callers:

* ``ember.ops.linear`` (bf16 / fp16 / fp32 weight [N, K], no scale): ``linear`` below.
* ``ember.ops.scaled_mm`` at M == 1 with ``b = w.t()`` (float8_e4m3fn weight with a tensor,
  per-column or 128x128-block scale, and optionally an fp8 activation scale): ``launch`` through
  ``ember.kernels.fp8``.

The weight is addressed as rows ``b_ptr + n * stride_bn + k`` (unit stride along K); the activation
as ``a_ptr + k * stride_ak`` (any stride). One launch, no split-K, no shared memory in the loop.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ember.kernels._common import parse_ints, pdl_options, pdl_start, residual_sum, round_to

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
def _accumulate(acc, ss, w, a_ptr, ks, k0, K, stride_ak, sa_ptr, sb_ptr, stride_sak, stride_sbk, stride_sbn,
                offs_c, offs_n, mask_n, res_ptr, lnw_ptr, new_res_ptr, store_res, shape: tl.constexpr,
                A_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr, SB_N_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                STEP_REDUCE: tl.constexpr, ADD_NORM: tl.constexpr):
    """One K step: the activation slice in the weight tile's shape, products into ``acc``.

    ADD_NORM: the activation is h * lnw with h = a + residual (rounded as add_rmsnorm stores it);
    the step's sum of h^2 goes into ``ss`` (the caller scales the result by 1 / rms at the end), and
    the program with ``store_res`` writes h, the new residual stream."""
    if ADD_NORM:
        kb = tl.broadcast_to(ks, shape)
        h = residual_sum(a_ptr, res_ptr, kb, K, stride_ak)
        if store_res:
            tl.store(new_res_ptr + kb, h.to(new_res_ptr.dtype.element_ty), mask=kb < K)
        ss += tl.sum(h * h, axis=2)
        a = h * tl.load(lnw_ptr + kb, mask=kb < K, other=0.0).to(tl.float32)
    else:
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
    return acc, ss


@triton.jit
def gemv_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, N, K,
                stride_ak, stride_bn, stride_on, stride_sak, stride_sbk, stride_sbn,
                A_SCALED: tl.constexpr, B_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr,
                SB_N_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                CHUNKS: tl.constexpr, KW: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                STEP_REDUCE: tl.constexpr, res_ptr, lnw_ptr, new_res_ptr, eps,
                ADD_NORM: tl.constexpr, PDL: tl.constexpr = False):
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
    ADD_NORM (unscaled weights): the activation is ``add_rmsnorm(a, residual, lnw, eps)``, the
    decoder's pre-attention norm folded into the qkv projection. Since the norm is one scale per row,
    the program multiplies by h * lnw (h = a + residual) as it streams K, sums h^2 on the way, and
    scales its outputs by 1 / rms at the end: no pass over the row before the first product (a first
    version computed the norm up front in every program and made the H200 decode step 0.36 ms
    slower). Every program sums the same values in the same layout, so all use the same 1 / rms; the
    normalised row is not rounded to the I/O dtype before the product (one rounding fewer than the
    two-op path). Program 0 stores the new residual (a + residual) for the next layer.
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
    ss = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)  # ADD_NORM: sum of h^2 so far
    # The first step's weight tile is loaded before waiting for the previous kernel (no kernel writes
    # weights): under dependent launch it streams in while that kernel finishes.
    w = _weight_tile(rows, offs_k, mask_rows, K, EVEN_N, EVEN_K)
    pdl_start(PDL)
    acc, ss = _accumulate(acc, ss, w, a_ptr, offs_k, 0, K, stride_ak, sa_ptr, sb_ptr, stride_sak, stride_sbk,
                          stride_sbn, offs_c, offs_n, mask_n, res_ptr, lnw_ptr, new_res_ptr, pid == 0, shape,
                          A_SCALED, K_BLOCKED, SB_N_GROUP, EVEN_K, STEP_REDUCE, ADD_NORM)
    for k0 in range(CHUNKS * KW, K, CHUNKS * KW):
        ks = k0 + offs_k
        w = _weight_tile(rows, ks, mask_rows, K, EVEN_N, EVEN_K)
        acc, ss = _accumulate(acc, ss, w, a_ptr, ks, k0, K, stride_ak, sa_ptr, sb_ptr, stride_sak, stride_sbk,
                              stride_sbn, offs_c, offs_n, mask_n, res_ptr, lnw_ptr, new_res_ptr, pid == 0, shape,
                              A_SCALED, K_BLOCKED, SB_N_GROUP, EVEN_K, STEP_REDUCE, ADD_NORM)
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
    if ADD_NORM:
        out = out * (1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps))
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n * stride_on, round_to(out, out_ptr.dtype.element_ty), mask=mask_n)


# ----------------------------------------------------------------------------- configuration
# bf16/fp16 weights, shapes swept on the H200 (ember.bench.linear.sweep, graph-timed): N x K ->
# (BLOCK_N, CHUNKS, num_warps, STEP_REDUCE). 2048 x 4096 (Qwen3-30B-A3B o_proj): 7.17 us; F.linear in
# the same sweep was not among the 5 best (> 7.84 us) and measured 9.66 us in the linear suite, the
# byte rule's (8, 1, 4) 16.0 us. 5120 x 2048 (qkv): 7.12 us vs F.linear 8.20 (linear suite). The
# decode step with both (bench/step_variants.py, same weights): 2.924 ms vs 3.080 ms.
# Re-swept with per-step reduction (bench/results/h200/gemv_step_reduce_sweep.json, one run):
# o_proj (8, 16, 8, SR) 6.89 us vs (8, 4, 4) 6.98; qkv (4, 4, 4, SR) 6.68 vs (16, 2, 8) 6.80;
# lm_head 151936 x 2048 (16, 8, 8, SR) 138.2 us, the byte rule's (8, 2, 4) not among the 8 best
# (> 139.0). Only 1-2%: 16 chunks in flight did not lift o_proj towards its 4.04 us floor, so the
# missing time is per-launch latency, not too few bytes in flight.
# Re-swept inside the decode step (bench/step_variants.py --variants bench/sweeps/step_tiles_b1.json,
# bench/results/h200/step_tiles_b1.json; step ms at a 400 cache, default 2.389): qkv (2, 4, 1, SR) 2.348,
# best of 12 (one warp, two rows per program: 2560 programs); o_proj and lm_head: no tile beat the
# ones above by more than the 0.005 ms run-to-run spread.
MEASURED_2BYTE = {(2048, 4096): (8, 16, 8, True), (5120, 2048): (2, 4, 1, True),
                  (151936, 2048): (16, 8, 8, True)}
# fp8 row-scaled weights (bf16 activations), swept the same way (bench/sweeps/step_tiles_fp8_b1.json,
# bench/results/h200/step_tiles_fp8_b1.json; Qwen3-30B-A3B fp8 step at a 400 cache, rule default 2.118 ms):
# qkv (2, 2, 1, SR) 2.080, o_proj (2, 8, 2, SR) 2.034 (the rule: (8, 2, 4), no step reduce).
MEASURED_1BYTE = {(2048, 4096): (2, 8, 2, True), (5120, 2048): (2, 2, 1, True)}
# Unscaled weights on CUDA: the GEMV takes rows of at most this many bytes with the byte rule below,
# and the swept shapes above. H200, bf16, M=1, graph-timed against F.linear in the same run (ember bench
# linear): K=2048 wins (N=5120: 7.11 vs 8.20 us; N=151936: 136.6 vs 143.9 us), K=4096 and 8192 lose
# with the rule (N=2048: 16.0 vs 9.7 us; N=8192: 39.4 vs 34.0 us).
MAX_ROW_BYTES_UNSWEPT = 4096


def beats_cublas(N: int, K: int, elsize: int) -> bool:
    """Whether this GEMV measured (or is expected by its measured neighbours) faster than cuBLAS for an
    unscaled N x K weight at M=1 on CUDA: the ops route every other shape to F.linear."""
    return K * elsize <= MAX_ROW_BYTES_UNSWEPT or (elsize == 2 and (N, K) in MEASURED_2BYTE)


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
    measured = {2: MEASURED_2BYTE, 1: MEASURED_1BYTE}.get(elsize, {})
    if not k_blocked and (N, K) in measured:
        bn, chunks, warps, step_reduce = measured[(N, K)]
        return dict(GEMV=True, BLOCK_N=bn, CHUNKS=chunks, KW=ROW_BYTES // elsize, num_warps=warps,
                    STEP_REDUCE=step_reduce)
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
    return dict(GEMV=True, BLOCK_N=block_n, CHUNKS=chunks, KW=kw, num_warps=warps)


# ----------------------------------------------------------------------------- launchers
def env_config(N: int, K: int, elsize: int = 2) -> dict | None:
    """The tile ``EMBER_GEMV_TILES`` sets for an N x K weight of ``elsize``-byte elements (decode-step
    sweeps; read per call): ``"NxK=BLOCK_N,CHUNKS,num_warps,STEP_REDUCE;..."``, e.g.
    ``"2048x4096=8,16,8,1"``; KW is 512 bytes of K (256 bf16 or 512 fp8 elements)."""
    env = os.environ.get("EMBER_GEMV_TILES", "")
    for item in filter(None, env.split(";")):
        shape, _, tile = item.partition("=")
        var = f"EMBER_GEMV_TILES entry {item!r}"
        n_k = parse_ints(var, shape.replace("x", ",", 1), "N,K")
        bn, chunks, warps, step_reduce = parse_ints(var, tile, "BLOCK_N,CHUNKS,num_warps,STEP_REDUCE", minimum=0)
        if min(bn, chunks, warps) < 1:
            raise ValueError(f"{var}: expected BLOCK_N, CHUNKS and num_warps >= 1")
        if n_k == (N, K):
            return dict(GEMV=True, BLOCK_N=bn, CHUNKS=chunks, KW=ROW_BYTES // elsize, num_warps=warps,
                        STEP_REDUCE=bool(step_reduce))
    return None


def launch(a: torch.Tensor, stride_ak: int, b: torch.Tensor, stride_bn: int, N: int, K: int,
           out: torch.Tensor, stride_on: int, bias: torch.Tensor | None, cfg: dict, *,
           scale_a: torch.Tensor | None = None, stride_sak: int = 0,
           scale_b: torch.Tensor | None = None, stride_sbk: int = 0, stride_sbn: int = 0,
           sb_n_group: int = 1, k_blocked: bool = False, add_norm: tuple | None = None) -> torch.Tensor:
    """out[n * stride_on] = sum_k a[k * stride_ak] * b[n * stride_bn + k] (* scales) (+ bias[n]).

    ``b`` has unit stride along K; N, K >= 1. Scale strides: 0 broadcasts (see ember.kernels.fp8).
    ``add_norm = (residual, norm_weight, eps, new_residual_out)`` (contiguous K-vectors, unscaled b
    only): multiply by ``add_rmsnorm(a, residual, norm_weight, eps)`` instead of a, and write its new
    residual.
    """
    if add_norm is not None and (scale_a is not None or scale_b is not None):
        raise ValueError("add_norm: only unscaled weights take the folded norm")
    res, lnw, eps, new_res = add_norm if add_norm is not None else (out, out, 0.0, out)  # unused pointers
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
        STEP_REDUCE=cfg.get("STEP_REDUCE", False), res_ptr=res, lnw_ptr=lnw, new_res_ptr=new_res, eps=float(eps),
        ADD_NORM=add_norm is not None, num_warps=cfg["num_warps"], num_stages=1, **pdl_options(out.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           config: dict | None = None, out: torch.Tensor | None = None, add_norm: tuple | None = None) -> torch.Tensor:
    """x @ weight.T + bias for one row of x (validated by ``ember.ops.linear``).

    ``x`` [..., K] holds a single row (every leading dim is 1, any stride along K); ``weight`` [N, K]
    has unit stride along K. ``config`` overrides the tile choice (tests, tuning sweeps); ``out`` is
    a buffer of x.shape[:-1] + (N,) with unit stride along N. ``add_norm``: as in :func:`launch`.
    """
    N, K = weight.shape
    if out is None:
        out = torch.empty(x.shape[:-1] + (N,), dtype=x.dtype, device=x.device)
    cfg = config or (weight.element_size() == 2 and env_config(N, K)) or gemv_config(N, K, weight.element_size())
    return launch(x, x.stride(-1), weight, weight.stride(0), N, K, out, 1, bias, cfg, add_norm=add_norm)
