"""T == 1 expert GEMVs, v1 (the GPU's choice for 2-byte weights): ``_gate_up_gemv_kernel`` (SiLU*up
fused), then ``_down_gemv_kernel`` (one program per block of output rows loops over the token's k
experts and applies the routing weights, so the combine needs no atomics and no extra kernel).

Products accumulate elementwise in a [BLOCK_N, BLOCK_K] float32 tile and are reduced once at the
end, so the loop body is loads and FMAs only; with UNROLL (H, I constexpr) the K loop is straight-line
code and the loads of all iterations can be in flight together. Measured on the H200 (sweep before
this version): per-iteration reductions in a rolled loop left T=1 at ~40 us/layer for both bf16 and
fp8, i.e. latency-bound.

Tiles (entries "gemv_gate_up", "gemv_down") were chosen inside the decode step
(bench/step_variants.py, 60 tile pairs, bench/results/h200/step_variants_moe_tiles*.json):
Qwen3-30B-A3B batch-1 step 2.580 -> 2.396 ms at a 400 cache (2.555 -> 2.369 at 4096). Alone the
previous tiles had won (4,256,2 / 8,256,4); in the step, fewer warps per program (more, smaller
programs resident beside the neighbouring kernels) win, and 8 rows on one warp spill (5.9 ms).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start
from ember.kernels.moe import config
from ember.kernels.moe.shared import (block_scale_rows, fold_inputs, fold_pointers, row_scale, split_buffers,
                                      store_silu_mul, store_split_or_fold)


@triton.jit
def _gate_up_slice(acc_g, acc_u, x_ptr, t, stride_x, w_base, rows, row_mask, k0, scale_ptr, e,
                   stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                   H: tl.constexpr, I: tl.constexpr, SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < H
    xv = tl.load(x_ptr + t * stride_x + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    m2 = row_mask[:, None] & k_mask[None, :]
    ptrs = w_base + rows[:, None] * stride_wn + offs_k[None, :] * stride_wk
    pg = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32) * xv[None, :]
    pu = tl.load(ptrs + I * stride_wn, mask=m2, other=0.0).to(tl.float32) * xv[None, :]
    if SCALE == 2:  # BLOCK_K <= 128: the slice sits in one 128-wide scale block
        pg *= block_scale_rows(scale_ptr, e, rows, row_mask, k0, stride_se, stride_sn, stride_sk)[:, None]
        pu *= block_scale_rows(scale_ptr, e, rows + I, row_mask, k0, stride_se, stride_sn, stride_sk)[:, None]
    return acc_g + pg, acc_u + pu


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, h_ptr, stride_x,
                         stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                         H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                         PDL: tl.constexpr = False):
    """h[pair, n] = silu(gate[e] . x[t]) * (up[e] . x[t]) for one pair (t, j) and BLOCK_N of the I rows."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    nb = tl.program_id(1)
    t = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < I
    w_base = w_ptr + e * stride_we
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if UNROLL:
        for k0 in tl.static_range(0, H, BLOCK_K):
            acc_g, acc_u = _gate_up_slice(acc_g, acc_u, x_ptr, t, stride_x, w_base, rows, row_mask, k0, scale_ptr, e,
                                          stride_wn, stride_wk, stride_se, stride_sn, stride_sk, H, I, SCALE, BLOCK_K)
    else:
        for k0 in range(0, H, BLOCK_K):
            acc_g, acc_u = _gate_up_slice(acc_g, acc_u, x_ptr, t, stride_x, w_base, rows, row_mask, k0, scale_ptr, e,
                                          stride_wn, stride_wk, stride_se, stride_sn, stride_sk, H, I, SCALE, BLOCK_K)
    store_silu_mul(acc_g, acc_u, h_ptr, pair, rows, row_mask, scale_ptr, e, stride_se, stride_sn, I, SCALE)


@triton.jit
def _down_tile(w_base, rows, row_mask, k0, stride_wn, stride_wk, I: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_base + rows[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                   mask=row_mask[:, None] & (offs_k < I)[None, :], other=0.0)


@triton.jit
def _down_slice(acc, w, h_ptr, pair, weight, rows, row_mask, row_s, k0, scale_ptr, e, stride_se, stride_sn, stride_sk,
                I: tl.constexpr, SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    hv = tl.load(h_ptr + pair * I + offs_k, mask=offs_k < I, other=0.0).to(tl.float32) * weight
    prod = w.to(tl.float32) * hv[None, :]
    if SCALE == 1:
        prod *= row_s[:, None]
    if SCALE == 2:
        prod *= block_scale_rows(scale_ptr, e, rows, row_mask, k0, stride_se, stride_sn, stride_sk)[:, None]
    return acc + prod


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, out_ptr,
                      stride_out, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                      res_ptr, lnw_ptr, scaled_ptr, part_ptr, cnt_ptr,
                      H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                      FOLD: tl.constexpr = False, SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False):
    """out[t, n] = sum_j w[t, j] * down[e_j][n] . h[(t, j)] for BLOCK_N output rows; no atomics.

    Before waiting for the previous kernel (gate_up, whose h this reads) it loads the expert ids and
    routing weights (written by the router before gate_up ran, so finished by now, see
    _common.pdl_start; volatile: around L1) and the first expert's first weight tile, so the ids ->
    weights latency chain overlaps gate_up's tail. H200 Qwen3-30B-A3B decode step: 2.653 vs 2.677 ms
    without (step_variants_down_prefetch.json).

    FOLD: see store_out_or_fold (out becomes the new residual, scaled_ptr gets it times lnw); its
    residual and norm weight are loaded after the wait (before it: 2.30 vs 2.27 ms).
    SPLIT > 1: program (t, nb, g) takes expert group g only, as in the v2 down GEMV."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    g = tl.program_id(2)
    JPG: tl.constexpr = TOP_K // SPLIT
    first = t * TOP_K + g * JPG  # this program's first pair
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    e0 = tl.load(ids_ptr + first, volatile=True).to(tl.int64)
    weight0 = tl.load(tw_ptr + first, volatile=True).to(tl.float32)
    w0 = _down_tile(w_ptr + e0 * stride_we, rows, row_mask, 0, stride_wn, stride_wk, I, BLOCK_K)
    pdl_start(PDL)
    r, lw = fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD, False)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(JPG):
        pair = first + j
        if j == 0:
            e = e0
            weight = weight0
            w = w0
        else:
            e = tl.load(ids_ptr + pair).to(tl.int64)
            weight = tl.load(tw_ptr + pair).to(tl.float32)
            w = _down_tile(w_ptr + e * stride_we, rows, row_mask, 0, stride_wn, stride_wk, I, BLOCK_K)
        w_base = w_ptr + e * stride_we
        row_s = rows.to(tl.float32)  # placeholder when there is no row scale
        if SCALE == 1:
            row_s = row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn)
        acc = _down_slice(acc, w, h_ptr, pair, weight, rows, row_mask, row_s, 0, scale_ptr, e, stride_se, stride_sn,
                          stride_sk, I, SCALE, BLOCK_K)
        if UNROLL:
            for k0 in tl.static_range(BLOCK_K, I, BLOCK_K):
                w = _down_tile(w_base, rows, row_mask, k0, stride_wn, stride_wk, I, BLOCK_K)
                acc = _down_slice(acc, w, h_ptr, pair, weight, rows, row_mask, row_s, k0, scale_ptr, e, stride_se,
                                  stride_sn, stride_sk, I, SCALE, BLOCK_K)
        else:
            for k0 in range(BLOCK_K, I, BLOCK_K):
                w = _down_tile(w_base, rows, row_mask, k0, stride_wn, stride_wk, I, BLOCK_K)
                acc = _down_slice(acc, w, h_ptr, pair, weight, rows, row_mask, row_s, k0, scale_ptr, e, stride_se,
                                  stride_sn, stride_sk, I, SCALE, BLOCK_K)
    store_split_or_fold(tl.sum(acc, axis=1), part_ptr, cnt_ptr, g, nb, out_ptr, t, stride_out, rows, row_mask, r,
                        lw, scaled_ptr, H, FOLD, SPLIT)


def experts_gemv(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out, fold=None):
    """T == 1 path (also correct for any T, one pair per program).
    ``fold = (residual, norm_weight, scaled)``: see store_out_or_fold."""
    T, H = x.shape
    I = w_gate_up.shape[1] // 2
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)
    cfg = config.tiles("gemv_gate_up", x.device)
    mode, gs_t, gse, gsn, gsk = config.scale_args(w_gate_up, gs)
    bn, bk = cfg["BLOCK_N"], config.sub_k(mode, cfg["BLOCK_K"])
    _gate_up_gemv_kernel[(T * top_k, triton.cdiv(I, bn))](
        x, w_gate_up, gs_t, ids, h, x.stride(0), *w_gate_up.stride(), gse, gsn, gsk, H=H, I=I,
        TOP_K=top_k, SCALE=mode, BLOCK_N=bn, BLOCK_K=bk, UNROLL=cfg["UNROLL"],
        num_warps=cfg["num_warps"], **pdl_options(x.device))
    cfg = config.tiles("gemv_down", x.device)
    mode, ds_t, dse, dsn, dsk = config.scale_args(w_down, ds)
    bn, bk = cfg["BLOCK_N"], config.sub_k(mode, cfg["BLOCK_K"])
    nb = triton.cdiv(H, bn)
    split, part, cnt = split_buffers(cfg, T, H, nb, top_k, w_down, h)
    _down_gemv_kernel[(T, nb, split)](
        h, w_down, ds_t, ids, tw, out, out.stride(0), *w_down.stride(), dse, dsn, dsk, *fold_pointers(fold, out),
        part, cnt, H=H, I=I, TOP_K=top_k, SCALE=mode, BLOCK_N=bn, BLOCK_K=bk, UNROLL=cfg["UNROLL"],
        FOLD=fold is not None, SPLIT=split, num_warps=cfg["num_warps"], **pdl_options(x.device))
    return out


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
