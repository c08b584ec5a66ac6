"""@triton.jit pieces shared by the MoE expert kernels: SwiGLU, fp8 scale loads, and the epilogues
of the down projections (the deferred-norm fold, the split down GEMV's fixed-order combine)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import arrival_counters, round_to
from ember.kernels.moe import config


@triton.jit
def silu_mul(g, u):
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def block_scale_rows(scale_ptr, e, rows, row_mask, k0, stride_se, stride_sn, stride_sk):
    """The 128x128-block scales of ``rows`` at K offset ``k0`` (a K slice never straddles blocks)."""
    return tl.load(scale_ptr + e * stride_se + (rows // 128) * stride_sn + (k0 // 128) * stride_sk,
                   mask=row_mask, other=0.0).to(tl.float32)


@triton.jit
def row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn):
    return tl.load(scale_ptr + e * stride_se + rows * stride_sn, mask=row_mask, other=0.0).to(tl.float32)


@triton.jit
def store_silu_mul(acc_g, acc_u, h_ptr, pair, rows, row_mask, scale_ptr, e, stride_se, stride_sn,
                   I: tl.constexpr, SCALE: tl.constexpr):
    """Reduce the gate/up partial sums over K, apply row scales, store silu(g) * u rounded once."""
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if SCALE == 1:
        g *= row_scale(scale_ptr, e, rows, row_mask, stride_se, stride_sn)
        u *= row_scale(scale_ptr, e, rows + I, row_mask, stride_se, stride_sn)
    tl.store(h_ptr + pair * I + rows, round_to(silu_mul(g, u), h_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def fold_inputs(res_ptr, lnw_ptr, t, rows, row_mask, H, FOLD: tl.constexpr, BEFORE_WAIT: tl.constexpr):
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
def store_out_or_fold(out, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H, FOLD: tl.constexpr):
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
def store_split_or_fold(y, part_ptr, cnt_ptr, g, nb, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H,
                        FOLD: tl.constexpr, SPLIT: tl.constexpr):
    """The down GEMVs' end: ``y`` is this program's fp32 row sums (experts of group g of SPLIT).
    SPLIT == 1: store_out_or_fold. Else: store y in part_ptr[t, g], arrive at counter (t, nb); the
    last of the SPLIT to arrive adds the partials in group order (the same bits whichever arrives
    last), stores the output (or the FOLD epilogue) and resets the counter."""
    if SPLIT == 1:
        store_out_or_fold(y, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H, FOLD)
    else:
        tl.store(part_ptr + (t * SPLIT + g) * H + rows, y, mask=row_mask)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        slot = cnt_ptr + t * tl.num_programs(1) + nb
        if tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = tl.zeros_like(y)
            for gg in tl.static_range(SPLIT):  # group order, own partial included: arrival order never matters
                total += tl.load(part_ptr + (t * SPLIT + gg) * H + rows, mask=row_mask, other=0.0, volatile=True)
            store_out_or_fold(total, out_ptr, t, stride_out, rows, row_mask, r, lw, scaled_ptr, H, FOLD)
            tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")


# ----------------------------------------------------------------------------- launch helpers
def split_buffers(cfg: dict, T: int, H: int, n_blocks: int, top_k: int, w_down: torch.Tensor, dummy: torch.Tensor):
    """(split, fp32 partials [T, split, H], arrival counters) of a down GEMV launch; dummies unsplit."""
    split = config.down_split(cfg, top_k, w_down.element_size() == 1)
    if split == 1:
        return 1, dummy, dummy
    return split, torch.empty((T, split, H), dtype=torch.float32, device=w_down.device), \
        arrival_counters("moe_down_split", w_down.device, T * n_blocks)


def fold_pointers(fold, out):
    """The FOLD epilogue's (residual, norm weight, scaled out), or unused stand-ins without it."""
    return fold if fold is not None else (out, out, out)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
