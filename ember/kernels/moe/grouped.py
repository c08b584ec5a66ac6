"""The grouped expert kernels (T >= 2): batched decode (2 <= T <= 16) and prefill (T > 16).

Decode: the program of pair (t, j) serves expert ``ids[t, j]`` if that pair is the expert's first
occurrence and exits otherwise, so each selected expert's weights are read once for all the tokens
routed to it; tokens are rows of a 16-row ``tl.dot`` (entry "grouped_decode"). Prefill: (token,
expert) pairs sorted by expert on the device (``align``), padded to blocks of BLOCK_M rows of one
expert; the same kernels run over the blocks (entries "prefill" / "prefill:large_smem",
``config.prefill_configs``). The down projection stores one weighted row per (token, expert) pair;
``_combine_pairs_kernel`` sums a token's rows in a fixed order and casts (no atomics: the same bits
every run). The two grouped kernels and the combine launch with dependent launch (H200 batch-8 step
7.446-7.475 -> 7.412-7.444 ms, step_variants_early_loads_b8.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start, round_to
from ember.kernels.moe import config
from ember.kernels.moe.align import align
from ember.kernels.moe.shared import block_scale_rows, fold_inputs, row_scale, silu_mul, store_out_or_fold


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
                pg *= block_scale_rows(scale_ptr, e, cols, col_mask, k0, stride_se, stride_sn, stride_sk)[None, :]
                pu *= block_scale_rows(scale_ptr, e, cols + I, col_mask, k0, stride_se, stride_sn, stride_sk)[None, :]
            acc_g += pg
            acc_u += pu
        if SCALE == 1:
            acc_g *= row_scale(scale_ptr, e, cols, col_mask, stride_se, stride_sn)[None, :]
            acc_u *= row_scale(scale_ptr, e, cols + I, col_mask, stride_se, stride_sn)[None, :]
        h = silu_mul(acc_g, acc_u)
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
                p *= block_scale_rows(scale_ptr, e, cols, col_mask, k0, stride_se, stride_sn, stride_sk)[None, :]
            acc += p
        if SCALE == 1:
            acc *= row_scale(scale_ptr, e, cols, col_mask, stride_se, stride_sn)[None, :]
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
    FOLD: as in the T=1 down GEMVs (out becomes the new residual, scaled_ptr gets it times lnw).
    DEDUP (decode grouping): a pair whose expert the token listed earlier is skipped (its weight went
    to the first such pair, and its row was never written), so pair_out needs no zeroing launch."""
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    r, lw = fold_inputs(res_ptr, lnw_ptr, t, cols, mask, H, FOLD, False)
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
    store_out_or_fold(acc, out_ptr, t, H, cols, mask, r, lw, scaled_ptr, H, FOLD)


# ----------------------------------------------------------------------------- launcher
def pair_rows_dtype(x: torch.Tensor, decode: bool) -> torch.dtype:
    """dtype of the weighted per-(token, expert) rows, which the combine sums in float32.

    Prefill: the activation dtype (each row rounded once, as transformers rounds every expert's
    output, before a float32 sum): float32 rows are T x top_k x H x 4 bytes (134 MB a layer at 2048
    Qwen3-30B-A3B tokens), written and read once more; H200 2048-token prefill 36.92 ms float32 vs
    34.87 (bench/results/h200/prefill_variants.json). Decode (2-16 tokens) keeps float32 (at most 1 MB)."""
    return torch.float32 if decode else x.dtype


def prefill_block_m(T: int, top_k: int, E: int, max_block_m: int = 128) -> int:
    # One block per expert for most experts keeps the weights read once: size blocks for ~1.5x the
    # mean number of tokens an expert receives.
    mean = T * top_k / E
    return int(min(max_block_m, max(16, triton.next_power_of_2(int(1.5 * mean) + 1))))


def experts_grouped(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out=None, fold=None):
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    dev = x.device
    decode = T <= config.DECODE_MAX_TOKENS
    if decode:
        block_m, n_groups = 16, T * top_k
        sorted_pairs = block_expert = ids  # unused by the decode grouping
        cfg_gu = cfg_dn = config.tiles("grouped_decode", dev)
    else:
        cfgs = config.prefill_configs(dev, x.element_size())
        cfg_gu, cfg_dn = cfgs["gate_up"], cfgs["down"]
        block_m = prefill_block_m(T, top_k, E, cfgs["max_block_m"])
        sorted_pairs, block_expert, n_groups = align(ids, E, block_m)
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=dev)
    # Not zeroed: prefill writes every pair's row; decode leaves the row of a token's repeated expert
    # unwritten (the first pair carries the summed weight) and the combine skips it (DEDUP). A zeroing
    # launch (T * top_k * H floats a layer) also broke the decode step's chain of dependent launches.
    pair_out = torch.empty((T * top_k, H), dtype=pair_rows_dtype(x, decode), device=dev)
    pdl = pdl_options(dev)
    # Triton 3.9's interpreter gets bf16 tl.dot wrong (garbage, seen on CPU), so off the GPU the dot
    # runs on float32 copies of the (exactly representable) operands.
    ieee = x.dtype == torch.float32 or dev.type != "cuda"
    common = dict(TOP_K=top_k, SORTED=not decode, IEEE=ieee, BLOCK_M=block_m,
                  BLOCK_KK=triton.next_power_of_2(top_k), **pdl)
    mode, gs_t, gse, gsn, gsk = config.scale_args(w_gate_up, gs)
    _gate_up_grouped_kernel[(n_groups, triton.cdiv(I, cfg_gu["BLOCK_N"]))](
        x, w_gate_up, gs_t, ids, tw, sorted_pairs, block_expert, h, T, H, I, x.stride(0), *w_gate_up.stride(),
        gse, gsn, gsk, SCALE=mode, **cfg_gu, **common)
    mode, ds_t, dse, dsn, dsk = config.scale_args(w_down, ds)
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


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
