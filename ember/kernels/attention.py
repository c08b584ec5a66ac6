"""Triton kernels for decode attention: fused q/k RMSNorm + RoPE + KV-cache write (alone, or behind the
qkv projection GEMV: opt-in; H200 Qwen3-30B-A3B decode step 3.24 ms with it vs 3.09 without, its
40 programs each stream a 512 KB head slab in serial K steps), and split-sequence attention over the
live part of a static cache followed by a combine (from 16 splits in the same launch, by the last live
split program of each (row, kv head); EMBER_ATTN_ONE_LAUNCH=0: a second launch). The split kernel can
also take q, k, v raw from the qkv projection and do the norm / RoPE / cache write itself (ROPE;
opt-in, measured slower: ARCHITECTURE.md)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels._common import arrival_counters, early_loads, env_ints, pdl_options, pdl_start, round_to


@triton.jit
def _qk_norm_rope_cache_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, q_ptr,
                               stride_qkv, stride_cos, skb, skh, sks, svb, svh, svs, eps,
                               pre_ptr, pre_eps, PRE_N, NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr,
                               PRENORM: tl.constexpr = False,
                               BLOCK_PRE: tl.constexpr = 16, PDL: tl.constexpr = False):
    # One program per (token row, head) for the NH query heads and KVH key heads; key-head programs
    # also copy that head's v. Row r is cache row r at positions[r] (prefill: _prefill_qk_norm_rope_kernel).
    # PRENORM (decode): qkv was projected from h * norm_weight (ops.moe_experts_add_scale); every
    # program computes 1 / rms(h) of its row (same code, same value) and scales q, k, v by it. h is
    # read before waiting for the previous kernel: it was written by the kernel before that (the
    # MoE down GEMV, ahead of the qkv projection), finished by now (see _common.pdl_start); volatile,
    # so no stale L1 line of an earlier layer's h (the same buffer address) is read.
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pre_scale = 1.0
    if PRENORM:
        pk = tl.arange(0, BLOCK_PRE)
        ss = tl.zeros([BLOCK_PRE], dtype=tl.float32)
        for k0 in range(0, PRE_N, BLOCK_PRE):
            hv = tl.load(pre_ptr + r * PRE_N + k0 + pk, mask=k0 + pk < PRE_N, other=0.0, volatile=True)
            ss += hv.to(tl.float32) * hv.to(tl.float32)
        pre_scale = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / PRE_N + pre_eps)
    pdl_start(PDL)
    HALF: tl.constexpr = D // 2
    offs = tl.arange(0, HALF)
    b = r
    pos = tl.load(pos_ptr + r).to(tl.int64)
    row = qkv_ptr + r * stride_qkv
    if h < NH:
        src = row + h * D
        w_ptr = qn_ptr
        dst = q_ptr + (r * NH + h) * D
    else:
        kvh = h - NH
        src = row + (NH + kvh) * D
        w_ptr = kn_ptr
        dst = kc_ptr + b * skb + kvh * skh + pos * sks
        v_offs = tl.arange(0, D)
        v = tl.load(row + (NH + KVH + kvh) * D + v_offs)
        if PRENORM:
            v = round_to(v.to(tl.float32) * pre_scale, vc_ptr.dtype.element_ty)
        tl.store(vc_ptr + b * svb + kvh * svh + pos * svs + v_offs, v)
    x1 = tl.load(src + offs).to(tl.float32)
    x2 = tl.load(src + HALF + offs).to(tl.float32)
    if PRENORM:
        x1 *= pre_scale
        x2 *= pre_scale
    inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    dt = q_ptr.dtype.element_ty
    # Round after the norm and round cos/sin, as the reference (and transformers) do in the I/O dtype.
    n1 = round_to(x1 * inv_rms * tl.load(w_ptr + offs).to(tl.float32), dt).to(tl.float32)
    n2 = round_to(x2 * inv_rms * tl.load(w_ptr + HALF + offs).to(tl.float32), dt).to(tl.float32)
    c = round_to(tl.load(cos_ptr + pos * stride_cos + offs), dt).to(tl.float32)
    s = round_to(tl.load(sin_ptr + pos * stride_cos + offs), dt).to(tl.float32)
    tl.store(dst + offs, round_to(n1 * c - n2 * s, dt))
    tl.store(dst + HALF + offs, round_to(n2 * c + n1 * s, dt))


def qk_norm_rope_cache(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, q_out, eps, prenorm_h=None,
                       prenorm_eps=0.0) -> None:
    """Decode: qkv [B, F], positions [B], q_out [B, NH, D]; prenorm_h [B, H] (contiguous) or None."""
    rows = qkv.shape[0]
    NH, D = q_out.shape[-2], q_out.shape[-1]
    KVH = k_cache.shape[1]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    pre = prenorm_h if prenorm_h is not None else qkv  # unused pointer without PRENORM
    # the whole row in one step on the GPU (2048 values: 64 per lane of the one warp)
    block_pre = min(4096 if qkv.device.type == "cuda" else 64, triton.next_power_of_2(pre.shape[-1]))
    _qk_norm_rope_cache_kernel[(rows, NH + KVH)](
        qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, q_out,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), eps, pre, float(prenorm_eps), pre.shape[-1],
        NH=NH, KVH=KVH, D=D, PRENORM=prenorm_h is not None, BLOCK_PRE=block_pre, num_warps=1,
        **pdl_options(qkv.device))


@triton.jit
def _prefill_qk_norm_rope_kernel(qkv_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, q_ptr, stride_qkv,
                                 stride_cos, skb, skh, sks, svb, svh, svs, eps, T, n_rows,
                                 NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    # One program per (block of BLOCK_T token rows, head); row r is token r % T (its position) of cache
    # row r // T. Key-head programs also copy that head's v.
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.program_id(1)
    mask = (rows < n_rows)[:, None]
    b = (rows // T)[:, None]
    pos = (rows % T)[:, None]
    offs_d = tl.arange(0, D)
    src = qkv_ptr + rows[:, None] * stride_qkv
    cos_row, sin_row = cos_ptr + pos * stride_cos, sin_ptr + pos * stride_cos
    dt = q_ptr.dtype.element_ty
    if h < NH:
        out = _norm_rope_rows(src + h * D, mask, qn_ptr, cos_row, sin_row, offs_d, eps, D, dt, True)
        tl.store(q_ptr + (rows[:, None] * NH + h) * D + offs_d[None, :], out.to(dt), mask=mask)
    else:
        kvh = h - NH
        out = _norm_rope_rows(src + (NH + kvh) * D, mask, kn_ptr, cos_row, sin_row, offs_d, eps, D, dt, True)
        tl.store(kc_ptr + b * skb + kvh * skh + pos * sks + offs_d[None, :], out.to(kc_ptr.dtype.element_ty), mask=mask)
        v = tl.load(src + (NH + KVH + kvh) * D + offs_d[None, :], mask=mask)
        tl.store(vc_ptr + b * svb + kvh * svh + pos * svs + offs_d[None, :], v, mask=mask)


# Token rows per program of the prefill kernel (``EMBER_PREFILL_ROPE_TILE=BLOCK_T,num_warps`` overrides).
# One (token, head) per one-warp program (the decode kernel's grid: 82k programs of 128 values) took
# 89.6 us per Qwen3-30B-A3B layer at 2048 tokens on the H200 (bench/profile_llm.py), against a ~10 us
# floor (41 MB moved at 4.15 TB/s); 16-token blocks of 4 warps 29 us. 2048-token prefill, same run
# (bench/results/h200/prefill_variants.json): 16 x 4 36.92 ms, 32 x 4 37.11, 16 x 8 37.23, 8 x 2 37.61.
PREFILL_ROPE_ROWS = {"cuda": (16, 4), "cpu": (4, 1)}  # (BLOCK_T, num_warps)


def prefill_qk_norm_rope_cache(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, q_out, eps) -> None:
    """Prefill: qkv [B, T, F] at positions 0..T-1 of cache rows 0..B-1, q_out [B, T, NH, D]."""
    B, T, F = qkv.shape
    if qkv.stride(2) != 1 or qkv.stride(0) != T * qkv.stride(1):  # rows must be evenly spaced
        qkv = qkv.contiguous()
    flat = qkv.as_strided((B * T, F), (qkv.stride(1), 1))
    NH, D = q_out.shape[-2], q_out.shape[-1]
    KVH = k_cache.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    block_t, warps = (env_ints("EMBER_PREFILL_ROPE_TILE", "BLOCK_T,num_warps")
                      or PREFILL_ROPE_ROWS["cuda" if qkv.device.type == "cuda" else "cpu"])
    if block_t & (block_t - 1):
        raise ValueError(f"EMBER_PREFILL_ROPE_TILE: BLOCK_T must be a power of 2, got {block_t}")
    _prefill_qk_norm_rope_kernel[(triton.cdiv(B * T, block_t), NH + KVH)](
        flat, q_norm, k_norm, cos, sin, k_cache, v_cache, q_out, flat.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), eps, T, B * T, NH=NH, KVH=KVH, D=D, BLOCK_T=block_t, num_warps=warps)


@triton.jit
def _norm_rope_rows(src, mask, w_ptr, cos_row, sin_row, offs_d, eps, D: tl.constexpr, dt: tl.constexpr,
                    PER_ROW: tl.constexpr = False):
    """Rows ``src[r] + offs_d`` ([R, 1] pointers, [R, 1] mask) per-head RMSNormed and rotated (rotate-half
    RoPE at the position whose cos/sin rows are given; PER_ROW: [R, 1] pointers, one position per row),
    as fp32 values of the I/O dtype ``dt``: the math and roundings of _qk_norm_rope_cache_kernel in a
    [R, D] layout (each element's rotation partner loaded a second time instead of splitting the halves)."""
    HALF: tl.constexpr = D // 2
    rot = (offs_d + HALF) % D
    x = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(src + rot[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
    n = round_to(x * inv_rms * tl.load(w_ptr + offs_d).to(tl.float32)[None, :], dt).to(tl.float32)
    nr = round_to(xr * inv_rms * tl.load(w_ptr + rot).to(tl.float32)[None, :], dt).to(tl.float32)
    if PER_ROW:
        c = round_to(tl.load(cos_row + (offs_d % HALF)[None, :]), dt).to(tl.float32)
        s = round_to(tl.load(sin_row + (offs_d % HALF)[None, :]), dt).to(tl.float32)
    else:
        c = round_to(tl.load(cos_row + offs_d % HALF), dt).to(tl.float32)[None, :]
        s = round_to(tl.load(sin_row + offs_d % HALF), dt).to(tl.float32)[None, :]
    out = tl.where((offs_d < HALF)[None, :], n * c - nr * s, n * c + nr * s)
    return round_to(out, dt).to(tl.float32)


@triton.jit
def _kv_tile(base, offs_n, n_mask, stride, offs_d):
    return tl.load(base + offs_n[:, None].to(tl.int64) * stride + offs_d[None, :], mask=n_mask[:, None], other=0.0)


@triton.jit
def _online_block(q, k, v, offs_n, n_mask, m_i, l_i, acc, scale, pos, k_new, v_new, NEW_KV: tl.constexpr,
                  IEEE: tl.constexpr):
    """One block of the online softmax: (m_i, l_i, acc) after the positions offs_n (k, v tiles [BLOCK_N, D])."""
    k = k.to(tl.float32)
    v = v.to(tl.float32)
    if NEW_KV:
        k = tl.where((offs_n == pos)[:, None], k_new, k)
        v = tl.where((offs_n == pos)[:, None], v_new, v)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(n_mask[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_i, acc


@triton.jit
def _attend_blocks(q, kc_ptr, vc_ptr, part_ptr, lse_ptr, scale, skb, skh, sks, svb, svh, svs, b, kvh, split, length,
                   NH: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr,
                   NSPLIT: tl.constexpr, IEEE: tl.constexpr, pos, k_new, v_new, NEW_KV: tl.constexpr,
                   k_first, v_first, FIRST_LOADED: tl.constexpr):
    # Online softmax of the G heads (rows of q) over blocks split, split + NSPLIT, ... of BLOCK_N
    # positions below ``length``; stores the normalised partial and its log-sum-exp (-inf when empty).
    # NEW_KV: position ``pos`` takes k_new / v_new ([1, D] fp32) instead of the cache, which another
    # program of this launch is writing them into. FIRST_LOADED: block ``split``'s tiles are k_first,
    # v_first (loaded by the caller, masked to ``length``).
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    head = kvh * G + offs_g
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    k_base = kc_ptr + b * skb + kvh * skh
    v_base = vc_ptr + b * svb + kvh * svh
    start = split
    if FIRST_LOADED:
        if split * BLOCK_N < length:
            offs_n = split * BLOCK_N + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _online_block(q, k_first, v_first, offs_n, offs_n < length, m_i, l_i, acc, scale, pos,
                                          k_new, v_new, NEW_KV, IEEE)
        start = split + NSPLIT
    for blk in range(start, tl.cdiv(length, BLOCK_N), NSPLIT):
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < length
        k = _kv_tile(k_base, offs_n, n_mask, sks, offs_d)
        v = _kv_tile(v_base, offs_n, n_mask, svs, offs_d)
        m_i, l_i, acc = _online_block(q, k, v, offs_n, n_mask, m_i, l_i, acc, scale, pos, k_new, v_new, NEW_KV, IEEE)
    live = l_i > 0
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    lse = tl.where(live, m_i + tl.log(tl.where(live, l_i, 1.0)), float("-inf"))
    part_row = (b * NH + head) * NSPLIT + split  # part [B, NH, NSPLIT, D], lse [B, NH, NSPLIT]
    tl.store(part_ptr + part_row[:, None] * D + offs_d[None, :], out, mask=g_mask[:, None])
    tl.store(lse_ptr + part_row, lse, mask=g_mask)


@triton.jit
def _combine_live_splits(part_ptr, lse_ptr, out_ptr, b, kvh, n_live, NH: tl.constexpr, D: tl.constexpr,
                         G: tl.constexpr, GC: tl.constexpr, NSB: tl.constexpr, NSPLIT: tl.constexpr):
    # out = sum_s exp(lse_s - m) part_s / sum_s exp(lse_s - m) over the n_live live splits of the G
    # heads, NSB splits per step as one [GC, NSB, D] load (volatile: other programs wrote them), merged
    # online across steps: cdiv(n_live, NSB) dependent steps, one up to NSB * BLOCK_N live positions.
    offs_g = tl.arange(0, GC)
    offs_s = tl.arange(0, NSB)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    first = (b * NH + kvh * G + offs_g) * NSPLIT  # [GC] rows of split 0
    m_run = tl.full([GC], float("-inf"), tl.float32)
    l_run = tl.zeros([GC], tl.float32)
    acc = tl.zeros([GC, D], tl.float32)
    for s0 in range(0, n_live, NSB):
        mask = g_mask[:, None] & (s0 + offs_s < n_live)[None, :]
        row = first[:, None] + s0 + offs_s[None, :]  # [GC, NSB]
        # part before lse: volatile loads keep program order, so every load is in flight before the
        # first use of one (lse's max) waits.
        part = tl.load(part_ptr + row[:, :, None] * D + offs_d[None, None, :], mask=mask[:, :, None], other=0.0,
                       volatile=True)
        lse = tl.load(lse_ptr + row, mask=mask, other=float("-inf"), volatile=True)
        m_new = tl.maximum(m_run, tl.max(lse, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN from -inf - -inf (padding heads)
        alpha = tl.exp(m_run - m_ref)
        w = tl.exp(lse - m_ref[:, None])
        l_run = l_run * alpha + tl.sum(w, axis=1)
        acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], axis=1)
        m_run = m_new
    res = acc / l_run[:, None]  # length 0 gives 0 / 0 = NaN, as the two-launch combine and the reference
    tl.store(out_ptr + (b * NH + kvh * G + offs_g)[:, None] * D + offs_d[None, :],
             round_to(res, out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _decode_attention_split_kernel(q_ptr, kc_ptr, vc_ptr, len_ptr, part_ptr, lse_ptr, scale, S,
                                   skb, skh, sks, svb, svh, svs, cnt_ptr, out_ptr,
                                   qkv_ptr, stride_qkv, qn_ptr, kn_ptr, cos_ptr, sin_ptr, stride_cos, pos_ptr, eps,
                                   NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                                   GP: tl.constexpr, GC: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr,
                                   NSB: tl.constexpr, IEEE: tl.constexpr, FUSED_COMBINE: tl.constexpr,
                                   ROPE: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                                   LEN_EARLY: tl.constexpr = False, PDL: tl.constexpr = False):
    # One program per (row, kv head, split): the G query heads sharing that kv head attend over the
    # blocks split, split + NSPLIT, ... of BLOCK_N positions below seq_lens[row] (strided, so a short
    # live length spreads over many programs whatever the cache size S).
    # FUSED_COMBINE: only the n_live = min(cdiv(len, BLOCK_N), NSPLIT) splits holding live positions
    # work (the others return as soon as the length is loaded), and the last of them to arrive combines
    # their partials into ``out`` (no second launch) and resets the (row, kv head)'s arrival counter.
    # ROPE: q, k, v come raw from the qkv projection [B, (NH + 2 KVH) * D]: every program normalises and
    # rotates its G query heads and the new k itself (a few KB, the same code so the same values), uses
    # the new k, v at positions[row] in place of the cache entry, and split 0 writes them into the cache.
    # PREFETCH (with ROPE): the split's first k, v block is loaded before waiting for the previous
    # kernel: the lengths, positions and older cache entries were written kernels before, and the
    # new entry's stale cache value is replaced by k_new / v_new; so the cache read overlaps the
    # previous kernel (the qkv projection) instead of following the norms.
    # LEN_EARLY (``_common.early_loads("attn")``, the default): the row's length is loaded before the
    # wait too (the engine updates the lengths once per step, between replays), so the early exit of
    # the dead splits and the cache loads of the live ones no longer wait for a length load after it
    # (H200 Qwen3-30B-A3B fp8 decode step at a 400 cache: 1.837-1.844 vs 1.914-1.918 ms).
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if LEN_EARLY or PREFETCH:
        length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), S)  # the reference's live mask stops at S too
    if not PREFETCH:
        pdl_start(PDL)
    if not (LEN_EARLY or PREFETCH):
        length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), S)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    heads = kvh * G + offs_g
    # fp32 operands: bf16/fp16 values are exact in tf32, so the default (tf32) dot loses nothing on
    # q.k, and the interpreter (CI) mis-multiplies bf16 dots.
    if ROPE:
        pos = tl.load(pos_ptr + b).to(tl.int64)
    else:
        pos = 0
    if PREFETCH:
        offs_n0 = split * BLOCK_N + tl.arange(0, BLOCK_N)
        k_first = _kv_tile(kc_ptr + b * skb + kvh * skh, offs_n0, offs_n0 < length, sks, offs_d)
        v_first = _kv_tile(vc_ptr + b * svb + kvh * svh, offs_n0, offs_n0 < length, svs, offs_d)
        pdl_start(PDL)
    else:
        k_first, v_first = length, length  # unused
    if ROPE:
        dt = qkv_ptr.dtype.element_ty
        row = qkv_ptr + b * stride_qkv
        cos_row, sin_row = cos_ptr + pos * stride_cos, sin_ptr + pos * stride_cos
        q = _norm_rope_rows(row + heads[:, None] * D, (offs_g < G)[:, None], qn_ptr, cos_row, sin_row, offs_d, eps,
                            D, dt)
        one = tl.arange(0, 1)
        k_new = _norm_rope_rows(row + (NH + kvh) * D + one[:, None], one[:, None] >= 0, kn_ptr, cos_row, sin_row,
                                offs_d, eps, D, dt)  # [1, D]
        v_new = tl.load(row + (NH + KVH + kvh) * D + offs_d[None, :] + one[:, None])
        if split == 0:
            tl.store(kc_ptr + b * skb + kvh * skh + pos * sks + offs_d[None, :] + one[:, None], round_to(k_new, dt))
            tl.store(vc_ptr + b * svb + kvh * svh + pos * svs + offs_d[None, :] + one[:, None], v_new)
        v_new = v_new.to(tl.float32)
    else:
        # loaded before the length is known: in flight together with it
        q = tl.load(q_ptr + (b * NH + heads)[:, None] * D + offs_d[None, :], mask=(offs_g < G)[:, None],
                    other=0.0).to(tl.float32)
        k_new, v_new = q, q  # unused
    if FUSED_COMBINE:
        n_live = tl.maximum(tl.minimum(tl.cdiv(length, BLOCK_N), NSPLIT), 1)  # length 0: split 0 (-> NaN)
        if split < n_live:
            _attend_blocks(q, kc_ptr, vc_ptr, part_ptr, lse_ptr, scale, skb, skh, sks, svb, svh, svs, b, kvh,
                           split, length, NH, D, G, GP, BLOCK_N, NSPLIT, IEEE, pos, k_new, v_new, ROPE,
                           k_first, v_first, PREFETCH)
            tl.debug_barrier()  # every thread's partial stores precede the release below
            slot = cnt_ptr + b * KVH + kvh
            if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == n_live - 1:
                _combine_live_splits(part_ptr, lse_ptr, out_ptr, b, kvh, n_live, NH, D, G, GC, NSB, NSPLIT)
                tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")
    else:
        _attend_blocks(q, kc_ptr, vc_ptr, part_ptr, lse_ptr, scale, skb, skh, sks, svb, svh, svs, b, kvh,
                       split, length, NH, D, G, GP, BLOCK_N, NSPLIT, IEEE, pos, k_new, v_new, ROPE,
                       k_first, v_first, PREFETCH)


@triton.jit
def _decode_attention_combine_kernel(part_ptr, lse_ptr, out_ptr, NH: tl.constexpr, D: tl.constexpr,
                                     NSPLIT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NSPLIT)
    offs_d = tl.arange(0, D)
    base = (b * NH + h) * NSPLIT
    lse = tl.load(lse_ptr + base + offs_s)
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)  # empty chunks: exp(-inf) = 0
    part = tl.load(part_ptr + (base + offs_s)[:, None] * D + offs_d[None, :])
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + (b * NH + h) * D + offs_d, round_to(out, out_ptr.dtype.element_ty))


# Values in the fused combine's [heads, splits, D] fp32 load: 16384 is 16 splits of Qwen3-30B-A3B's 8
# heads x 128 (one step up to 512 live positions); ptxas (sm_90): 219 registers, no spills.
COMBINE_TILE = 16384


def _split_plan(S: int, rows_x_heads: int) -> tuple[int, int]:
    """(NSPLIT, BLOCK_N): programs per (row, kv head) and the positions each takes per step.

    ~256+ programs in total fill the 132 SMs of an H200; more splits only add combine work. Split s
    takes blocks s, s + NSPLIT, ... so a short live length in a long cache (batch-1 decode: ~200 of
    4096 positions) spreads one block per program over cdiv(len, 32) programs instead of falling into
    the first few contiguous chunks, and a long one loops; the grid depends on S only (graph capture).
    """
    block_n = 32
    nsplit = min(triton.next_power_of_2(triton.cdiv(S, block_n)),
                 max(1, triton.next_power_of_2(triton.cdiv(256, rows_x_heads))), 64)
    return nsplit, block_n


# The fused combine pays off only when the second launch would merge many splits: H200, Qwen3-30B-A3B
# decode step with dependent launch (bench/step_variants.py): cache of 400 (16 splits) 2.736 ms one
# launch vs 2.689 two; cache of 4096 (64 splits, the two-launch combine then spills) 2.775 vs 2.803.
# Later steps turned the 16-split case round (ember bench moe variants, cache 392: 2.559 vs 2.580 ms
# on 2026-11-30, 2.371 vs 2.393 with the re-tiled MoE GEMVs on 2026-12-01), so 16 splits combine in
# the same launch too; batch 8 (8 splits) keeps two launches.
ONE_LAUNCH_MIN_SPLITS = 16


def one_launch(nsplit: int) -> bool:
    """Whether decode attention combines its splits inside the split kernel (the last live program of
    each (row, kv head) to arrive) instead of in a second launch: by default when there are at least
    ONE_LAUNCH_MIN_SPLITS splits; EMBER_ATTN_ONE_LAUNCH=1 / 0 forces it on / off.

    Read per call, so also while capturing a graph. The first version (every split program, live or
    not, arrived; the combine walked all splits one dependent load at a time) made the H200
    Qwen3-30B-A3B decode step slower: 3.59 ms vs 3.08 with two launches (split kernel 3.36 us +
    combine 2.72 us per layer), because its combine was a chain of dependent L2 round trips. Now only
    the live splits run and arrive, and the combine loads their partials as whole [heads, splits, D]
    tiles (one dependent step up to 512 live positions).
    """
    env = os.environ.get("EMBER_ATTN_ONE_LAUNCH")
    if env is not None:
        return env != "0"
    return nsplit >= ONE_LAUNCH_MIN_SPLITS


def decode_attention(q, k_cache, v_cache, seq_lens, scale, out, rope: tuple | None = None) -> None:
    """Decode attention of q [B, NH, D] into out [B, NH * D]. ``rope = (qkv, q_norm, k_norm, cos, sin,
    positions, eps)``: q is None and the kernel takes q, k, v raw from qkv [B, (NH + 2 KVH) * D] (the
    qk_norm_rope_cache step folded in, cache write included)."""
    B, NH, D = (q.shape if rope is None else (rope[0].shape[0], out.shape[1] // k_cache.shape[3], k_cache.shape[3]))
    KVH, S = k_cache.shape[1], k_cache.shape[2]
    G = NH // KVH
    nsplit, block_n = _split_plan(S, B * KVH)
    gc = triton.next_power_of_2(G)
    nsb = max(1, min(nsplit, COMBINE_TILE // (gc * D)))
    part = torch.empty(B, NH, nsplit, D, dtype=torch.float32, device=out.device)
    lse = torch.empty(B, NH, nsplit, dtype=torch.float32, device=out.device)
    fused = one_launch(nsplit)
    cnt = arrival_counters("decode_attention", out.device, B * KVH) if fused else lse
    pdl = pdl_options(out.device)
    if rope is None:
        q = q.contiguous()
        qkv, qn, kn, cos, sin, positions, eps = q, q, q, q, q, q, 0.0  # unused pointers
    else:
        qkv, qn, kn, cos, sin, positions, eps = rope
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        q = qkv  # unused pointer
    _decode_attention_split_kernel[(B, KVH, nsplit)](
        q, k_cache, v_cache, seq_lens, part, lse, scale, S,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cnt, out, qkv, qkv.stride(0), qn, kn, cos, sin, cos.stride(0), positions, float(eps),
        NH=NH, KVH=KVH, D=D, G=G, GP=max(16, triton.next_power_of_2(G)), GC=gc, BLOCK_N=block_n,
        NSPLIT=nsplit, NSB=nsb, IEEE=out.dtype == torch.float32, FUSED_COMBINE=fused, ROPE=rope is not None,
        PREFETCH=rope is not None and os.environ.get("EMBER_ATTN_PREFETCH", "1") == "1", LEN_EARLY=early_loads("attn"),
        num_warps=(env_ints("EMBER_ATTN_SPLIT_WARPS", "num_warps") or (4,))[0], **pdl)
    if not fused:
        _decode_attention_combine_kernel[(B, NH)](part, lse, out, NH=NH, D=D, NSPLIT=nsplit, num_warps=1,
                                                  **pdl)


@triton.jit
def _qkv_proj_norm_rope_cache_kernel(x_ptr, w_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, kc_ptr, vc_ptr, q_ptr,
                                     B, H, stride_x, stride_w, stride_cos, skb, skh, sks, svb, svh, svs, eps,
                                     NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                                     BK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # One program per output head (NH query, KVH key, KVH value heads) for all B <= BM rows: the head's
    # [D, H] weight slab is read once, whatever B is. The GEMV result is rounded to the I/O dtype
    # (what the two-step path stores as qkv) before the norm; the epilogue is then op for op the one
    # of _qk_norm_rope_cache_kernel.
    head = tl.program_id(0)
    rows = tl.arange(0, BM)
    row_mask = rows < B
    offs_d = tl.arange(0, D)
    offs_k = tl.arange(0, BK)
    w_rows = w_ptr + (head * D + offs_d).to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros([BM, D], tl.float32)
    for k0 in range(0, H, BK):
        k = k0 + offs_k
        k_mask = k < H
        x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=k_mask[None, :], other=0.0)  # [D, BK], 16-byte loads along H
        if UPCAST:  # interpreter: it mis-multiplies bf16/fp16 dots; their values are exact in fp32
            x, w = x.to(tl.float32), w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    dt = q_ptr.dtype.element_ty
    y = round_to(acc, dt)  # the qkv tensor of the two-step path
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    if head >= NH + KVH:
        vh = head - NH - KVH
        dst = vc_ptr + rows.to(tl.int64) * svb + vh * svh + pos * svs
        tl.store(dst[:, None] + offs_d[None, :], y, mask=row_mask[:, None])
    else:
        HALF: tl.constexpr = D // 2
        # [BM, D] -> halves [BM, D/2] (rotate-half pairs element i with i + D/2)
        y1, y2 = tl.split(tl.permute(tl.reshape(y.to(tl.float32), [BM, 2, HALF]), [0, 2, 1]))
        offs = tl.arange(0, HALF)
        if head < NH:
            nw_ptr = qn_ptr
            dst = q_ptr + (rows.to(tl.int64) * NH + head) * D
        else:
            nw_ptr = kn_ptr
            dst = kc_ptr + rows.to(tl.int64) * skb + (head - NH) * skh + pos * sks
        inv_rms = 1.0 / tl.sqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / D + eps)
        n1 = round_to(y1 * inv_rms[:, None] * tl.load(nw_ptr + offs).to(tl.float32)[None, :], dt).to(tl.float32)
        n2 = round_to(y2 * inv_rms[:, None] * tl.load(nw_ptr + HALF + offs).to(tl.float32)[None, :], dt).to(tl.float32)
        cs_off = pos[:, None] * stride_cos + offs[None, :]
        c = round_to(tl.load(cos_ptr + cs_off, mask=row_mask[:, None], other=0.0), dt).to(tl.float32)
        s = round_to(tl.load(sin_ptr + cs_off, mask=row_mask[:, None], other=0.0), dt).to(tl.float32)
        tl.store(dst[:, None] + offs[None, :], round_to(n1 * c - n2 * s, dt), mask=row_mask[:, None])
        tl.store(dst[:, None] + HALF + offs[None, :], round_to(n2 * c + n1 * s, dt), mask=row_mask[:, None])


def qkv_proj_norm_rope_cache(x, weight, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, q_out, eps) -> None:
    """The decode qkv GEMV fused with q/k RMSNorm, RoPE and the k/v cache write, one launch.

    Floor (Qwen3-30B-A3B, H=2048, NH=32, KVH=4, D=128, bf16, B <= 8): the weight is
    (32 + 2 * 4) * 128 * 2048 * 2 B = 21.0 MB, everything else < 0.1 MB, so 21.0 MB / 4.15 TB/s =
    5.1 us per layer, 0.24 ms for 48 layers; FLOPs (2 * B * 10.5 M <= 168 MFLOP) are negligible.
    Expected effect (UNMEASURED, nothing of this ran on a GPU): the two-step path is a cuBLAS GEMV
    plus the norm/RoPE kernel, two launches and a [B, 5120] round trip; fusing removes one kernel
    boundary per layer (~2-3 us in a CUDA graph incl. the tail), i.e. up to ~0.1-0.15 ms of the
    3.20 ms step, IF this GEMV runs at cuBLAS speed. Risk: only NH + 2 KVH = 40 programs (one per
    head, so each head's norm sees its whole D outputs), each streaming 512 KB; if one SM cannot
    pull ~100 GB/s the GEMV is slower than cuBLAS and the fusion loses. BK / warps / stages below
    are untuned guesses; a later change should time B = 1 and 8 against the two-step path and,
    if short, split H across a cluster or finish with a last-arriving-program epilogue.
    """
    B, H = x.shape
    NH, D = q_out.shape[1], q_out.shape[2]
    KVH = k_cache.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    on_gpu = x.device.type == "cuda"
    bk = 128 if on_gpu else min(128, max(16, triton.next_power_of_2(H)))
    _qkv_proj_norm_rope_cache_kernel[(NH + 2 * KVH,)](
        x, weight, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, q_out,
        B, H, x.stride(0), weight.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), eps,
        NH=NH, KVH=KVH, D=D, BM=16, BK=bk, UPCAST=not on_gpu, IEEE=x.dtype == torch.float32,
        num_warps=4, num_stages=4)
