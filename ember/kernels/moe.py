"""Triton kernels for the fused MoE ops (routing, SwiGLU experts); launch helpers take validated tensors.

Three paths, picked by the token count T (all capturable: no host syncs, shapes fixed by T, k, E):

* T == 1, the decode step of one sequence: ``_route_kernel``, ``_gate_up_gemv_kernel`` (SiLU*up
  fused), then ``_down_gemv_kernel`` (one program per block of output rows loops over the token's k
  experts and applies the routing weights, so the combine needs no atomics and no extra kernel).
  The gate_up GEMV can also recompute the routing itself (``moe_t1: FUSED_ROUTE``, saving a launch),
  but on the H200 that measured 30.6 us/layer against 28.2 us with the separate route kernel: the
  top-k reductions delay every program's first weight load.
* 2 <= T <= 16 (batched decode): the program of pair (t, j) serves expert ``ids[t, j]`` if that pair is
  the expert's first occurrence and exits otherwise, so each selected expert's weights are read once
  for all the tokens routed to it; tokens are rows of a 16-row ``tl.dot``. The down projection adds
  its weighted rows into a float32 buffer with atomics, cast once at the end.
* T > 16 (prefill): (token, expert) pairs sorted by expert on the device (``_align``), padded to
  blocks of BLOCK_M rows of one expert; the same grouped kernels run over the blocks.

FP8 weights are converted to the activation dtype in registers (exact for e4m3 in bf16/fp16/fp32);
row scales multiply the accumulator at the end, 128x128 block scales each 128-wide K slice.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._common import round_to

FP8 = torch.float8_e4m3fn
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2
SCALE_BLOCK = 128

# Launch configurations. GPU values: the best of a sweep on the H200 at Qwen3-30B-A3B shapes (T=1:
# 7 gate_up x 7 down GEMV configs, bf16 + fp8 time summed; T=16 / T=512: 5 configs each, all within
# ~5% of each other). The interpreter (CPU tests) uses small blocks so tiny shapes still exercise
# several K iterations and N blocks.
GPU_CONFIG = {
    "gemv_gate_up": dict(BLOCK_N=4, BLOCK_K=256, num_warps=2, UNROLL=True),
    "gemv_down": dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, UNROLL=True),
    "grouped_decode": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "grouped_prefill": dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    "moe_t1": dict(FUSED_ROUTE=False),  # routing inside the gate_up GEMV (else a route kernel first)
}
CPU_CONFIG = {
    "gemv_gate_up": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, UNROLL=True),
    "gemv_down": dict(BLOCK_N=16, BLOCK_K=16, num_warps=1, UNROLL=False),
    "grouped_decode": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1),
    "grouped_prefill": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1),
    "moe_t1": dict(FUSED_ROUTE=True),
}
DECODE_MAX_TOKENS = 16


# ============================================================================ routing
@triton.jit
def _topk_of_row(logits_ptr, row, stride_row, E, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr):
    """float32 softmax over E logits, then the TOP_K largest (ties -> lower index), renormalised."""
    offs = tl.arange(0, BLOCK_E)
    in_range = offs < E
    logits = tl.load(logits_ptr + row * stride_row + offs, mask=in_range, other=-float("inf")).to(tl.float32)
    ex = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(in_range, ex / tl.sum(ex, axis=0), -1.0)  # padding lanes are never picked
    kk = tl.arange(0, BLOCK_KK)
    ids = tl.zeros([BLOCK_KK], dtype=tl.int32)
    ws = tl.zeros([BLOCK_KK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        ids = tl.where(kk == j, idx, ids)
        ws = tl.where(kk == j, best, ws)
        p = tl.where(offs == idx, -2.0, p)
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
def _gate_up_gemv_kernel(x_ptr, w_ptr, scale_ptr, logits_ptr, ids_ptr, tw_ptr, h_ptr,
                         E, stride_x, stride_logits,
                         stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                         H: tl.constexpr, I: tl.constexpr,
                         TOP_K: tl.constexpr, FUSED_ROUTE: tl.constexpr, RENORM: tl.constexpr,
                         SCALE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """h[pair, n] = silu(gate[e] . x[t]) * (up[e] . x[t]) for one pair (t, j) and BLOCK_N of the I rows."""
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
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if SCALE == 1:
        g *= _row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn)
        u *= _row_scale(scale_ptr, e, rows + I, row_mask, stride_se, stride_sn)
    tl.store(h_ptr + pair * I + rows, round_to(_silu_mul(g, u), h_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _down_slice(acc, h_ptr, pair, weight, w_base, rows, row_mask, row_s, k0, scale_ptr, e,
                stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                I: tl.constexpr, SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < I
    hv = tl.load(h_ptr + pair * I + offs_k, mask=k_mask, other=0.0).to(tl.float32) * weight
    w = tl.load(w_base + rows[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    prod = w * hv[None, :]
    if SCALE == 1:
        prod *= row_s[:, None]
    if SCALE == 2:
        prod *= _block_scale_rows(scale_ptr, e, rows, row_mask, k0, stride_se, stride_sn, stride_sk)[:, None]
    return acc + prod


@triton.jit
def _down_gemv_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, out_ptr,
                      stride_out, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                      H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr):
    """out[t, n] = sum_j w[t, j] * down[e_j][n] . h[(t, j)] for BLOCK_N output rows; no atomics."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(tw_ptr + pair).to(tl.float32)
        w_base = w_ptr + e * stride_we
        row_s = rows.to(tl.float32)  # placeholder when there is no row scale
        if SCALE == 1:
            row_s = _row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn)
        if UNROLL:
            for k0 in tl.static_range(0, I, BLOCK_K):
                acc = _down_slice(acc, h_ptr, pair, weight, w_base, rows, row_mask, row_s, k0, scale_ptr, e,
                                  stride_wn, stride_wk, stride_se, stride_sn, stride_sk, I, SCALE, BLOCK_K)
        else:
            for k0 in range(0, I, BLOCK_K):
                acc = _down_slice(acc, h_ptr, pair, weight, w_base, rows, row_mask, row_s, k0, scale_ptr, e,
                                  stride_wn, stride_wk, stride_se, stride_sn, stride_sk, I, SCALE, BLOCK_K)
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + t * stride_out + rows, round_to(out, out_ptr.dtype.element_ty), mask=row_mask)


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
                            BLOCK_K: tl.constexpr):
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
def _down_grouped_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, sorted_pairs_ptr, block_expert_ptr, acc_ptr,
                         T, H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                         TOP_K: tl.constexpr, SORTED: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_KK: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
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
        tl.atomic_add(acc_ptr + tokens[:, None] * H + cols[None, :], acc,
                      mask=row_mask[:, None] & col_mask[None, :], sem="relaxed")


# ============================================================================ launch helpers
def _config(name: str, device: torch.device) -> dict:
    return dict((GPU_CONFIG if device.type == "cuda" else CPU_CONFIG)[name])


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


def _align(topk_ids: torch.Tensor, E: int, block_m: int):
    """Sort the (token, expert) pairs by expert and pad each expert's run to whole blocks of block_m.

    Returns ``sorted_pairs [n_blocks * block_m]`` (pair index t*k+j, or T*k for padding) and
    ``block_expert [n_blocks]`` (-1 for blocks past the end). n_blocks is the bound
    ceil((P + min(E, P) * (block_m - 1)) / block_m), fixed by the shapes, so all of this is device work
    without syncs (capturable).
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    n_blocks = -(-(P + min(E, P) * (block_m - 1)) // block_m)
    sorted_e, order = torch.sort(flat, stable=True)
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


def _prefill_block_m(T: int, top_k: int, E: int) -> int:
    # One block per expert for most experts keeps the weights read once: size blocks for ~1.5x the
    # mean number of tokens an expert receives.
    mean = T * top_k / E
    return int(min(128, max(16, triton.next_power_of_2(int(1.5 * mean) + 1))))


def _experts_gemv(x, w_gate_up, w_down, gs, ds, ids, tw, logits, top_k, renormalize, out):
    """T == 1 path (also correct for any T, one pair per program). ``logits`` set -> routing fused in."""
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
        num_warps=cfg["num_warps"])
    cfg = _config("gemv_down", x.device)
    mode, ds_t, dse, dsn, dsk = _scale_args(w_down, ds)
    bn, bk = cfg["BLOCK_N"], _sub_k(mode, cfg["BLOCK_K"])
    _down_gemv_kernel[(T, triton.cdiv(H, bn))](
        h, w_down, ds_t, ids, tw, out, out.stride(0), *w_down.stride(), dse, dsn, dsk, H=H, I=I,
        TOP_K=top_k, SCALE=mode, BLOCK_N=bn, BLOCK_K=bk, UNROLL=cfg["UNROLL"], num_warps=cfg["num_warps"])
    return out


def _experts_grouped(x, w_gate_up, w_down, gs, ds, ids, tw, top_k):
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    dev = x.device
    decode = T <= DECODE_MAX_TOKENS
    if decode:
        block_m, n_groups = 16, T * top_k
        sorted_pairs = block_expert = ids  # unused by the decode grouping
        cfg = _config("grouped_decode", dev)
    else:
        block_m = _prefill_block_m(T, top_k, E)
        sorted_pairs, block_expert, n_groups = _align(ids, E, block_m)
        cfg = _config("grouped_prefill", dev)
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=dev)
    acc = torch.zeros((T, H), dtype=torch.float32, device=dev)
    # Triton 3.9's interpreter gets bf16 tl.dot wrong (garbage, seen on CPU), so off the GPU the dot
    # runs on float32 copies of the (exactly representable) operands.
    ieee = x.dtype == torch.float32 or dev.type != "cuda"
    common = dict(TOP_K=top_k, SORTED=not decode, IEEE=ieee, BLOCK_M=block_m,
                  BLOCK_KK=triton.next_power_of_2(top_k), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    mode, gs_t, gse, gsn, gsk = _scale_args(w_gate_up, gs)
    _gate_up_grouped_kernel[(n_groups, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w_gate_up, gs_t, ids, tw, sorted_pairs, block_expert, h, T, H, I, x.stride(0), *w_gate_up.stride(),
        gse, gsn, gsk, SCALE=mode, **common)
    mode, ds_t, dse, dsn, dsk = _scale_args(w_down, ds)
    _down_grouped_kernel[(n_groups, triton.cdiv(H, cfg["BLOCK_N"]))](
        h, w_down, ds_t, ids, tw, sorted_pairs, block_expert, acc, T, H, I, *w_down.stride(),
        dse, dsn, dsk, SCALE=mode, **common)
    return acc if x.dtype == torch.float32 else acc.to(x.dtype)


def _check_block_k():
    for cfg in (GPU_CONFIG, CPU_CONFIG):
        for name in ("grouped_decode", "grouped_prefill"):
            # a K slice of the grouped kernels must sit inside one 128-wide scale block
            assert SCALE_BLOCK % cfg[name]["BLOCK_K"] == 0, (name, cfg[name])


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
        return _experts_gemv(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, None, top_k, True, out)
    return _experts_grouped(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, top_k)


def moe(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale):
    x = _rows_contiguous(x)
    T = x.shape[0]
    if T == 1 and _config("moe_t1", x.device)["FUSED_ROUTE"]:
        logits = _rows_contiguous(router_logits)
        ids = torch.empty((1, top_k), dtype=torch.int32, device=x.device)
        tw = torch.empty((1, top_k), dtype=torch.float32, device=x.device)
        out = torch.empty_like(x)
        return _experts_gemv(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, logits, top_k,
                             renormalize, out)
    tw, ids = route(router_logits, top_k, renormalize)
    return experts(x, w_gate_up, w_down, tw, ids, gate_up_scale, down_scale)
