"""Triton kernels for the fused MoE ops (routing, SwiGLU experts); launch helpers take validated tensors.

Three paths, picked by the token count T (all capturable: no host syncs, shapes fixed by T, k, E):

* T == 1, the decode step of one sequence: ``_route_kernel``, ``_gate_up_gemv_kernel`` (SiLU*up
  fused), then ``_down_gemv_kernel`` (one program per block of output rows loops over the token's k
  experts and applies the routing weights, so the combine needs no atomics and no extra kernel).
  The gate_up GEMV can also recompute the routing itself (``moe_t1: FUSED_ROUTE``, saving a launch),
  but on the H200 that measured 30.6 us/layer against 28.2 us with the separate route kernel: the
  top-k reductions delay every program's first weight load.
  fp8 weights take the v2 T=1 kernels by default (``_gate_up_gemv_v2_kernel``,
  ``_down_gemv_v2_kernel``: no shared-memory layout conversion in the K loop; analysis and H200
  figures at ``_t1_v2_config``), bf16 the v1 kernels above (faster in the decode step once launches
  overlap, see GPU_CONFIG); ``EMBER_MOE_T1=v1|v2`` forces either.
* 2 <= T <= 16 (batched decode): the program of pair (t, j) serves expert ``ids[t, j]`` if that pair is
  the expert's first occurrence and exits otherwise, so each selected expert's weights are read once
  for all the tokens routed to it; tokens are rows of a 16-row ``tl.dot``. The down projection
  stores one weighted float32 row per (token, expert) pair; ``_combine_pairs_kernel`` sums a token's
  rows in a fixed order and casts (no atomics: the same bits every run).
* T > 16 (prefill): (token, expert) pairs sorted by expert on the device (``_align``), padded to
  blocks of BLOCK_M rows of one expert; the same grouped kernels run over the blocks (their own
  tiles, ``prefill_configs``), the pair rows in the activation dtype (``_pair_rows_dtype``).

FP8 weights are converted to the activation dtype in registers (exact for e4m3 in bf16/fp16/fp32);
row scales multiply the accumulator at the end, 128x128 block scales each 128-wide K slice.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels._common import (arrival_counters, early_loads, env_ints, parse_ints, pdl_options, pdl_start,
                                   residual_inv_rms, residual_inv_rms_after, residual_sum, round_to)

FP8 = torch.float8_e4m3fn
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2
SCALE_BLOCK = 128

# Launch configurations. GPU values: the best of a sweep on the H200 at Qwen3-30B-A3B shapes (T=1:
# 7 gate_up x 7 down GEMV configs, bf16 + fp8 time summed; T=16 / T=512: 5 configs each, all within
# ~5% of each other). The interpreter (CPU tests) uses small blocks so tiny shapes still exercise
# several K iterations and N blocks.
# The v1 T=1 tiles were re-chosen inside the decode step (bench/step_variants.py "tiles:GU:DN", 60
# tile pairs, bench/results/h200/step_variants_moe_tiles*.json): Qwen3-30B-A3B batch-1 step 2.580 ->
# 2.396 ms at a 400 cache (2.555 -> 2.369 at 4096). Alone the previous tiles had won (4,256,2 / 8,256,4);
# in the step, fewer warps per program (more, smaller programs resident beside the neighbouring
# kernels) win, and 8 rows on one warp spill (5.9 ms).
GPU_CONFIG = {
    "gemv_gate_up": dict(BLOCK_N=4, BLOCK_K=256, num_warps=1, UNROLL=True),
    "gemv_down": dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, UNROLL=True, SPLIT=1, SPLIT_FP8=1),
    "grouped_decode": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "grouped_prefill": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    # T=1, H200, Qwen3-30B-A3B shapes. fp8: v2 (ember.bench.moe_ops.sweep, us per layer: row scales
    # 20.6 vs 29.2, 128-blocks 21.2 vs ~29; see _t1_v2_config). bf16: v2 won alone (27.6 vs 28.4 us)
    # and in the decode step without dependent launch (2.934 vs 2.953 ms), but with it v1 does
    # (bench/step_variants.py: 2.705 vs 2.734 ms at max_seq_len 400, 2.745 vs 2.777 at 4096).
    "moe_t1": dict(FUSED_ROUTE=False, GEMV="v1", GEMV_FP8="v2"),  # FUSED_ROUTE: routing in the gate_up GEMV (v1)
    # v2 kernels: warps per program, rows per warp lane group. Down takes 2 rows for fp8 weights
    # (ROWS_FP8: 20.6 vs 21.4 us) but 1 for bf16 (27.6 vs 32.2 us: 2 rows of bf16 spill the partial sums).
    "gemv_v2_gate_up": dict(num_warps=4, ROWS=2, ROWS_FP8=2, LANES=None),
    "gemv_v2_down": dict(num_warps=4, ROWS=1, ROWS_FP8=2, LANES=None, SPLIT=1, SPLIT_FP8=4),
}
CPU_CONFIG = {
    "gemv_gate_up": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, UNROLL=True),
    "gemv_down": dict(BLOCK_N=16, BLOCK_K=16, num_warps=1, UNROLL=False, SPLIT=1, SPLIT_FP8=1),
    "grouped_decode": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1),
    "grouped_prefill": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1),
    "moe_t1": dict(FUSED_ROUTE=True, GEMV="v1", GEMV_FP8="v1"),
    # LANES=4: several K steps and ragged K masks even at H=64..256
    "gemv_v2_gate_up": dict(num_warps=1, ROWS=2, ROWS_FP8=2, LANES=4),
    "gemv_v2_down": dict(num_warps=1, ROWS=2, ROWS_FP8=2, LANES=4, SPLIT=2, SPLIT_FP8=2),  # CI runs the split
}
DECODE_MAX_TOKENS = 16


# ============================================================================ routing
@triton.jit
def _select_topk(choose, values, offs, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr,
                 GATHER: tl.constexpr):
    """The TOP_K largest entries of ``choose`` (ties -> lower index): (their ``values``, their indices).
    GATHER=False: ``values`` is ``choose`` itself, so each pick's value is its max (no extra reduction)."""
    kk = tl.arange(0, BLOCK_KK)
    ids = tl.zeros([BLOCK_KK], dtype=tl.int32)
    ws = tl.zeros([BLOCK_KK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choose, axis=0)
        idx = tl.min(tl.where(choose == best, offs, BLOCK_E), axis=0)
        ids = tl.where(kk == j, idx, ids)
        if GATHER:
            ws = tl.where(kk == j, tl.sum(tl.where(offs == idx, values, 0.0), axis=0), ws)
        else:
            ws = tl.where(kk == j, best, ws)
        choose = tl.where(offs == idx, float("-inf"), choose)
    return ws, ids


@triton.jit
def _select_topk_packed(p, offs, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr):
    """The TOP_K largest of ``p`` (non-negative floats; negative lanes are never picked before them;
    ties -> lower index) as (values, indices), one max reduction per pick: value bits and reversed
    index packed in one int64 key (non-negative float bits order like the floats), where
    _select_topk needs a max and an index min (each a cross-warp reduction) per pick."""
    kk = tl.arange(0, BLOCK_KK)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - offs).to(tl.int64)
    ids = tl.zeros([BLOCK_KK], dtype=tl.int32)
    ws = tl.zeros([BLOCK_KK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=0)
        ids = tl.where(kk == j, (BLOCK_E - 1 - (best & 0xFFFFFFFF)).to(tl.int32), ids)
        ws = tl.where(kk == j, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), ws)
        key = tl.where(key == best, -(1 << 62), key)
    return ws, ids


@triton.jit
def _topk_of_row(logits_ptr, row, stride_row, E, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr, VOLATILE: tl.constexpr = False,
                 PACKED: tl.constexpr = True):
    """float32 softmax over E logits, then the TOP_K largest (ties -> lower index), renormalised.
    VOLATILE: read around L1 (logits other programs wrote in this launch). PACKED: the selection
    by packed keys (_select_topk_packed), else _select_topk; the same picks and values."""
    offs = tl.arange(0, BLOCK_E)
    in_range = offs < E
    logits = tl.load(logits_ptr + row * stride_row + offs, mask=in_range, other=-float("inf"),
                     volatile=VOLATILE).to(tl.float32)
    return softmax_topk(logits, offs, in_range, TOP_K, RENORM, BLOCK_E, BLOCK_KK, PACKED)


@triton.jit
def softmax_topk(logits, offs, in_range, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_KK: tl.constexpr, PACKED: tl.constexpr = True):
    """_topk_of_row of fp32 ``logits`` [BLOCK_E] already in registers (-inf outside ``in_range``)."""
    ex = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(in_range, ex / tl.sum(ex, axis=0), -1.0)  # padding lanes are never picked
    if PACKED:
        ws, ids = _select_topk_packed(p, offs, TOP_K, BLOCK_E, BLOCK_KK)
    else:
        ws, ids = _select_topk(p, p, offs, TOP_K, BLOCK_E, BLOCK_KK, GATHER=False)
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)
    return ws, ids


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_row,
                  TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr):
    t = tl.program_id(0)
    ws, ids = _topk_of_row(logits_ptr, t, stride_row, E, TOP_K, RENORM, BLOCK_E, BLOCK_KK)
    kk = tl.arange(0, BLOCK_KK)
    tl.store(w_ptr + t * TOP_K + kk, ws, mask=kk < TOP_K)
    tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kk < TOP_K)


# ============================================================================ shared pieces
@triton.jit
def _sigmoid_topk_of_row(logits_ptr, row, E, bias_ptr, scaling, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr):
    """LFM2 routing: scores = sigmoid(logits); the TOP_K largest scores + bias (ties -> lower index)
    are chosen, their unbiased scores normalised by (sum + 1e-6) when RENORM, times ``scaling``."""
    offs = tl.arange(0, BLOCK_E)
    in_range = offs < E
    logits = tl.load(logits_ptr + row * E + offs, mask=in_range, other=0.0, volatile=True)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choose = scores
    if HAS_BIAS:
        choose = choose + tl.load(bias_ptr + offs, mask=in_range, other=0.0)
    choose = tl.where(in_range, choose, float("-inf"))
    ws, ids = _select_topk(choose, scores, offs, TOP_K, BLOCK_E, BLOCK_KK, GATHER=True)
    if RENORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-6)
    return ws * scaling, ids


@triton.jit
def _router_normed(hv, lw, inv_rms, normed_ptr, t, j, ks, H, dt: tl.constexpr):
    """add_rmsnorm's output at columns ks (rounded to ``dt``) as fp32; program j == 0 stores it."""
    normed = round_to(hv * inv_rms * lw, dt)
    if j == 0:
        tl.store(normed_ptr + t * H + ks, normed, mask=ks < H)
    return normed.to(tl.float32)


@triton.jit
def _router_input(x_ptr, res_ptr, lnw_ptr, normed_ptr, t, j, stride_x, ks, H, inv_rms, ADD_NORM: tl.constexpr):
    """The router's input for columns ks of token t (fp32): x itself, or add_rmsnorm's output, which
    program j == 0 also stores (rows of H)."""
    if ADD_NORM:
        hv = residual_sum(x_ptr + t * stride_x, res_ptr + t * H, ks, H, 1)
        lw = tl.load(lnw_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
        xv = _router_normed(hv, lw, inv_rms, normed_ptr, t, j, ks, H, x_ptr.dtype.element_ty)
    else:
        xv = tl.load(x_ptr + t * stride_x + ks, mask=ks < H, other=0.0).to(tl.float32)
    return xv


@triton.jit
def _router_route_kernel(x_ptr, w_ptr, logits_ptr, cnt_ptr, tw_ptr, ids_ptr, bias_ptr, scaling, E, H, stride_x, n_prog,
                         res_ptr, lnw_ptr, normed_ptr, new_res_ptr, eps,
                         TOP_K: tl.constexpr, RENORM: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SHARED_GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr, ADD_NORM: tl.constexpr = False,
                         PACKED: tl.constexpr = True, EARLY: tl.constexpr = False, PDL: tl.constexpr = False):
    """Router GEMV and routing in one launch: program (t, j) computes BLOCK_R of token t's logits
    (rounded to x's dtype, as ``F.linear(x, router)`` returns them); the last of the token's
    ``n_prog`` programs to arrive (acq_rel counter) routes from all E logits and resets the counter.
    Routing: Qwen3's softmax top-k, or (SIGMOID) LFM2's biased sigmoid selection. SHARED_GATE: the
    last of the E rows is a shared expert's gate: softmax top-k over the first E - 1, then expert
    E - 1 appended with weight sigmoid(its logit) (Qwen3.5's shared expert folded into the experts).
    ADD_NORM: x is first added to the residual row and RMS-normalised (the decoder's post-attention
    ``add_rmsnorm``, saving its launch): every program computes the normalised row itself (the same
    code and layout everywhere, so the same values), multiplies its router rows with it, and program
    0 stores it and the new residual for the expert GEMVs and the next layer.
    EARLY (ADD_NORM, ``_common.early_loads("router")``): the first K block's norm weight is loaded
    before the wait too, and that block's x + residual is kept from the norm's pass for the product
    (the same values: the same bits) instead of reloaded with the norm weight after the row's
    reduction (a dependent load after the reduction in the sm_90 SASS).
    """
    t = tl.program_id(0)
    j = tl.program_id(1)
    rows = j * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < E
    w_rows = w_ptr + rows[:, None].to(tl.int64) * H
    # The first K block of the router weight (on the GPU all of K) is loaded before waiting for the
    # previous kernel: no kernel writes it, and under dependent launch the load overlaps that kernel.
    ks = tl.arange(0, BLOCK_H)
    w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & (ks < H)[None, :], other=0.0)
    if ADD_NORM and EARLY:
        lw0 = tl.load(lnw_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
    pdl_start(PDL)
    inv_rms = 0.0
    if ADD_NORM and EARLY:
        # residual_inv_rms and _router_input with block 0's residual sum computed once
        h0 = residual_sum(x_ptr + t * stride_x, res_ptr + t * H, ks, H, 1)
        inv_rms = residual_inv_rms_after(h0, x_ptr + t * stride_x, res_ptr + t * H, new_res_ptr + t * H, H, 1, eps,
                                         j == 0, BLOCK_H)
        xv = _router_normed(h0, lw0, inv_rms, normed_ptr, t, j, ks, H, x_ptr.dtype.element_ty)
    else:
        if ADD_NORM:  # program 0 of the token writes the new residual
            inv_rms = residual_inv_rms(x_ptr + t * stride_x, res_ptr + t * H, new_res_ptr + t * H, H, 1, eps,
                                       j == 0, BLOCK_H)
        xv = _router_input(x_ptr, res_ptr, lnw_ptr, normed_ptr, t, j, stride_x, ks, H, inv_rms, ADD_NORM)
    acc = w.to(tl.float32) * xv[None, :]
    for k0 in range(BLOCK_H, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        w = tl.load(w_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        xv = _router_input(x_ptr, res_ptr, lnw_ptr, normed_ptr, t, j, stride_x, ks, H, inv_rms, ADD_NORM)
        acc += w.to(tl.float32) * xv[None, :]
    logit = round_to(tl.sum(acc, axis=1), x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t * E + rows, logit, mask=row_mask)
    if tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        if SIGMOID:
            ws, ids = _sigmoid_topk_of_row(logits_ptr, t, E, bias_ptr, scaling, TOP_K, RENORM, HAS_BIAS,
                                           BLOCK_E, BLOCK_KK)
        elif SHARED_GATE:
            ws, ids = _topk_of_row(logits_ptr, t, E, E - 1, TOP_K, RENORM, BLOCK_E, BLOCK_KK, VOLATILE=True,
                                   PACKED=PACKED)
            gate = tl.load(logits_ptr + t * E + E - 1, volatile=True)
            ws = tl.where(tl.arange(0, BLOCK_KK) == TOP_K, 1.0 / (1.0 + tl.exp(-gate)), ws)
            ids = tl.where(tl.arange(0, BLOCK_KK) == TOP_K, E - 1, ids)
        else:
            ws, ids = _topk_of_row(logits_ptr, t, E, E, TOP_K, RENORM, BLOCK_E, BLOCK_KK, VOLATILE=True,
                                   PACKED=PACKED)
        kk = tl.arange(0, BLOCK_KK)
        n_out: tl.constexpr = TOP_K + SHARED_GATE
        tl.store(tw_ptr + t * n_out + kk, ws, mask=kk < n_out)
        tl.store(ids_ptr + t * n_out + kk, ids, mask=kk < n_out)
        tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")


@triton.jit
def _silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _block_scale_rows(scale_ptr, e, rows, row_mask, k0, stride_se, stride_sn, stride_sk):
    """The 128x128-block scales of ``rows`` at K offset ``k0`` (a K slice never straddles blocks)."""
    return tl.load(scale_ptr + e * stride_se + (rows // 128) * stride_sn + (k0 // 128) * stride_sk,
                   mask=row_mask, other=0.0).to(tl.float32)


@triton.jit
def _row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn):
    return tl.load(scale_ptr + e * stride_se + rows * stride_sn, mask=row_mask, other=0.0).to(tl.float32)


# ============================================================================ T == 1: GEMV kernels
# Products accumulate elementwise in a [BLOCK_N, BLOCK_K] float32 tile and are reduced once at the
# end, so the loop body is loads and FMAs only; with UNROLL (H, I constexpr) the K loop is straight-line
# code and the loads of all iterations can be in flight together. Measured on the H200 (sweep before
# this version): per-iteration reductions in a rolled loop left T=1 at ~40 us/layer for both bf16 and
# fp8, i.e. latency-bound.
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
        pg *= _block_scale_rows(scale_ptr, e, rows, row_mask, k0, stride_se, stride_sn, stride_sk)[:, None]
        pu *= _block_scale_rows(scale_ptr, e, rows + I, row_mask, k0, stride_se, stride_sn, stride_sk)[:, None]
    return acc_g + pg, acc_u + pu


@triton.jit
def _store_silu_mul(acc_g, acc_u, h_ptr, pair, rows, row_mask, scale_ptr, e, stride_se, stride_sn,
                    I: tl.constexpr, SCALE: tl.constexpr):
    """Reduce the gate/up partial sums over K, apply row scales, store silu(g) * u rounded once."""
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if SCALE == 1:
        g *= _row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn)
        u *= _row_scale(scale_ptr, e, rows + I, row_mask, stride_se, stride_sn)
    tl.store(h_ptr + pair * I + rows, round_to(_silu_mul(g, u), h_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, scale_ptr, logits_ptr, ids_ptr, tw_ptr, h_ptr,
                         E, stride_x, stride_logits,
                         stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                         H: tl.constexpr, I: tl.constexpr,
                         TOP_K: tl.constexpr, FUSED_ROUTE: tl.constexpr, RENORM: tl.constexpr,
                         SCALE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                         PDL: tl.constexpr = False):
    """h[pair, n] = silu(gate[e] . x[t]) * (up[e] . x[t]) for one pair (t, j) and BLOCK_N of the I rows."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    nb = tl.program_id(1)
    t = pair // TOP_K
    j = pair % TOP_K
    if FUSED_ROUTE:
        ws, ids = _topk_of_row(logits_ptr, t, stride_logits, E, TOP_K, RENORM, BLOCK_E, BLOCK_KK)
        kk = tl.arange(0, BLOCK_KK)
        e = tl.sum(tl.where(kk == j, ids, 0), axis=0).to(tl.int64)
        if (nb == 0) & (j == 0):  # one program per token publishes the routing for the down kernel
            tl.store(tw_ptr + t * TOP_K + kk, ws, mask=kk < TOP_K)
            tl.store(ids_ptr + t * TOP_K + kk, ids, mask=kk < TOP_K)
    else:
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
    _store_silu_mul(acc_g, acc_u, h_ptr, pair, rows, row_mask, scale_ptr, e, stride_se, stride_sn, I, SCALE)


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
        prod *= _block_scale_rows(scale_ptr, e, rows, row_mask, k0, stride_se, stride_sn, stride_sk)[:, None]
    return acc + prod


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, out_ptr,
                      stride_out, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                      res_ptr, lnw_ptr, scaled_ptr, part_ptr, cnt_ptr,
                      H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                      IDS_BEFORE: tl.constexpr, FOLD: tl.constexpr = False, FOLD_EARLY: tl.constexpr = True,
                      SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False):
    """out[t, n] = sum_j w[t, j] * down[e_j][n] . h[(t, j)] for BLOCK_N output rows; no atomics.

    IDS_BEFORE (the ids were written before the gate_up GEMV ran, i.e. not by its fused routing; off
    with EMBER_MOE_DOWN_PREFETCH=0, read per call):
    before waiting for the previous kernel (gate_up, whose h this reads) it loads the expert ids and
    routing weights (finished by now, see _common.pdl_start; volatile: around L1) and the first
    expert's first weight tile, so the ids -> weights latency chain overlaps gate_up's tail. H200
    Qwen3-30B-A3B decode step: 2.653 vs 2.677 ms without (bench/step_variants.py).

    FOLD: see _store_out_or_fold (out becomes the new residual, scaled_ptr gets it times lnw).
    SPLIT > 1: program (t, nb, g) takes expert group g only, as in _down_gemv_v2_kernel."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    g = tl.program_id(2)
    JPG: tl.constexpr = TOP_K // SPLIT
    first = t * TOP_K + g * JPG  # this program's first pair
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    if not IDS_BEFORE:
        pdl_start(PDL)
    e0 = tl.load(ids_ptr + first, volatile=IDS_BEFORE).to(tl.int64)
    weight0 = tl.load(tw_ptr + first, volatile=IDS_BEFORE).to(tl.float32)
    w0 = _down_tile(w_ptr + e0 * stride_we, rows, row_mask, 0, stride_wn, stride_wk, I, BLOCK_K)
    r, lw = _fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD and FOLD_EARLY, IDS_BEFORE)
    if IDS_BEFORE:
        pdl_start(PDL)
    if not FOLD_EARLY:
        r, lw = _fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD, False)
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
            row_s = _row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn)
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
    _store_split_or_fold(tl.sum(acc, axis=1), part_ptr, cnt_ptr, g, nb, out_ptr, t, stride_out, rows, row_mask, r,
                         lw, scaled_ptr, H, FOLD, SPLIT)


@triton.jit
def _fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD: tl.constexpr, BEFORE_WAIT: tl.constexpr):
    """FOLD: the residual rows (token t) and the next norm's weights the epilogue needs, loaded first.
    BEFORE_WAIT: called before pdl_start; the residual was written by the router, the kernel before
    the gate_up GEMV this one waits for, so it is complete (volatile: no stale L1 line of an earlier
    layer's buffer at the same address)."""
    if FOLD:
        r = tl.load(res_ptr + t * H + rows, mask=row_mask, other=0.0, volatile=BEFORE_WAIT).to(tl.float32)
        lw = tl.load(lnw_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    else:
        r, lw = rows, rows  # unused
    return r, lw


@triton.jit
def _store_out_or_fold(out, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H, FOLD: tl.constexpr):
    """Store the experts' sum ``out`` (fp32) for token t, rounded to the output dtype. FOLD: store
    instead the new residual stream h = out + residual (each rounded as add_rmsnorm does) and
    h * lnw into scaled_ptr: the next layer's pre-attention add_rmsnorm without its 1 / rms, which
    needs the whole row and is applied by the kernel after the qkv projection (one launch fewer)."""
    dt = out_ptr.dtype.element_ty
    y = round_to(out, dt)
    if FOLD:
        h = round_to(y.to(tl.float32) + r, dt)
        tl.store(out_ptr + t * stride_out + rows, h, mask=row_mask)
        tl.store(scaled_ptr + t * H + rows, round_to(h.to(tl.float32) * lw, dt), mask=row_mask)
    else:
        tl.store(out_ptr + t * stride_out + rows, y, mask=row_mask)


@triton.jit
def _store_split_or_fold(y, part_ptr, cnt_ptr, g, nb, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H,
                         FOLD: tl.constexpr, SPLIT: tl.constexpr):
    """The down GEMVs' end: ``y`` is this program's fp32 row sums (experts of group g of SPLIT).
    SPLIT == 1: _store_out_or_fold. Else: store y in part_ptr[t, g], arrive at counter (t, nb); the
    last of the SPLIT to arrive adds the partials in group order (the same bits whichever arrives
    last), stores the output (or the FOLD epilogue) and resets the counter."""
    if SPLIT == 1:
        _store_out_or_fold(y, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H, FOLD)
    else:
        tl.store(part_ptr + (t * SPLIT + g) * H + rows, y, mask=row_mask)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        slot = cnt_ptr + t * tl.num_programs(1) + nb
        if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = tl.zeros_like(y)
            for gg in tl.static_range(SPLIT):  # group order, own partial included: arrival order never matters
                total += tl.load(part_ptr + (t * SPLIT + gg) * H + rows, mask=row_mask, other=0.0, volatile=True)
            _store_out_or_fold(total, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H, FOLD)
            tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")


# ============================================================================ T == 1: GEMV kernels, v2
# Selected with EMBER_MOE_T1=v2 (or GPU_CONFIG["moe_t1"]); see _t1_v2_config for the analysis.
# Tiles are [BLOCK_N, LANES * VEC], K fastest: VEC contiguous K elements (16 bytes of weight) per
# thread, LANES threads of a warp along K, warps (and 32 // LANES rows per warp) along the rows. The
# activation is loaded with the weight tile's shape so both get the same register layout (no shared
# memory); sums over a thread's VEC elements go through a [BLOCK_N, LANES, VEC] view (in-thread).
# (A 3-D [BLOCK_N, LANES, VEC] load instead made Triton put rows before lanes within a warp.)
# Within a K step of BPS 128-wide scale blocks, lane l reads chunk (l % BPS) * (LANES // BPS) + l // BPS:
# the warp still reads the step's bytes contiguously, and lane l's scale block is k0 // 128 + l % BPS,
# contiguous along the lanes, so Triton gives the [BLOCK_N, LANES] scale load the lanes-fastest layout
# of the partial sums. With the identity order (8 lanes per block, contiguity 1 both ways) it chose
# rows-fastest and converted through shared memory each step (2 bar.sync + a dependent L2 round trip).
@triton.jit
def _v2_k_offsets(LANES: tl.constexpr, VEC: tl.constexpr, BPS: tl.constexpr):
    j = tl.arange(0, LANES * VEC)
    lane = j // VEC
    chunk = (lane % BPS) * (LANES // BPS) + lane // BPS
    return (chunk * VEC + j % VEC)[None, :]  # [1, LANES * VEC], a permutation of 0 .. LANES * VEC - 1


@triton.jit
def _v2_vec_sum(p, BLOCK_N: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr):
    """[BLOCK_N, LANES * VEC] -> [BLOCK_N, LANES]: each thread sums its own VEC elements."""
    return tl.sum(tl.reshape(p, (BLOCK_N, LANES, VEC)), axis=2)


@triton.jit
def _v2_block_scales(scale_ptr, e, rows, row_mask, k0, K, stride_se, stride_sn, stride_sk,
                     LANES: tl.constexpr, VEC: tl.constexpr, BPS: tl.constexpr):
    """[BLOCK_N, LANES] 128x128-block scales of each thread's VEC elements (VEC | 128: one block)."""
    lane = tl.arange(0, LANES)
    chunk_k = k0 + ((lane % BPS) * (LANES // BPS) + lane // BPS) * VEC
    kb = k0 // 128 + lane % BPS  # == chunk_k // 128: the step (BPS x 128, or a divisor of 128) divides k0
    return tl.load(scale_ptr + e * stride_se + (rows // 128)[:, None] * stride_sn + kb[None, :] * stride_sk,
                   mask=row_mask[:, None] & (chunk_k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _gate_up_gemv_v2_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, h_ptr, stride_x,
                            stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                            H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                            BLOCK_N: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BPS: tl.constexpr,
                            PDL: tl.constexpr = False):
    """h[pair, n] = silu(gate[e] . x[t]) * (up[e] . x[t]) for BLOCK_N rows n; K (= H) unrolled, one reduction."""
    pdl_start(PDL)
    pair = tl.program_id(0)
    nb = tl.program_id(1)
    t = pair // TOP_K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < I
    g_rows = (w_ptr + e * stride_we + rows.to(tl.int64) * stride_wn)[:, None]  # [BN, 1]
    u_rows = g_rows + I * stride_wn
    mask_rows = row_mask[:, None]
    kk = _v2_k_offsets(LANES, VEC, BPS)
    shape: tl.constexpr = (BLOCK_N, LANES * VEC)
    if SCALE == 2:
        acc_g = tl.zeros([BLOCK_N, LANES], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_N, LANES * VEC], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for k0 in tl.static_range(0, H, LANES * VEC):
        ks = k0 + kk
        mask_k = ks < H
        xv = tl.load(tl.broadcast_to(x_ptr + t * stride_x + ks, shape), mask=tl.broadcast_to(mask_k, shape),
                     other=0.0).to(tl.float32)
        wg = tl.load(g_rows + ks * stride_wk, mask=mask_rows & mask_k, other=0.0).to(tl.float32)
        wu = tl.load(u_rows + ks * stride_wk, mask=mask_rows & mask_k, other=0.0).to(tl.float32)
        if SCALE == 2:  # in-thread sum over VEC, then one FMA with the block scale
            sg = _v2_block_scales(scale_ptr, e, rows, row_mask, k0, H, stride_se, stride_sn, stride_sk, LANES, VEC, BPS)
            su = _v2_block_scales(scale_ptr, e, rows + I, row_mask, k0, H, stride_se, stride_sn, stride_sk,
                                  LANES, VEC, BPS)
            acc_g += _v2_vec_sum(wg * xv, BLOCK_N, LANES, VEC) * sg
            acc_u += _v2_vec_sum(wu * xv, BLOCK_N, LANES, VEC) * su
        else:
            acc_g += wg * xv
            acc_u += wu * xv
    # the one cross-lane reduction
    _store_silu_mul(acc_g, acc_u, h_ptr, pair, rows, row_mask, scale_ptr, e, stride_se, stride_sn, I, SCALE)


@triton.jit
def _down_gemv_v2_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, out_ptr, stride_out,
                         stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                         res_ptr, lnw_ptr, scaled_ptr, part_ptr, cnt_ptr,
                         H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                         BLOCK_N: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BPS: tl.constexpr,
                         FOLD: tl.constexpr = False, FOLD_EARLY: tl.constexpr = True, SPLIT: tl.constexpr = 1,
                         PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0, JPG_P2: tl.constexpr = 1):
    """out[t, n] = sum_j w[t, j] * down[e_j][n] . h[(t, j)] for BLOCK_N rows n; experts and K unrolled.
    FOLD: as in _down_gemv_kernel (FOLD_EARLY: its inputs loaded before the wait).
    SPLIT > 1: program (t, nb, g) sums experts g * TOP_K / SPLIT .. (g + 1) * TOP_K / SPLIT - 1 only
    (_store_split_or_fold combines the groups).
    PREFETCH (``EMBER_MOE_V2_DOWN_PREFETCH``, 1 by default, the launcher's choice): 1 loads the program's expert
    ids and routing weights before waiting for gate_up (they come from the router, two launches back,
    finished by then: _common.pdl_start; around L1), so the first weight loads after the wait do not
    wait on an id load; 2 also loads the first expert's first weight tile before the wait (as the v1
    down GEMV does). The same products in the same order: the same bits."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    g = tl.program_id(2)
    JPG: tl.constexpr = TOP_K // SPLIT
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    r, lw = _fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD and FOLD_EARLY, True)
    if PREFETCH >= 1:
        jv = tl.arange(0, JPG_P2)
        mine = t * TOP_K + g * JPG + jv
        pre_e = tl.load(ids_ptr + mine, mask=jv < JPG, other=0, volatile=True).to(tl.int64)
        pre_f = tl.load(tw_ptr + mine, mask=jv < JPG, other=0.0, volatile=True).to(tl.float32)
        if PREFETCH >= 2:
            e_first = tl.sum(tl.where(jv == 0, pre_e, 0), axis=0)
            ks_first = _v2_k_offsets(LANES, VEC, BPS)
            w_first = tl.load((w_ptr + e_first * stride_we + rows.to(tl.int64) * stride_wn)[:, None]
                              + ks_first * stride_wk, mask=row_mask[:, None] & (ks_first < I), other=0.0)
    pdl_start(PDL)
    if not FOLD_EARLY:
        r, lw = _fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD, False)
    mask_rows = row_mask[:, None]
    kk = _v2_k_offsets(LANES, VEC, BPS)
    shape: tl.constexpr = (BLOCK_N, LANES * VEC)
    acc = tl.zeros([BLOCK_N, LANES], dtype=tl.float32)
    for jj in tl.static_range(JPG):
        pair = t * TOP_K + g * JPG + jj
        if PREFETCH >= 1:
            e = tl.sum(tl.where(jv == jj, pre_e, 0), axis=0)
        else:
            e = tl.load(ids_ptr + pair).to(tl.int64)
        w_rows = (w_ptr + e * stride_we + rows.to(tl.int64) * stride_wn)[:, None]
        if SCALE == 2:
            acc_e = tl.zeros([BLOCK_N, LANES], dtype=tl.float32)
        else:
            acc_e = tl.zeros([BLOCK_N, LANES * VEC], dtype=tl.float32)
        for k0 in tl.static_range(0, I, LANES * VEC):
            ks = k0 + kk
            mask_k = ks < I
            hv = tl.load(tl.broadcast_to(h_ptr + pair * I + ks, shape), mask=tl.broadcast_to(mask_k, shape),
                         other=0.0).to(tl.float32)
            if PREFETCH >= 2 and jj == 0 and k0 == 0:
                w = w_first.to(tl.float32)
            else:
                w = tl.load(w_rows + ks * stride_wk, mask=mask_rows & mask_k, other=0.0).to(tl.float32)
            if SCALE == 2:
                s = _v2_block_scales(scale_ptr, e, rows, row_mask, k0, I, stride_se, stride_sn, stride_sk,
                                     LANES, VEC, BPS)
                acc_e += _v2_vec_sum(w * hv, BLOCK_N, LANES, VEC) * s
            else:
                acc_e += w * hv
        if SCALE != 2:
            acc_e = _v2_vec_sum(acc_e, BLOCK_N, LANES, VEC)
        # the routing weight (and a row scale) once per expert, on the [BLOCK_N, LANES] partial sums
        if PREFETCH >= 1:
            factor = tl.sum(tl.where(jv == jj, pre_f, 0.0), axis=0)
        else:
            factor = tl.load(tw_ptr + pair).to(tl.float32)
        if SCALE == 1:
            acc += acc_e * (factor * _row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn))[:, None]
        else:
            acc += acc_e * factor
    _store_split_or_fold(tl.sum(acc, axis=1), part_ptr, cnt_ptr, g, nb, out_ptr, t, stride_out, rows, row_mask, r,
                         lw, scaled_ptr, H, FOLD, SPLIT)


# ============================================================================ T >= 2: grouped kernels
@triton.jit
def _group_rows(gid, ids_ptr, tw_ptr, sorted_pairs_ptr, block_expert_ptr, T,
                TOP_K: tl.constexpr, SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KK: tl.constexpr):
    """The expert program ``gid`` serves and its BLOCK_M rows: (expert, serves?, tokens, pairs, weights, row mask).

    SORTED (prefill): block ``gid`` of the expert-sorted pair list. Otherwise (decode, T <= BLOCK_M):
    the program of pair ``gid`` serves expert ``ids[gid]`` only if no earlier pair chose it; its rows
    are the tokens that chose it (a token listing it twice gets the summed weight).
    """
    if SORTED:
        e = tl.load(block_expert_ptr + gid)
        serves = e >= 0
        pairs = tl.load(sorted_pairs_ptr + gid * BLOCK_M + tl.arange(0, BLOCK_M))
        row_mask = pairs < T * TOP_K
        pairs = tl.where(row_mask, pairs, 0)
        tokens = pairs // TOP_K
        weights = tl.load(tw_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    else:
        tt = tl.arange(0, BLOCK_M)[:, None]
        jj = tl.arange(0, BLOCK_KK)[None, :]
        flat = tt * TOP_K + jj
        in_range = (tt < T) & (jj < TOP_K)
        all_ids = tl.load(ids_ptr + flat, mask=in_range, other=-1)
        e = tl.load(ids_ptr + gid)
        hit = (all_ids == e) & in_range
        serves = tl.sum(tl.sum((hit & (flat < gid)).to(tl.int32), axis=1), axis=0) == 0
        row_mask = tl.max(hit.to(tl.int32), axis=1) > 0
        first_j = tl.min(tl.where(hit, jj, BLOCK_KK), axis=1)
        tokens = tl.arange(0, BLOCK_M)
        pairs = tokens * TOP_K + tl.where(row_mask, first_j, 0)
        all_w = tl.load(tw_ptr + flat, mask=in_range, other=0.0).to(tl.float32)
        weights = tl.sum(tl.where(hit, all_w, 0.0), axis=1)
    return e.to(tl.int64), serves, tokens, pairs, weights, row_mask


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 operands: full-precision dot, not tf32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _gate_up_grouped_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, sorted_pairs_ptr, block_expert_ptr, h_ptr,
                            T, H, I, stride_x, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                            TOP_K: tl.constexpr, SORTED: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    gid = tl.program_id(0)
    nb = tl.program_id(1)
    e, serves, tokens, pairs, weights, row_mask = _group_rows(
        gid, ids_ptr, tw_ptr, sorted_pairs_ptr, block_expert_ptr, T, TOP_K, SORTED, BLOCK_M, BLOCK_KK)
    if serves:
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of the gate (and, + I, the up) projection
        col_mask = cols < I
        w_base = w_ptr + e * stride_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            xt = tl.load(x_ptr + tokens[:, None] * stride_x + offs_k[None, :],
                         mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            wmask = k_mask[:, None] & col_mask[None, :]
            wg = tl.load(w_base + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=wmask, other=0.0)
            wu = tl.load(w_base + (cols + I)[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=wmask, other=0.0)
            pg = _dot(xt, wg.to(xt.dtype), IEEE)
            pu = _dot(xt, wu.to(xt.dtype), IEEE)
            if SCALE == 2:
                pg *= _block_scale_rows(scale_ptr, e, cols, col_mask, k0, stride_se, stride_sn, stride_sk)[None, :]
                pu *= _block_scale_rows(scale_ptr, e, cols + I, col_mask, k0, stride_se, stride_sn, stride_sk)[None, :]
            acc_g += pg
            acc_u += pu
        if SCALE == 1:
            acc_g *= _row_scale(scale_ptr, e, cols, col_mask, stride_se, stride_sn)[None, :]
            acc_u *= _row_scale(scale_ptr, e, cols + I, col_mask, stride_se, stride_sn)[None, :]
        h = _silu_mul(acc_g, acc_u)
        tl.store(h_ptr + pairs[:, None] * I + cols[None, :], round_to(h, h_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_grouped_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, sorted_pairs_ptr, block_expert_ptr, pair_out_ptr,
                         T, H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                         TOP_K: tl.constexpr, SORTED: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    gid = tl.program_id(0)
    nb = tl.program_id(1)
    e, serves, tokens, pairs, weights, row_mask = _group_rows(
        gid, ids_ptr, tw_ptr, sorted_pairs_ptr, block_expert_ptr, T, TOP_K, SORTED, BLOCK_M, BLOCK_KK)
    if serves:
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
        col_mask = cols < H
        w_base = w_ptr + e * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            ht = tl.load(h_ptr + pairs[:, None] * I + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :],
                         other=0.0)
            wd = tl.load(w_base + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            p = _dot(ht, wd.to(ht.dtype), IEEE)
            if SCALE == 2:
                p *= _block_scale_rows(scale_ptr, e, cols, col_mask, k0, stride_se, stride_sn, stride_sk)[None, :]
            acc += p
        if SCALE == 1:
            acc *= _row_scale(scale_ptr, e, cols, col_mask, stride_se, stride_sn)[None, :]
        acc *= weights[:, None]
        # one row per (token, expert) pair, summed in a fixed order by _combine_pairs_kernel: an
        # atomic_add into the token's row summed in arrival order, so prefill and batched decode
        # differed run to run in the last bit (enough to flip a near-tied greedy token)
        tl.store(pair_out_ptr + pairs[:, None].to(tl.int64) * H + cols[None, :],
                 acc.to(pair_out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _combine_pairs_kernel(pair_out_ptr, out_ptr, H, res_ptr, lnw_ptr, scaled_ptr, ids_ptr, TOP_K: tl.constexpr,
                          BLOCK: tl.constexpr, FOLD: tl.constexpr = False, DEDUP: tl.constexpr = False,
                          BLOCK_KK: tl.constexpr = 1, PDL: tl.constexpr = False):
    """out[t] = sum over j of pair_out[t * TOP_K + j], j in order (deterministic), in out's dtype.
    FOLD: as in _down_gemv_kernel (out becomes the new residual, scaled_ptr gets it times lnw).
    DEDUP (decode grouping): a pair whose expert the token listed earlier is skipped (its weight went
    to the first such pair, and its row was never written), so pair_out needs no zeroing launch."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    r, lw = _fold_inputs(res_ptr, lnw_ptr, t, cols, mask, H, FOLD, False)
    if DEDUP:
        kk = tl.arange(0, BLOCK_KK)
        row_ids = tl.load(ids_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=-1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        keep = mask
        if DEDUP:
            e_j = tl.load(ids_ptr + t * TOP_K + j)
            earlier = tl.sum(((row_ids == e_j) & (kk < j)).to(tl.int32), axis=0)
            keep = mask & ((earlier + tl.zeros([BLOCK], dtype=tl.int32)) == 0)  # [BLOCK]: the interpreter wants it
        acc += tl.load(pair_out_ptr + (t * TOP_K + j) * H + cols, mask=keep, other=0.0).to(tl.float32)
    _store_out_or_fold(acc, out_ptr, t, H, cols, mask, r, lw, scaled_ptr, H, FOLD)


# ============================================================================ launch helpers
# Prefill tiles for bf16/fp16 activations on GPUs with >= 200 KB of shared memory per block
# (H100/H200: 227 KB), per kernel, and the largest row block (``_prefill_block_m``). H200, 2048-token
# bf16 prefill at Qwen3-30B-A3B shapes, MoE op per layer (ember.bench.moe_ops.sweep,
# bench/results/h200/moe_prefill_sweep.json): 128 x 128 tiles, 64-wide K steps, 8 warps, 4 stages for
# both kernels 670 us (704 in an earlier run, against 741 for GPU_CONFIG's tiles); down with 256-wide
# N tiles 628 us (half the programs, each re-reading its rows of h half as often; its 12 K steps
# leave little to pipeline); no gate_up tile beat the default; 64-row blocks (less padding, more
# weight re-reads) 677-880 us. Both kernels take 192 KB of shared memory; fp32 activations would need
# twice that, so they keep GPU_CONFIG's tiles. Floors: 1.21 GB of weights -> 291 us, 155 GFLOP -> 196 us.
GPU_PREFILL_LARGE_SMEM = {"gate_up": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
                          "down": dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4), "max_block_m": 128}
PREFILL_TILE_ENV = "EMBER_MOE_PREFILL_TILE"
_TILE_FIELDS = "BLOCK_N,BLOCK_K,num_warps,num_stages"


def _large_smem(device: torch.device) -> bool:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) >= 200 * 1024


def _config(name: str, device: torch.device) -> dict:
    """Launch config by name (GPU_CONFIG or CPU_CONFIG), with the decode-step sweeps' env override."""
    cfg = dict((GPU_CONFIG if device.type == "cuda" else CPU_CONFIG)[name])
    names = "BLOCK_N,BLOCK_K,num_warps" + (",num_stages" if "num_stages" in cfg else "")
    tile = env_ints(GEMV_ENV[name], names) if name in GEMV_ENV else None
    if tile is not None:  # decode-step sweeps (bench/step_variants.py)
        cfg.update(zip(names.split(","), tile))
    return cfg


def prefill_configs(device: torch.device, act_bytes: int = 2) -> dict:
    """Tiles of the prefill (T > 16) grouped kernels: ``{"gate_up": cfg, "down": cfg, "max_block_m": n}``.

    ``act_bytes``: activation element size (fp32 tiles need twice the shared memory, so they keep
    GPU_CONFIG's). ``EMBER_MOE_PREFILL_TILE`` overrides parts, for sweeps (read per call), e.g.
    ``gate_up=128,64,8,4;down=256,64,8,3;max_block_m=64`` (tile fields: BLOCK_N, BLOCK_K, num_warps,
    num_stages; max_block_m a power of 2 from 16 to 128).
    """
    if device.type == "cuda" and act_bytes <= 2 and _large_smem(device):
        cfgs = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GPU_PREFILL_LARGE_SMEM.items()}
    else:
        tile = _config("grouped_prefill", device)
        cfgs = {"gate_up": tile, "down": dict(tile), "max_block_m": 128}
    for part in filter(None, (p.strip() for p in os.environ.get(PREFILL_TILE_ENV, "").split(";"))):
        key, _, value = part.partition("=")
        key = key.strip()
        if key in ("gate_up", "down"):
            tile = dict(zip(_TILE_FIELDS.split(","), parse_ints(f"{PREFILL_TILE_ENV} {key}", value, _TILE_FIELDS)))
            if SCALE_BLOCK % tile["BLOCK_K"] or tile["BLOCK_K"] < 16 or tile["BLOCK_N"] & (tile["BLOCK_N"] - 1):
                raise ValueError(f"{PREFILL_TILE_ENV} {key}: BLOCK_K must be 16, 32, 64 or 128 (a K slice sits "
                                 f"inside one 128-wide scale block) and BLOCK_N a power of 2, got {value!r}")
            cfgs[key] = tile
        elif key == "max_block_m" and value.strip() in ("16", "32", "64", "128"):
            cfgs[key] = int(value)
        else:
            raise ValueError(f"{PREFILL_TILE_ENV}: expected 'gate_up=BN,BK,warps,stages', 'down=...' or "
                             f"'max_block_m=16|32|64|128' parts separated by ';', got {part!r}")
    return cfgs


# tile overrides for decode-step sweeps: the v1 T=1 GEMVs and the 2..16-token grouped kernels
GEMV_ENV = {"gemv_gate_up": "EMBER_MOE_GATE_UP_TILE", "gemv_down": "EMBER_MOE_DOWN_TILE",
            "grouped_decode": "EMBER_MOE_GROUPED_DECODE_TILE"}


def _scale_args(weight: torch.Tensor, scale: torch.Tensor | None):
    """(mode, tensor, stride_e, stride_n, stride_k) for a validated scale."""
    if weight.dtype != FP8 or scale is None:
        return NO_SCALE, weight, 0, 0, 0
    if scale.dim() == 2:
        return ROW_SCALE, scale, scale.stride(0), scale.stride(1), 0
    return BLOCK_SCALE, scale, scale.stride(0), scale.stride(1), scale.stride(2)


def _sub_k(mode: int, block_k: int) -> int:
    return min(block_k, SCALE_BLOCK) if mode == BLOCK_SCALE else block_k


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    T, E = router_logits.shape
    logits = _rows_contiguous(router_logits)
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, w, ids, E, logits.stride(0), TOP_K=top_k, RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_KK=triton.next_power_of_2(top_k),
                            num_warps=1 if E <= 256 else 4)
    return w, ids


ROUTER_MAX_TOKENS = 64
ADD_NORM_MAX_HIDDEN = 4096  # route_hidden's add_norm: one K block of the row on the GPU


def route_hidden(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
                 scoring: str = "softmax", expert_bias: torch.Tensor | None = None, scaling: float = 1.0,
                 shared_expert_gate: bool = False, add_norm: tuple | None = None):
    """Routing straight from hidden states ``x [T, H]`` and the router weight ``[E, H]``, T <= 64.

    One launch instead of a router GEMV (cuBLAS) plus the route kernel: at batch-1 decode each
    launch costs ~2 us inside a CUDA graph, and the 128 x 2048 router (0.5 MB) is too small for
    cuBLAS to stream fast. 2 router rows per program (64 programs per token at E = 128), so the
    0.5 MB is read by many SMs at once.

    ``add_norm = (residual, norm_weight, eps, normed_out, new_residual_out)`` (contiguous [T, H]
    rows): route from ``add_rmsnorm(x, residual, norm_weight, eps)`` instead of x, writing its two
    outputs too (one launch fewer per decoder layer).
    """
    x = _rows_contiguous(x)
    T, H = x.shape
    E = router.shape[0]
    n_out = top_k + int(shared_expert_gate)
    w = torch.empty((T, n_out), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, n_out), dtype=torch.int32, device=x.device)
    if T == 0:
        return w, ids
    if T > ROUTER_MAX_TOKENS:
        raise ValueError(f"x: route_hidden takes at most {ROUTER_MAX_TOKENS} tokens, got {T}")
    logits = torch.empty((T, E), dtype=torch.float32, device=x.device)
    # H200 profile of a first version (4 rows x 512-wide K steps per program, 32 programs): 6.85 us
    # per call against ~3.6 us for the route kernel alone: each program's 4 K steps were 4 serial
    # memory round trips. Now the whole K range (up to 4096) is one load per program, 2 rows each.
    # A top-k by parallel rank counting (one [E, E] compare-and-count instead of the 8 dependent
    # max/argmin reductions) measured no faster in the decode step (2.734 vs 2.727 ms), so the
    # serial picks stay.
    # 4 router rows per program from 128 experts on (32 programs a token): H200 Qwen3-30B-A3B decode
    # step 2.365 vs 2.389 ms at batch 1, 7.64 vs 7.68 at batch 8 (step_tiles_b1/b8.json; 1 or 2 rows,
    # 2 or 8 warps were slower); fewer experts (LFM2's 32) keep 2 rows (not re-measured)
    block_r, warps = env_ints("EMBER_ROUTER_TILE", "BLOCK_R,num_warps") or ((4 if E >= 128 else 2), 4)
    block_h = min(4096 if x.device.type == "cuda" else 32, triton.next_power_of_2(H))
    n_prog = triton.cdiv(E, block_r)
    bias = expert_bias.float().contiguous() if expert_bias is not None else logits
    res, lnw, eps, normed, new_res = add_norm if add_norm is not None else (x, x, 0.0, x, x)
    _router_route_kernel[(T, n_prog)](
        x, router.contiguous(), logits, arrival_counters("moe_router", x.device, T), w, ids, bias, float(scaling),
        E, H, x.stride(0), n_prog, res, lnw, normed, new_res, float(eps),
        TOP_K=top_k, RENORM=renormalize, SIGMOID=scoring == "sigmoid",
        HAS_BIAS=expert_bias is not None, SHARED_GATE=shared_expert_gate, BLOCK_R=block_r, BLOCK_H=block_h,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_KK=triton.next_power_of_2(n_out), ADD_NORM=add_norm is not None,
        PACKED=os.environ.get("EMBER_ROUTER_PACKED_TOPK", "1") != "0", EARLY=early_loads("router"), num_warps=warps,
        **pdl_options(x.device))
    return w, ids


@triton.jit
def _align_ids(ids_ptr, c, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Chunk ``c``'s expert ids; pairs past P (and ids outside [0, E)) become BLOCK_E."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=BLOCK_E)
    return tl.where((e >= 0) & (e < E), e, BLOCK_E)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    # counts[c, e]: pairs of chunk c that chose expert e
    c = tl.program_id(0)
    e = _align_ids(ids_ptr, c, P, E, CHUNK, BLOCK_E)
    outside = tl.sum((e == BLOCK_E).to(tl.int32), axis=0)
    bins = tl.arange(0, BLOCK_E)
    hist = tl.histogram(tl.where(e == BLOCK_E, 0, e), BLOCK_E) - tl.where(bins == 0, outside, 0)
    tl.store(counts_ptr + c * BLOCK_E + bins, hist)


@triton.jit
def _align_plan_kernel(counts_ptr, offset_ptr, sorted_pairs_ptr, block_expert_ptr, n_chunks, P, E, n_slots,
                       n_blocks, BLOCK_M: tl.constexpr, NCH: tl.constexpr, BLOCK_E: tl.constexpr,
                       FILL: tl.constexpr, FILL_B: tl.constexpr):
    # One program: each expert's padded run (start, end) in the sorted list; offset[c, e] = where
    # chunk c's first pair of expert e goes, minus that pair's position in the chunk sorted by expert;
    # padding slots = P; block -> expert (-1 past the end).
    ch = tl.arange(0, NCH)[:, None]
    ex = tl.arange(0, BLOCK_E)[None, :]
    cnt = tl.load(counts_ptr + ch * BLOCK_E + ex, mask=ch < n_chunks, other=0)
    padded = (tl.sum(cnt, axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    earlier_chunks = tl.cumsum(cnt, axis=0) - cnt
    lower_experts = tl.cumsum(cnt, axis=1) - cnt
    tl.store(offset_ptr + ch * BLOCK_E + ex, (pad_end - padded)[None, :] + earlier_chunks - lower_experts,
             mask=ch < n_chunks)
    for s0 in range(0, n_slots, FILL):
        slots = s0 + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + slots, tl.zeros([FILL], dtype=tl.int32) + P, mask=slots < n_slots)
    for b0 in range(0, n_blocks, FILL_B):
        blocks = b0 + tl.arange(0, FILL_B)
        # the experts whose padded runs end at or before the block's start (a searchsorted)
        e_of = tl.sum((pad_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(e_of < E, e_of, -1), mask=blocks < n_blocks)


@triton.jit
def _align_scatter_kernel(ids_ptr, offset_ptr, sorted_pairs_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    # chunk c sorted by (expert, pair index), the stable order; position j goes to offset[c, e] + j
    c = tl.program_id(0)
    j = tl.arange(0, CHUNK)
    key = tl.sort(_align_ids(ids_ptr, c, P, E, CHUNK, BLOCK_E) * CHUNK + j)
    e = key // CHUNK
    ok = e < BLOCK_E
    dest = tl.load(offset_ptr + c * BLOCK_E + e, mask=ok, other=0) + j
    tl.store(sorted_pairs_ptr + dest, c * CHUNK + key % CHUNK, mask=ok)


# Experts up to which _align runs the three kernels above (the plan's [chunks, experts] tile in one
# program); more take the torch ops (_align_torch). The torch form is ~20 small launches a layer; H200
# Qwen3-30B-A3B 2048-token prefill, same run: captured 35.29 ms torch vs 31.64 kernels
# (bench/results/h200/prefill_variants_align.json), eager 8 layers 10.97 vs 7.50 ms (eager_prefill_probe.txt).
ALIGN_MAX_EXPERTS = 256


def _align_chunk(P: int, device: torch.device) -> int:
    """Pairs per program of the align kernels: at most 64 chunks (the plan's tile), 1k-16k pairs each
    on the GPU; on the CPU (interpreter tests) small chunks so that several run."""
    if device.type != "cuda":
        return max(16, triton.next_power_of_2(-(-P // 4)))
    return min(1 << 14, max(1 << 10, triton.next_power_of_2(-(-P // 16))))


def _align_blocks(P: int, E: int, block_m: int) -> int:
    """Blocks of the sorted pair list: the bound ceil((P + min(E, P) * (block_m - 1)) / block_m)."""
    return -(-(P + min(E, P) * (block_m - 1)) // block_m)


def _align(topk_ids: torch.Tensor, E: int, block_m: int):
    """Sort the (token, expert) pairs by expert and pad each expert's run to whole blocks of block_m.

    Returns ``sorted_pairs [n_blocks * block_m]`` (pair index t*k+j, or T*k for padding) and
    ``block_expert [n_blocks]`` (-1 for blocks past the end). n_blocks is the bound
    ceil((P + min(E, P) * (block_m - 1)) / block_m), fixed by the shapes, so all of this is device work
    without syncs (capturable). Within an expert the pairs keep their order (as a stable sort).
    ``EMBER_MOE_ALIGN=torch`` takes the torch ops (A/B).
    """
    P = topk_ids.numel()
    chunk = _align_chunk(P, topk_ids.device)
    n_chunks = -(-P // chunk)
    env = os.environ.get("EMBER_MOE_ALIGN", "triton")
    if env not in ("triton", "torch"):
        raise ValueError(f"EMBER_MOE_ALIGN: expected 'triton' or 'torch', got {env!r}")
    if env == "torch" or E > ALIGN_MAX_EXPERTS or n_chunks > 64:
        return _align_torch(topk_ids, E, block_m)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n_blocks = _align_blocks(P, E, block_m)
    block_e = triton.next_power_of_2(E)
    counts = torch.empty((n_chunks, block_e), dtype=torch.int32, device=dev)
    offset = torch.empty_like(counts)
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    _align_count_kernel[(n_chunks,)](ids, counts, P, E, CHUNK=chunk, BLOCK_E=block_e, num_warps=8)
    gpu = dev.type == "cuda"
    _align_plan_kernel[(1,)](counts, offset, sorted_pairs, block_expert, n_chunks, P, E, n_blocks * block_m, n_blocks,
                             BLOCK_M=block_m, NCH=triton.next_power_of_2(n_chunks), BLOCK_E=block_e,
                             FILL=4096 if gpu else 64, FILL_B=max(1, (8192 if gpu else 256) // block_e), num_warps=8)
    _align_scatter_kernel[(n_chunks,)](ids, offset, sorted_pairs, P, E, CHUNK=chunk, BLOCK_E=block_e, num_warps=8)
    return sorted_pairs, block_expert, n_blocks


def _align_torch(topk_ids: torch.Tensor, E: int, block_m: int):
    """:func:`_align` in torch ops (more experts than ALIGN_MAX_EXPERTS, and the A/B)."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    n_blocks = _align_blocks(P, E, block_m)
    sorted_e, order = torch.sort(flat.to(_sort_key_dtype(E)), stable=True)
    sorted_e = sorted_e.long()
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (pad_end - padded)[sorted_e] + rank
    sorted_pairs = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert, n_blocks


def _sort_key_dtype(E: int) -> torch.dtype:
    """The narrowest integer dtype holding expert ids < E, for _align_torch's sort: the GPU radix sort
    takes one pass per key byte (int64 ids: 8 passes, ~47 us a layer at 2048 Qwen3-30B-A3B tokens; one
    byte: ~8 us). ``EMBER_MOE_SORT_KEYS=int64`` keeps the ids' own width (A/B)."""
    env = os.environ.get("EMBER_MOE_SORT_KEYS", "narrow")
    if env not in ("narrow", "int64"):
        raise ValueError(f"EMBER_MOE_SORT_KEYS: expected 'narrow' or 'int64', got {env!r}")
    if env == "int64":
        return torch.int64
    return torch.uint8 if E <= 256 else torch.int16 if E <= 1 << 15 else torch.int32


def _pair_rows_dtype(x: torch.Tensor, decode: bool) -> torch.dtype:
    """dtype of the grouped path's weighted per-(token, expert) rows, which the combine sums in float32.

    Prefill: the activation dtype (each row rounded once, as transformers rounds every expert's
    output, before a float32 sum). The float32 rows are T x top_k x H x 4 bytes (134 MB a layer at
    2048 Qwen3-30B-A3B tokens), written and read once more: H200 2048-token prefill, same run
    (bench/prefill_variants.py, bench/results/h200/prefill_variants.json): 36.92 ms float32 vs 34.87
    activation dtype. Decode (2-16 tokens) keeps float32 (at most 1 MB). ``EMBER_MOE_PAIR_ROWS=fp32``
    keeps float32 for prefill too."""
    env = os.environ.get("EMBER_MOE_PAIR_ROWS", "act")
    if env not in ("act", "fp32"):
        raise ValueError(f"EMBER_MOE_PAIR_ROWS: expected 'act' or 'fp32', got {env!r}")
    return torch.float32 if decode or env == "fp32" else x.dtype


def _prefill_block_m(T: int, top_k: int, E: int, max_block_m: int = 128) -> int:
    # One block per expert for most experts keeps the weights read once: size blocks for ~1.5x the
    # mean number of tokens an expert receives.
    mean = T * top_k / E
    return int(min(max_block_m, max(16, triton.next_power_of_2(int(1.5 * mean) + 1))))


def _down_split(cfg: dict, top_k: int, fp8: bool) -> int:
    """Expert groups of a T = 1 down GEMV (its launch config's SPLIT / SPLIT_FP8): programs per (token,
    row block), each summing top_k / SPLIT experts. ``EMBER_MOE_DOWN_SPLIT`` (1, 2, 4 or 8)
    overrides it; a split that does not divide top_k falls back to 1.
    H200 Qwen3-30B-A3B decode step, fp8 v2 (bench/results/h200/step_variants_down_split*.json, two
    runs): 2.07 ms unsplit, 2.05 split 2, 1.94 split 4, 1.98 split 8: 128 programs of 4 warps (one
    per SM) each streamed 16 rows of all 8 experts in turn; 512 spread the 12.6 MB over more warps.
    bf16 with v2 got slower (2.41 -> 2.51 ms at 4), and so did bf16's v1 down GEMV (1,024 programs of
    2 warps already): 2.29 -> 2.56 ms at 2 or 4 (step_variants_v1_split_router_bf16.json)."""
    env = os.environ.get("EMBER_MOE_DOWN_SPLIT")
    if env is not None and env not in ("1", "2", "4", "8"):
        raise ValueError(f"EMBER_MOE_DOWN_SPLIT: expected 1, 2, 4 or 8, got {env!r}")
    split = int(env) if env is not None else cfg["SPLIT_FP8" if fp8 else "SPLIT"]
    return split if top_k % split == 0 else 1


def _split_buffers(cfg: dict, T: int, H: int, n_blocks: int, top_k: int, w_down: torch.Tensor, dummy: torch.Tensor):
    """(split, fp32 partials [T, split, H], arrival counters) of a down GEMV launch; dummies unsplit."""
    split = _down_split(cfg, top_k, w_down.element_size() == 1)
    if split == 1:
        return 1, dummy, dummy
    return split, torch.empty((T, split, H), dtype=torch.float32, device=w_down.device), \
        arrival_counters("moe_down_split", w_down.device, T * n_blocks)


def _fold_args(fold, out, early: bool):
    """Kernel arguments of the down GEMVs' FOLD epilogue: (residual, norm weight, scaled out) or dummies.

    ``early``: load the residual and norm weight before waiting for gate_up. H200 Qwen3-30B-A3B decode
    step, same run: v1 (bf16) 2.30 ms early vs 2.27 after the wait (its pre-wait section already loads
    ids and the first weight tile); v2 (fp8) 2.02 early vs 2.06. EMBER_MOE_FOLD_EARLY=0/1 overrides."""
    env = os.environ.get("EMBER_MOE_FOLD_EARLY")
    early = early if env is None else env != "0"
    return dict(FOLD=fold is not None, FOLD_EARLY=early), (fold if fold is not None else (out, out, out))


def _experts_gemv(x, w_gate_up, w_down, gs, ds, ids, tw, logits, top_k, renormalize, out, fold=None):
    """T == 1 path (also correct for any T, one pair per program). ``logits`` set -> routing fused in.
    ``fold = (residual, norm_weight, scaled)``: see _store_out_or_fold."""
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)
    cfg = _config("gemv_gate_up", x.device)
    mode, gs_t, gse, gsn, gsk = _scale_args(w_gate_up, gs)
    fused = logits is not None
    bn, bk = cfg["BLOCK_N"], _sub_k(mode, cfg["BLOCK_K"])
    _gate_up_gemv_kernel[(T * top_k, triton.cdiv(I, bn))](
        x, w_gate_up, gs_t, logits if fused else x, ids, tw, h, E, x.stride(0),
        logits.stride(0) if fused else 0, *w_gate_up.stride(), gse, gsn, gsk, H=H, I=I,
        TOP_K=top_k, FUSED_ROUTE=fused, RENORM=renormalize, SCALE=mode, BLOCK_E=triton.next_power_of_2(E),
        BLOCK_KK=triton.next_power_of_2(top_k), BLOCK_N=bn, BLOCK_K=bk, UNROLL=cfg["UNROLL"],
        num_warps=cfg["num_warps"], **pdl_options(x.device))
    cfg = _config("gemv_down", x.device)
    mode, ds_t, dse, dsn, dsk = _scale_args(w_down, ds)
    bn, bk = cfg["BLOCK_N"], _sub_k(mode, cfg["BLOCK_K"])
    fold_kw, fold_ptrs = _fold_args(fold, out, early=False)
    nb = triton.cdiv(H, bn)
    split, part, cnt = _split_buffers(cfg, T, H, nb, top_k, w_down, h)
    _down_gemv_kernel[(T, nb, split)](
        h, w_down, ds_t, ids, tw, out, out.stride(0), *w_down.stride(), dse, dsn, dsk, *fold_ptrs, part, cnt, H=H,
        I=I, TOP_K=top_k, SCALE=mode, BLOCK_N=bn, BLOCK_K=bk, UNROLL=cfg["UNROLL"], SPLIT=split,
        num_warps=cfg["num_warps"], IDS_BEFORE=not fused and os.environ.get("EMBER_MOE_DOWN_PREFETCH", "1") != "0",
        **fold_kw, **pdl_options(x.device))
    return out


def t1_variant(device: torch.device, fp8: bool = False) -> str:
    """Which T=1 GEMV kernels run: "v1" or "v2" (on the GPU: v1 for 2-byte weights, v2 for fp8; on
    the CPU v1, also FUSED_ROUTE's).

    EMBER_MOE_T1 (``v1``, ``v2``, or ``v2,gu_warps,gu_rows,dn_warps,dn_rows`` for sweeps) overrides
    GPU_CONFIG / CPU_CONFIG["moe_t1"]; it is read per call (so also while capturing a graph).
    """
    env = os.environ.get("EMBER_MOE_T1")
    if env:
        name, *fields = env.split(",")
        if name not in ("v1", "v2") or (fields and (name != "v2" or len(fields) != 4
                                                    or not all(f.strip().isdigit() for f in fields))):
            raise ValueError(f"EMBER_MOE_T1: expected 'v1', 'v2' or 'v2,gu_warps,gu_rows,dn_warps,dn_rows', "
                             f"got {env!r}")
        return name
    return _config("moe_t1", device)["GEMV_FP8" if fp8 else "GEMV"]


def _t1_v2_config(name: str, weight: torch.Tensor, K: int) -> dict:
    """BLOCK_N, LANES, VEC, num_warps of the v2 T=1 kernels for weight ``[E, N, K]``.

    Why v2 (from the sm_90 PTX/SASS of the v1 kernels, triton 3.6, Qwen3-30B-A3B: H=2048, I=768, k=8;
    written before it ran on the GPU, measured results below). Floor: 8 x 3 x 2048 x 768 weights =
    75.5 MB bf16 -> 18.2 us, 37.7 MB fp8 -> 9.1 us (measured v1: 28.3 and 31.9 us). v1 loads the weight tiles straight into registers (16-byte
    LDG.128; 8-byte LDG.64 for fp8 with 128x128 block scales, BLOCK_K=128), but the activation
    slice of every K step (x or h, a 1-D load) is converted to the tile's layout through shared
    memory: st.shared, bar.sync, ld.shared, bar.sync per step, 8 steps in gate_up, 24 in down (48 with
    block scales: 97 bar.sync and 385 scalar LDS.U16 in the SASS). The SASS issues step s+1's
    activation load only after step s's barrier, and the STS that follows waits for it, so each
    program is a chain of 8 (gate_up) / 24-48 (down) dependent L2 round trips with one step's weight
    loads (2 x 16 B per thread) in flight. That latency does not shrink with the weight bytes, which
    is why fp8 (half the bytes) measured no faster than bf16. Down also runs only 256 programs of 4
    warps (174 registers in bf16: 2 CTAs/SM) on 132 SMs. SASS instructions per weight byte per
    thread, v1: bf16 2.1 (gate_up) / 2.5 (down), fp8 row 4.4 / 7.4 (down multiplies every product by
    the row scale: 768 FMUL), fp8 block 5.7 / 8.3; an SM must take ~16 B/clk at 4.15 TB/s (1.98 GHz),
    so 7.4-8.3 instructions per byte is ~120-130 of the 128 thread-instructions an SM issues per clock.

    v2 (same tools and shapes): x / h are loaded in the weight tile's layout (16 B vectors; the other
    warps' copies hit L1), the whole K range (in down, all k experts too) is straight-line code with
    independent loads, the routing weight and row scale multiply a [BLOCK_N, LANES] partial sum once
    per expert, block scales one in-thread sum of VEC products (lane order within a step permuted so
    that the scale load keeps the sums' layout; see _v2_k_offsets). PTX/SASS, gate_up / down: 1 / 1
    bar.sync per program (the final store; shuffles only in the final reduction), all weight and
    activation loads LDG.128, no spills; registers bf16 104 / 56, fp8 row 66 / 72, fp8 block 44 / 64;
    SASS instructions per weight byte per thread bf16 2.4 / 3.0, fp8 row 4.8 / 5.4, fp8 block 4.8 /
    5.3 (the fp8 cost is the e4m3 -> fp32 conversion, F2FP + 2 HADD2 per 2 weights, and the FFMA);
    grids 1536 programs of 4 warps (4 rows) / 512 of 4 (bf16, 4 rows) or 256 of 4 (fp8: 16 lanes x 16 B
    = 256 of I = 768 per step, 8 rows). Expected, NOT measured: both GEMVs bandwidth-bound instead of
    latency-bound, i.e. T=1 bf16 ~21-23 us and fp8 ~12-15 us per layer (fp8 needs ~5 instructions x
    16 B/clk = ~80 of the 128 issue slots at the floor rate; the route kernel and the gaps between the
    three launches, ~3-4 us, stay). Known leftover: with 128-wide K steps (BPS == 1, e.g. fp8 I=96)
    the block-scale load still takes a shared-memory conversion per step (10 bar.sync at H=256, I=96).
    Measured (H200, ``ember.bench.moe_ops.sweep()``, us per layer, graph-timed over 48 layers' weights):
    bf16 v2 27.6 (gate_up 4 warps x 2 rows, down 4 x 1) vs v1 28.4 vs floor 18.2; fp8 row 20.6 (4 x 2,
    4 x 2) vs v1 29.2 vs floor 9.1; fp8 128-block 21.2 vs floor 9.1. So the fp8 kernels lost the L2
    latency chain (-30%) but neither reaches the ~12-15 us expected: with 48 layers' weights rotating
    through L2, the remaining gap is probably the three launches (~2 us each in a graph) and the down GEMV's
    tail (256-512 programs on 132 SMs), not yet profiled; why bf16 gained only 3% is not understood.
    """
    cfg = _config(name, weight.device)
    if weight.element_size() == 1:
        cfg["ROWS"] = cfg["ROWS_FP8"]
    env = os.environ.get("EMBER_MOE_T1", "")
    if env.startswith("v2,"):
        gw, gr, dw, dr = (int(v) for v in env.split(",")[1:5])
        if name == "gemv_v2_gate_up":
            cfg.update(num_warps=gw, ROWS=gr)
        else:
            cfg.update(num_warps=dw, ROWS=dr)
    vec = 16 // weight.element_size()  # 16 bytes of weight per thread and vector; divides 128 (block scales)
    lanes = cfg["LANES"]
    if lanes is None:  # the widest K step that divides K, so no lane is masked off
        lanes = next((n for n in (32, 16, 8) if K % (n * vec) == 0), 32)
        lanes = min(lanes, max(1, triton.next_power_of_2(-(-K // vec))))
    rows_per_warp = max(1, 32 // lanes)
    block_n = cfg["num_warps"] * rows_per_warp * cfg["ROWS"]
    if block_n & (block_n - 1):
        raise ValueError(f"{name}: expected warps x rows per program to be a power of 2, got "
                         f"num_warps={cfg['num_warps']}, ROWS={cfg['ROWS']}")
    return dict(BLOCK_N=block_n, LANES=lanes, VEC=vec, BPS=max(1, lanes * vec // SCALE_BLOCK),
                num_warps=cfg["num_warps"], **{k: cfg[k] for k in ("SPLIT", "SPLIT_FP8") if k in cfg})


def _v2_down_prefetch() -> int:
    """``EMBER_MOE_V2_DOWN_PREFETCH``: what the v2 down GEMV loads before its dependent-launch wait
    (0 nothing; 1 its ids and routing weights, the default; 2 those and its first weight tile).
    H200 Qwen3-30B-A3B fp8 decode step at a 400 cache, same run (step_variants_one_launch_fp8.json):
    0 1.941-1.956 ms, 1 1.903-1.917, 2 1.912-1.923.
    Read per call (so also while a graph is captured)."""
    env = os.environ.get("EMBER_MOE_V2_DOWN_PREFETCH", "1")
    if env not in ("0", "1", "2"):
        raise ValueError(f"EMBER_MOE_V2_DOWN_PREFETCH: expected 0, 1 or 2, got {env!r}")
    return int(env)


def _experts_gemv_v2(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out, fold=None):
    T, H = x.shape
    I = w_down.shape[2]
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)
    cfg = _t1_v2_config("gemv_v2_gate_up", w_gate_up, H)
    mode, gs_t, gse, gsn, gsk = _scale_args(w_gate_up, gs)
    _gate_up_gemv_v2_kernel[(T * top_k, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w_gate_up, gs_t, ids, h, x.stride(0), *w_gate_up.stride(), gse, gsn, gsk, H=H, I=I, TOP_K=top_k,
        SCALE=mode, BLOCK_N=cfg["BLOCK_N"], LANES=cfg["LANES"], VEC=cfg["VEC"], BPS=cfg["BPS"],
        num_warps=cfg["num_warps"], num_stages=1, **pdl_options(x.device))
    cfg = _t1_v2_config("gemv_v2_down", w_down, I)
    mode, ds_t, dse, dsn, dsk = _scale_args(w_down, ds)
    fold_kw, fold_ptrs = _fold_args(fold, out, early=True)
    nb = triton.cdiv(H, cfg["BLOCK_N"])
    split, part, cnt = _split_buffers(cfg, T, H, nb, top_k, w_down, h)
    _down_gemv_v2_kernel[(T, nb, split)](
        h, w_down, ds_t, ids, tw, out, out.stride(0), *w_down.stride(), dse, dsn, dsk, *fold_ptrs, part, cnt,
        H=H, I=I, TOP_K=top_k, SCALE=mode, BLOCK_N=cfg["BLOCK_N"], LANES=cfg["LANES"], VEC=cfg["VEC"],
        BPS=cfg["BPS"], SPLIT=split, num_warps=cfg["num_warps"], num_stages=1, **fold_kw,
        PREFETCH=_v2_down_prefetch(), JPG_P2=triton.next_power_of_2(top_k // split), **pdl_options(x.device))
    return out


def _experts_grouped(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out=None, fold=None):
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    dev = x.device
    decode = T <= DECODE_MAX_TOKENS
    if decode:
        block_m, n_groups = 16, T * top_k
        sorted_pairs = block_expert = ids  # unused by the decode grouping
        cfg_gu = cfg_dn = _config("grouped_decode", dev)
    else:
        cfgs = prefill_configs(dev, x.element_size())
        cfg_gu, cfg_dn = cfgs["gate_up"], cfgs["down"]
        block_m = _prefill_block_m(T, top_k, E, cfgs["max_block_m"])
        sorted_pairs, block_expert, n_groups = _align(ids, E, block_m)
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=dev)
    # Not zeroed: prefill writes every pair's row; decode leaves the row of a token's repeated expert
    # unwritten (the first pair carries the summed weight) and the combine skips it (DEDUP). A zeroing
    # launch (T * top_k * H floats a layer) also broke the decode step's chain of dependent launches.
    pair_out = torch.empty((T * top_k, H), dtype=_pair_rows_dtype(x, decode), device=dev)
    pdl = pdl_options(dev) if os.environ.get("EMBER_MOE_GROUPED_PDL", "1") != "0" else {}
    # Triton 3.9's interpreter gets bf16 tl.dot wrong (garbage, seen on CPU), so off the GPU the dot
    # runs on float32 copies of the (exactly representable) operands.
    ieee = x.dtype == torch.float32 or dev.type != "cuda"
    common = dict(TOP_K=top_k, SORTED=not decode, IEEE=ieee, BLOCK_M=block_m,
                  BLOCK_KK=triton.next_power_of_2(top_k), **pdl)
    mode, gs_t, gse, gsn, gsk = _scale_args(w_gate_up, gs)
    _gate_up_grouped_kernel[(n_groups, triton.cdiv(I, cfg_gu["BLOCK_N"]))](
        x, w_gate_up, gs_t, ids, tw, sorted_pairs, block_expert, h, T, H, I, x.stride(0), *w_gate_up.stride(),
        gse, gsn, gsk, SCALE=mode, **cfg_gu, **common)
    mode, ds_t, dse, dsn, dsk = _scale_args(w_down, ds)
    _down_grouped_kernel[(n_groups, triton.cdiv(H, cfg_dn["BLOCK_N"]))](
        h, w_down, ds_t, ids, tw, sorted_pairs, block_expert, pair_out, T, H, I, *w_down.stride(),
        dse, dsn, dsk, SCALE=mode, **cfg_dn, **common)
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=dev)
    block = min(1024, triton.next_power_of_2(H))
    res, lnw, scaled = fold if fold is not None else (out, out, out)  # unused pointers without FOLD
    _combine_pairs_kernel[(T, triton.cdiv(H, block))](pair_out, out, H, res, lnw, scaled, ids, TOP_K=top_k,
                                                      BLOCK=block, FOLD=fold is not None, DEDUP=decode,
                                                      BLOCK_KK=triton.next_power_of_2(top_k), num_warps=4, **pdl)
    return out


def _check_block_k():
    for cfg in (GPU_CONFIG, CPU_CONFIG):
        for name in ("grouped_decode", "grouped_prefill"):
            # a K slice of the grouped kernels must sit inside one 128-wide scale block
            assert SCALE_BLOCK % cfg[name]["BLOCK_K"] == 0, (name, cfg[name])
    for name in ("gate_up", "down"):
        assert SCALE_BLOCK % GPU_PREFILL_LARGE_SMEM[name]["BLOCK_K"] == 0, (name, GPU_PREFILL_LARGE_SMEM)


def experts(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale):
    _check_block_k()
    x = _rows_contiguous(x)
    T, H = x.shape
    top_k = topk_ids.shape[1]
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    if T == 0:
        return torch.empty_like(x)
    if T == 1:
        out = torch.empty_like(x)
        if t1_variant(x.device, fp8=w_gate_up.element_size() == 1) == "v2":
            return _experts_gemv_v2(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, top_k, out)
        return _experts_gemv(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, None, top_k, True, out)
    rows = pair_rows_chunk(top_k, H)
    if T <= rows:
        return _experts_grouped(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, top_k)
    out = torch.empty_like(x)
    for t0 in range(0, T, rows):  # each chunk writes its rows of out (contiguous) directly
        part = slice(t0, t0 + rows)
        _experts_grouped(x[part], w_gate_up, w_down, gate_up_scale, down_scale, ids[part], tw[part], top_k, out[part])
    return out


def experts_add_scale(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale, residual,
                      norm_weight):
    """Up to DECODE_MAX_TOKENS tokens: (h, h * norm_weight) with h = experts(x) + residual
    (ops.moe_experts_add_scale): the T=1 down GEMV's epilogue, or the grouped path's combine."""
    _check_block_k()
    x = _rows_contiguous(x)
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    h, scaled = torch.empty_like(x), torch.empty_like(x)
    fold = (residual.contiguous(), norm_weight.contiguous(), scaled)
    if x.shape[0] > 1:
        _experts_grouped(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, ids.shape[1], h, fold)
    elif t1_variant(x.device, fp8=w_gate_up.element_size() == 1) == "v2":
        _experts_gemv_v2(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, ids.shape[1], h, fold)
    else:
        _experts_gemv(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, None, ids.shape[1], True, h, fold)
    return h, scaled


# The grouped path's per-pair rows take up to T * top_k * H * 4 bytes (float32; half that in bf16;
# a 32k-token Qwen3-30B-A3B prompt: 2.1 GB); longer prompts run in token chunks that keep them under this (each chunk reads
# the expert weights again: ~0.3 ms a layer on the H200 for Qwen3-30B-A3B, against ~1.6 ms of
# compute for a 16k-token chunk).
PAIR_ROWS_BYTES = 1 << 30


def pair_rows_chunk(top_k: int, H: int) -> int:
    """Tokens per grouped-path chunk: the pair rows within PAIR_ROWS_BYTES (16384 tokens for top-8 of
    2048-wide rows), never fewer than the decode path's limit + 1."""
    return max(DECODE_MAX_TOKENS + 1, PAIR_ROWS_BYTES // (top_k * H * 4))


def moe(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale):
    x = _rows_contiguous(x)
    T = x.shape[0]
    fp8 = w_gate_up.element_size() == 1
    if T == 1 and _config("moe_t1", x.device)["FUSED_ROUTE"] and t1_variant(x.device, fp8) == "v1":
        logits = _rows_contiguous(router_logits)
        ids = torch.empty((1, top_k), dtype=torch.int32, device=x.device)
        tw = torch.empty((1, top_k), dtype=torch.float32, device=x.device)
        out = torch.empty_like(x)
        return _experts_gemv(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, logits, top_k,
                             renormalize, out)
    tw, ids = route(router_logits, top_k, renormalize)
    return experts(x, w_gate_up, w_down, tw, ids, gate_up_scale, down_scale)
