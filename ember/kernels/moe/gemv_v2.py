"""T == 1 expert GEMVs, v2 (the GPU's choice for fp8 weights): ``_gate_up_gemv_v2_kernel`` and
``_down_gemv_v2_kernel``, no shared-memory layout conversion in the K loop (analysis and H200
figures at ``v2_tiles``). Entries "gemv_v2_gate_up" / "gemv_v2_down": warps per program and rows per
warp lane group (ROWS for 2- and 4-byte weights, ROWS_FP8 for fp8; down takes 2 rows for fp8,
20.6 vs 21.4 us, but 1 for bf16, 27.6 vs 32.2 us: 2 rows of bf16 spill the partial sums), LANES
(threads of a warp along K; absent or null: the widest step that divides K) and the down GEMV's
expert groups SPLIT / SPLIT_FP8 (``config.down_split``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start
from ember.kernels.moe import config
from ember.kernels.moe.shared import (fold_inputs, fold_pointers, row_scale, split_buffers, store_silu_mul,
                                      store_split_or_fold)


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
    store_silu_mul(acc_g, acc_u, h_ptr, pair, rows, row_mask, scale_ptr, e, stride_se, stride_sn, I, SCALE)


@triton.jit
def _down_gemv_v2_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, tw_ptr, out_ptr, stride_out,
                         stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                         res_ptr, lnw_ptr, scaled_ptr, part_ptr, cnt_ptr,
                         H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, SCALE: tl.constexpr,
                         BLOCK_N: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BPS: tl.constexpr,
                         FOLD: tl.constexpr = False, SPLIT: tl.constexpr = 1, PDL: tl.constexpr = False,
                         JPG_P2: tl.constexpr = 1):
    """out[t, n] = sum_j w[t, j] * down[e_j][n] . h[(t, j)] for BLOCK_N rows n; experts and K unrolled.
    FOLD: as in the v1 down GEMV, its inputs loaded before the wait (2.02 vs 2.06 ms after it).
    SPLIT > 1: program (t, nb, g) sums experts g * TOP_K / SPLIT .. (g + 1) * TOP_K / SPLIT - 1 only
    (store_split_or_fold combines the groups).
    The program's expert ids and routing weights (JPG_P2: their count rounded up to a power of 2) are
    loaded before waiting for gate_up (they come from the router, two launches back, finished by
    then: _common.pdl_start; around L1), so the first weight loads after the wait do not wait on an
    id load: H200 fp8 step 1.949-1.959 -> 1.913-1.920 ms (step_variants_v2_down_prefetch_default.json)."""
    t = tl.program_id(0)
    nb = tl.program_id(1)
    g = tl.program_id(2)
    JPG: tl.constexpr = TOP_K // SPLIT
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    r, lw = fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD, True)
    jv = tl.arange(0, JPG_P2)
    mine = t * TOP_K + g * JPG + jv
    pre_e = tl.load(ids_ptr + mine, mask=jv < JPG, other=0, volatile=True).to(tl.int64)
    pre_f = tl.load(tw_ptr + mine, mask=jv < JPG, other=0.0, volatile=True).to(tl.float32)
    pdl_start(PDL)
    mask_rows = row_mask[:, None]
    kk = _v2_k_offsets(LANES, VEC, BPS)
    shape: tl.constexpr = (BLOCK_N, LANES * VEC)
    acc = tl.zeros([BLOCK_N, LANES], dtype=tl.float32)
    for jj in tl.static_range(JPG):
        pair = t * TOP_K + g * JPG + jj
        e = tl.sum(tl.where(jv == jj, pre_e, 0), axis=0)
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
        factor = tl.sum(tl.where(jv == jj, pre_f, 0.0), axis=0)
        if SCALE == 1:
            acc += acc_e * (factor * row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn))[:, None]
        else:
            acc += acc_e * factor
    store_split_or_fold(tl.sum(acc, axis=1), part_ptr, cnt_ptr, g, nb, out_ptr, t, stride_out, rows, row_mask, r,
                        lw, scaled_ptr, H, FOLD, SPLIT)


def v2_tiles(key: str, weight: torch.Tensor, K: int) -> dict:
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
    cfg = config.tiles(key, weight.device)
    rows = cfg["ROWS_FP8" if weight.element_size() == 1 else "ROWS"]
    vec = 16 // weight.element_size()  # 16 bytes of weight per thread and vector; divides 128 (block scales)
    lanes = cfg.get("LANES")
    if lanes is None:  # the widest K step that divides K, so no lane is masked off
        lanes = next((n for n in (32, 16, 8) if K % (n * vec) == 0), 32)
        lanes = min(lanes, max(1, triton.next_power_of_2(-(-K // vec))))
    rows_per_warp = max(1, 32 // lanes)
    block_n = cfg["num_warps"] * rows_per_warp * rows
    if block_n & (block_n - 1):
        raise ValueError(f"moe tuning entry {key!r}: expected warps x rows per program to be a power of 2, got "
                         f"num_warps={cfg['num_warps']}, rows={rows}")
    return dict(BLOCK_N=block_n, LANES=lanes, VEC=vec, BPS=max(1, lanes * vec // config.SCALE_BLOCK),
                num_warps=cfg["num_warps"], **{k: cfg[k] for k in ("SPLIT", "SPLIT_FP8") if k in cfg})


def experts_gemv_v2(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out, fold=None):
    T, H = x.shape
    I = w_down.shape[2]
    h = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)
    cfg = v2_tiles("gemv_v2_gate_up", w_gate_up, H)
    mode, gs_t, gse, gsn, gsk = config.scale_args(w_gate_up, gs)
    _gate_up_gemv_v2_kernel[(T * top_k, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, w_gate_up, gs_t, ids, h, x.stride(0), *w_gate_up.stride(), gse, gsn, gsk, H=H, I=I, TOP_K=top_k,
        SCALE=mode, BLOCK_N=cfg["BLOCK_N"], LANES=cfg["LANES"], VEC=cfg["VEC"], BPS=cfg["BPS"],
        num_warps=cfg["num_warps"], num_stages=1, **pdl_options(x.device))
    cfg = v2_tiles("gemv_v2_down", w_down, I)
    mode, ds_t, dse, dsn, dsk = config.scale_args(w_down, ds)
    nb = triton.cdiv(H, cfg["BLOCK_N"])
    split, part, cnt = split_buffers(cfg, T, H, nb, top_k, w_down, h)
    _down_gemv_v2_kernel[(T, nb, split)](
        h, w_down, ds_t, ids, tw, out, out.stride(0), *w_down.stride(), dse, dsn, dsk, *fold_pointers(fold, out),
        part, cnt, H=H, I=I, TOP_K=top_k, SCALE=mode, BLOCK_N=cfg["BLOCK_N"], LANES=cfg["LANES"], VEC=cfg["VEC"],
        BPS=cfg["BPS"], SPLIT=split, num_warps=cfg["num_warps"], num_stages=1, FOLD=fold is not None,
        JPG_P2=triton.next_power_of_2(top_k // split), **pdl_options(x.device))
    return out


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
