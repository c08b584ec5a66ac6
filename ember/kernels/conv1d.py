"""Triton kernel for the depthwise causal conv1d with a rolling state (LFM2 short conv, Qwen3.5 DeltaNet)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start, round_to


@triton.jit
def _gated_input(x_ptr, gi_ptr, b, cs, pos, mask, sxb, sxc, sxt, sgb, sgc, sgt, GATE_IN: tl.constexpr):
    """x at (b, cs, pos), times the input gate when GATE_IN, the product rounded to x's dtype as the
    torch expression ``gate_in * x`` rounds it."""
    xv = tl.load(x_ptr + b * sxb + cs[:, None] * sxc + pos[None, :] * sxt, mask=mask, other=0.0)
    if GATE_IN:
        gv = tl.load(gi_ptr + b * sgb + cs[:, None] * sgc + pos[None, :] * sgt, mask=mask, other=0.0)
        xv = round_to(xv.to(tl.float32) * gv.to(tl.float32), x_ptr.dtype.element_ty)
    return xv


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, b_ptr, state_ptr, y_ptr, gi_ptr, go_ptr,
                          C, T, S,
                          sxb, sxc, sxt, swc, swk, ssb, ssc, sss, syb, syc, syt, sgb, sgc, sgt, sob, soc, sot,
                          K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                          SILU: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_STATE: tl.constexpr,
                          GATE_IN: tl.constexpr, GATE_OUT: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    # GATE_IN / GATE_OUT (LFM2's short conv): the conv runs over gate_in * x (what the state keeps)
    # and y is multiplied by gate_out, each product rounded to the I/O dtype like the torch ops.
    b = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cs < C
    ts = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = ts < T
    if WRITE_Y:
        acc = tl.zeros((BLOCK_C, BLOCK_T), dtype=tl.float32)
        for j in tl.static_range(K):
            pos = ts - (K - 1) + j  # input position; < 0 reads the state (the previous inputs)
            from_x = (pos >= 0) & tmask
            xv = _gated_input(x_ptr, gi_ptr, b, cs, pos, cmask[:, None] & from_x[None, :],
                              sxb, sxc, sxt, sgb, sgc, sgt, GATE_IN).to(tl.float32)
            if HAS_STATE:
                spos = S + pos
                from_s = (pos < 0) & (spos >= 0) & tmask
                xv += tl.load(state_ptr + b * ssb + cs[:, None] * ssc + spos[None, :] * sss,
                              mask=cmask[:, None] & from_s[None, :], other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + cs * swc + j * swk, mask=cmask, other=0.0).to(tl.float32)
            acc += wv[:, None] * xv
        if HAS_BIAS:
            acc += tl.load(b_ptr + cs, mask=cmask, other=0.0).to(tl.float32)[:, None]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        y = round_to(acc, y_ptr.dtype.element_ty)
        ymask = cmask[:, None] & tmask[None, :]
        if GATE_OUT:
            gv = tl.load(go_ptr + b * sob + cs[:, None] * soc + ts[None, :] * sot, mask=ymask, other=0.0)
            y = round_to(y.to(tl.float32) * gv.to(tl.float32), y_ptr.dtype.element_ty)
        tl.store(y_ptr + b * syb + cs[:, None] * syc + ts[None, :] * syt, y, mask=ymask)
    if WRITE_STATE:
        # One program per (batch, channel block) owns the whole state row: new_state[s] is the input
        # at position T - S + s, taken from x or, when T < S, from the old state shifted left by T.
        ss = tl.arange(0, BLOCK_T)
        smask = ss < S
        src = T - S + ss
        from_x = src >= 0
        xv = _gated_input(x_ptr, gi_ptr, b, cs, src, cmask[:, None] & (smask & from_x)[None, :],
                          sxb, sxc, sxt, sgb, sgc, sgt, GATE_IN)
        old = tl.load(state_ptr + b * ssb + cs[:, None] * ssc + (ss + T)[None, :] * sss,
                      mask=cmask[:, None] & (smask & ~from_x)[None, :], other=0.0)
        new = tl.where(from_x[None, :], xv.to(state_ptr.dtype.element_ty), old)
        tl.debug_barrier()  # every read of the old state in this program happens before any write
        tl.store(state_ptr + b * ssb + cs[:, None] * ssc + ss[None, :] * sss, new,
                 mask=cmask[:, None] & smask[None, :])


def causal_conv1d(x, weight, bias, state, y, silu: bool, gate_in=None, gate_out=None) -> None:
    """x [B, C, T] (any strides), weight [C, K], state [B, C, S] updated in place, y [B, C, T];
    gate_in / gate_out [B, C, T] (any strides) or None."""
    B, C, T = x.shape
    K = weight.shape[1]
    S = state.shape[2] if state is not None else 0
    BLOCK_C = 64
    BLOCK_T = max(16, triton.next_power_of_2(min(T, 64)), triton.next_power_of_2(max(S, 1)))
    n_t = triton.cdiv(T, BLOCK_T)
    common = dict(K=K, HAS_BIAS=bias is not None, HAS_STATE=state is not None, SILU=silu,
                  GATE_IN=gate_in is not None, GATE_OUT=gate_out is not None, BLOCK_C=BLOCK_C, BLOCK_T=BLOCK_T)
    common.update(pdl_options(x.device))
    st = state if state is not None else y
    sst = state.stride() if state is not None else (0, 0, 0)
    gi = gate_in if gate_in is not None else x
    go = gate_out if gate_out is not None else x
    args = (x, weight, bias if bias is not None else weight, st, y, gi, go, C, T, S, *x.stride(), *weight.stride(),
            *sst, *y.stride(), *gi.stride(), *go.stride())
    grid_c = triton.cdiv(C, BLOCK_C)
    if state is not None and n_t == 1:
        # decode and short prefill: one launch, reads of the old state ordered before its update
        _causal_conv1d_kernel[(B, grid_c, 1)](*args, WRITE_Y=True, WRITE_STATE=True, **common)
        return
    _causal_conv1d_kernel[(B, grid_c, n_t)](*args, WRITE_Y=True, WRITE_STATE=False, **common)
    if state is not None:  # separate launch: other T-blocks still read the old state above
        _causal_conv1d_kernel[(B, grid_c, 1)](*args, WRITE_Y=False, WRITE_STATE=True, **common)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
