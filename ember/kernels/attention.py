"""Triton kernels for decode attention: fused q/k RMSNorm + RoPE + KV-cache write (decode and
prefill), and split-sequence attention over the live part of a static cache followed by a combine
(in the same launch, by the last live split program of each (row, kv head), or in a second launch).

Tile data (``ember.tuning``, family ``"attention"``; ``tuning.override("attention", {key: entry})``
for sweeps, read at launch so a captured CUDA graph keeps it):

* ``"prefill_rope"``: ``{"BLOCK_T": power of 2, "num_warps": int}``, token rows per program of the
  prefill norm + RoPE + cache-write kernel.
* ``"decode_split"``: ``{"num_warps": int, "one_launch_min_splits": int}``, warps of the split
  kernel, and from how many splits per (row, kv head) the splits combine inside it instead of in a
  second launch (a number above the most splits, 64, keeps two launches).

An entry may give only some fields; the others come from the rule in code (``PREFILL_ROPE_RULE``,
``DECODE_SPLIT_RULE``), the H200's measured values, which any sm_80+ GPU without its own entries
runs (CPU tensors under the interpreter take small prefill blocks so that tests reach the masks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember import tuning
from ember.kernels._common import arrival_counters, pdl_options, pdl_start, round_to

FAMILY = "attention"


def tile(key: str, rule: dict, device) -> dict:
    """``rule`` with the fields of the tuning entry for ``key`` on ``device`` (none: the rule); an
    unknown field or a non-positive integer is a ValueError naming the entry."""
    entry, source = tuning.lookup_with_source(FAMILY, key, device)
    if entry is None:
        return rule
    unknown = sorted(set(entry) - set(rule))
    bad = sorted(k for k, v in entry.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1)
    if unknown or bad:
        raise ValueError(f"tuning entry {FAMILY}/{key} ({source}): expected integer fields >= 1 among "
                         f"{sorted(rule)}, got {entry}")
    return {**rule, **entry}


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
        out = _norm_rope_rows(src + h * D, mask, qn_ptr, cos_row, sin_row, offs_d, eps, D, dt)
        tl.store(q_ptr + (rows[:, None] * NH + h) * D + offs_d[None, :], out.to(dt), mask=mask)
    else:
        kvh = h - NH
        out = _norm_rope_rows(src + (NH + kvh) * D, mask, kn_ptr, cos_row, sin_row, offs_d, eps, D, dt)
        tl.store(kc_ptr + b * skb + kvh * skh + pos * sks + offs_d[None, :], out.to(kc_ptr.dtype.element_ty), mask=mask)
        v = tl.load(src + (NH + KVH + kvh) * D + offs_d[None, :], mask=mask)
        tl.store(vc_ptr + b * svb + kvh * svh + pos * svs + offs_d[None, :], v, mask=mask)


# Token rows per program of the prefill kernel. One (token, head) per one-warp program (the decode
# kernel's grid: 82k programs of 128 values) took 89.6 us per Qwen3-30B-A3B layer at 2048 tokens on
# the H200, against a ~10 us floor (41 MB moved at 4.15 TB/s); 16-token blocks of 4 warps 29 us.
# 2048-token prefill, same run (bench/results/h200/prefill_variants.json): 16 x 4 36.92 ms, 32 x 4
# 37.11, 16 x 8 37.23, 8 x 2 37.61.
PREFILL_ROPE_RULE = {"BLOCK_T": 16, "num_warps": 4}
_PREFILL_ROPE_INTERPRETER = {"BLOCK_T": 4, "num_warps": 1}  # CPU: several blocks and a masked tail in tests


def prefill_qk_norm_rope_cache(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, q_out, eps) -> None:
    """Prefill: qkv [B, T, F] at positions 0..T-1 of cache rows 0..B-1, q_out [B, T, NH, D]."""
    B, T, F = qkv.shape
    if qkv.stride(2) != 1 or qkv.stride(0) != T * qkv.stride(1):  # rows must be evenly spaced
        qkv = qkv.contiguous()
    flat = qkv.as_strided((B * T, F), (qkv.stride(1), 1))
    NH, D = q_out.shape[-2], q_out.shape[-1]
    KVH = k_cache.shape[1]
    cos, sin = cos.contiguous(), sin.contiguous()
    rule = PREFILL_ROPE_RULE if qkv.device.type == "cuda" else _PREFILL_ROPE_INTERPRETER
    t = tile("prefill_rope", rule, qkv.device)
    block_t = t["BLOCK_T"]
    if block_t & (block_t - 1):
        raise ValueError(f"tuning entry {FAMILY}/prefill_rope: BLOCK_T must be a power of 2, got {block_t}")
    _prefill_qk_norm_rope_kernel[(triton.cdiv(B * T, block_t), NH + KVH)](
        flat, q_norm, k_norm, cos, sin, k_cache, v_cache, q_out, flat.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), eps, T, B * T, NH=NH, KVH=KVH, D=D, BLOCK_T=block_t, num_warps=t["num_warps"])


@triton.jit
def _norm_rope_rows(src, mask, w_ptr, cos_row, sin_row, offs_d, eps, D: tl.constexpr, dt: tl.constexpr):
    """Rows ``src[r] + offs_d`` ([R, 1] pointers, [R, 1] mask) per-head RMSNormed and rotated (rotate-half
    RoPE at each row's position, whose cos/sin rows are the [R, 1] pointers given), as fp32 values of
    the I/O dtype ``dt``: the math and roundings of _qk_norm_rope_cache_kernel in a [R, D] layout
    (each element's rotation partner loaded a second time instead of splitting the halves)."""
    HALF: tl.constexpr = D // 2
    rot = (offs_d + HALF) % D
    x = tl.load(src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(src + rot[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
    n = round_to(x * inv_rms * tl.load(w_ptr + offs_d).to(tl.float32)[None, :], dt).to(tl.float32)
    nr = round_to(xr * inv_rms * tl.load(w_ptr + rot).to(tl.float32)[None, :], dt).to(tl.float32)
    c = round_to(tl.load(cos_row + (offs_d % HALF)[None, :]), dt).to(tl.float32)
    s = round_to(tl.load(sin_row + (offs_d % HALF)[None, :]), dt).to(tl.float32)
    out = tl.where((offs_d < HALF)[None, :], n * c - nr * s, n * c + nr * s)
    return round_to(out, dt).to(tl.float32)


@triton.jit
def _kv_tile(base, offs_n, n_mask, stride, offs_d):
    return tl.load(base + offs_n[:, None].to(tl.int64) * stride + offs_d[None, :], mask=n_mask[:, None], other=0.0)


@triton.jit
def _online_block(q, k, v, n_mask, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """One block of the online softmax: (m_i, l_i, acc) after the positions of the k, v tiles [BLOCK_N, D]."""
    k = k.to(tl.float32)
    v = v.to(tl.float32)
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
                   NSPLIT: tl.constexpr, IEEE: tl.constexpr):
    # Online softmax of the G heads (rows of q) over blocks split, split + NSPLIT, ... of BLOCK_N
    # positions below ``length``; stores the normalised partial and its log-sum-exp (-inf when empty).
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    head = kvh * G + offs_g
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    k_base = kc_ptr + b * skb + kvh * skh
    v_base = vc_ptr + b * svb + kvh * svh
    for blk in range(split, tl.cdiv(length, BLOCK_N), NSPLIT):
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < length
        k = _kv_tile(k_base, offs_n, n_mask, sks, offs_d)
        v = _kv_tile(v_base, offs_n, n_mask, svs, offs_d)
        m_i, l_i, acc = _online_block(q, k, v, n_mask, m_i, l_i, acc, scale, IEEE)
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
                                   NH: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                                   GP: tl.constexpr, GC: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr,
                                   NSB: tl.constexpr, IEEE: tl.constexpr, FUSED_COMBINE: tl.constexpr,
                                   PDL: tl.constexpr = False):
    # One program per (row, kv head, split): the G query heads sharing that kv head attend over the
    # blocks split, split + NSPLIT, ... of BLOCK_N positions below seq_lens[row] (strided, so a short
    # live length spreads over many programs whatever the cache size S).
    # FUSED_COMBINE: only the n_live = min(cdiv(len, BLOCK_N), NSPLIT) splits holding live positions
    # work (the others return as soon as the length is loaded), and the last of them to arrive combines
    # their partials into ``out`` (no second launch) and resets the (row, kv head)'s arrival counter.
    # The row's length is loaded before the dependent-launch wait (the engine updates the lengths once
    # per step, between replays), so the early exit of the dead splits and the cache loads of the
    # live ones do not wait for a length load after it (H200 Qwen3-30B-A3B fp8 decode step at a 400
    # cache: 1.837-1.844 vs 1.914-1.918 ms).
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.minimum(tl.load(len_ptr + b).to(tl.int32), S)  # the reference's live mask stops at S too
    pdl_start(PDL)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    heads = kvh * G + offs_g
    # fp32 operands: bf16/fp16 values are exact in tf32, so the default (tf32) dot loses nothing on
    # q.k, and the interpreter (CI) mis-multiplies bf16 dots. In flight together with the length.
    q = tl.load(q_ptr + (b * NH + heads)[:, None] * D + offs_d[None, :], mask=(offs_g < G)[:, None],
                other=0.0).to(tl.float32)
    if FUSED_COMBINE:
        n_live = tl.maximum(tl.minimum(tl.cdiv(length, BLOCK_N), NSPLIT), 1)  # length 0: split 0 (-> NaN)
        if split < n_live:
            _attend_blocks(q, kc_ptr, vc_ptr, part_ptr, lse_ptr, scale, skb, skh, sks, svb, svh, svs, b, kvh,
                           split, length, NH, D, G, GP, BLOCK_N, NSPLIT, IEEE)
            tl.debug_barrier()  # every thread's partial stores precede the release below
            slot = cnt_ptr + b * KVH + kvh
            if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == n_live - 1:
                _combine_live_splits(part_ptr, lse_ptr, out_ptr, b, kvh, n_live, NH, D, G, GC, NSB, NSPLIT)
                tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")
    else:
        _attend_blocks(q, kc_ptr, vc_ptr, part_ptr, lse_ptr, scale, skb, skh, sks, svb, svh, svs, b, kvh,
                       split, length, NH, D, G, GP, BLOCK_N, NSPLIT, IEEE)


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
# decode step with dependent launch: cache of 4096 (64 splits, the two-launch combine then spills)
# 2.775 vs 2.803 ms; at 16 splits (cache 392) 2.559 vs 2.580 and 2.371 vs 2.393 ms (ember bench moe
# variants, 2026-11-30 / 12-01). A first version (every split program arrived; the combine walked all
# splits one dependent L2 load at a time) had made the step slower, 3.59 vs 3.08 ms; now only the live
# splits run and arrive, and the combine loads their partials as whole [heads, splits, D] tiles.
DECODE_SPLIT_RULE = {"num_warps": 4, "one_launch_min_splits": 16}


def decode_attention(q, k_cache, v_cache, seq_lens, scale, out) -> None:
    """Decode attention of q [B, NH, D] into out [B, NH * D]."""
    B, NH, D = q.shape
    KVH, S = k_cache.shape[1], k_cache.shape[2]
    G = NH // KVH
    nsplit, block_n = _split_plan(S, B * KVH)
    gc = triton.next_power_of_2(G)
    nsb = max(1, min(nsplit, COMBINE_TILE // (gc * D)))
    part = torch.empty(B, NH, nsplit, D, dtype=torch.float32, device=out.device)
    lse = torch.empty(B, NH, nsplit, dtype=torch.float32, device=out.device)
    t = tile("decode_split", DECODE_SPLIT_RULE, out.device)
    fused = nsplit >= t["one_launch_min_splits"]
    cnt = arrival_counters("decode_attention", out.device, B * KVH) if fused else lse
    pdl = pdl_options(out.device)
    q = q.contiguous()
    _decode_attention_split_kernel[(B, KVH, nsplit)](
        q, k_cache, v_cache, seq_lens, part, lse, scale, S,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        cnt, out, NH=NH, KVH=KVH, D=D, G=G, GP=max(16, triton.next_power_of_2(G)), GC=gc, BLOCK_N=block_n,
        NSPLIT=nsplit, NSB=nsb, IEEE=out.dtype == torch.float32, FUSED_COMBINE=fused, num_warps=t["num_warps"],
        **pdl)
    if not fused:
        _decode_attention_combine_kernel[(B, NH)](part, lse, out, NH=NH, D=D, NSPLIT=nsplit, num_warps=1,
                                                  **pdl)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
