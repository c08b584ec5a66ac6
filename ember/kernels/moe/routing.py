"""MoE routing kernels: softmax top-k from logits (``route``), and the router GEMV with the routing in
one launch (``route_hidden``; Qwen3's softmax top-k, LFM2's biased sigmoid selection, Qwen3.5's
shared-expert gate row), optionally with the decoder's post-attention add_rmsnorm folded in."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import (arrival_counters, pdl_options, pdl_start, residual_inv_rms_after, residual_sum,
                                   round_to)
from ember.kernels.moe import config

ROUTER_MAX_TOKENS = 64
ADD_NORM_MAX_HIDDEN = 4096  # route_hidden's add_norm: one K block of the row on the GPU


@triton.jit
def _select_topk_gather(choose, values, offs, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr):
    """The TOP_K largest entries of ``choose`` (ties -> lower index): (their ``values``, their indices)."""
    kk = tl.arange(0, BLOCK_KK)
    ids = tl.zeros([BLOCK_KK], dtype=tl.int32)
    ws = tl.zeros([BLOCK_KK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choose, axis=0)
        idx = tl.min(tl.where(choose == best, offs, BLOCK_E), axis=0)
        ids = tl.where(kk == j, idx, ids)
        ws = tl.where(kk == j, tl.sum(tl.where(offs == idx, values, 0.0), axis=0), ws)
        choose = tl.where(offs == idx, float("-inf"), choose)
    return ws, ids


@triton.jit
def _select_topk_packed(p, offs, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr):
    """The TOP_K largest of ``p`` (non-negative floats; negative lanes are never picked before them;
    ties -> lower index) as (values, indices), one max reduction per pick: value bits and reversed
    index packed in one int64 key (non-negative float bits order like the floats), where a max and
    an index min per pick would take two cross-warp reductions."""
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
                 BLOCK_E: tl.constexpr, BLOCK_KK: tl.constexpr, VOLATILE: tl.constexpr = False):
    """float32 softmax over E logits, then the TOP_K largest (ties -> lower index), renormalised.
    VOLATILE: read around L1 (logits other programs wrote in this launch)."""
    offs = tl.arange(0, BLOCK_E)
    in_range = offs < E
    logits = tl.load(logits_ptr + row * stride_row + offs, mask=in_range, other=-float("inf"),
                     volatile=VOLATILE).to(tl.float32)
    ex = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(in_range, ex / tl.sum(ex, axis=0), -1.0)  # padding lanes are never picked
    ws, ids = _select_topk_packed(p, offs, TOP_K, BLOCK_E, BLOCK_KK)
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
    ws, ids = _select_topk_gather(choose, scores, offs, TOP_K, BLOCK_E, BLOCK_KK)
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
                         PDL: tl.constexpr = False):
    """Router GEMV and routing in one launch: program (t, j) computes BLOCK_R of token t's logits
    (rounded to x's dtype, as ``F.linear(x, router)`` returns them); the last of the token's
    ``n_prog`` programs to arrive (acq_rel counter) routes from all E logits and resets the counter.
    Routing: Qwen3's softmax top-k, or (SIGMOID) LFM2's biased sigmoid selection. SHARED_GATE: the
    last of the E rows is a shared expert's gate: softmax top-k over the first E - 1, then expert
    E - 1 appended with weight sigmoid(its logit) (Qwen3.5's shared expert folded into the experts).
    ADD_NORM: x is first added to the residual row and RMS-normalised (the decoder's post-attention
    ``add_rmsnorm``, saving its launch): every program computes the normalised row itself (the same
    code and layout everywhere, so the same values), multiplies its router rows with it, and program
    0 stores it and the new residual for the expert GEMVs and the next layer. The first K block's
    norm weight is loaded before the wait too (no kernel writes it), and that block's x + residual
    is kept from the norm's pass for the product (the same bits) instead of reloaded after the row's
    reduction (H200 fp8 step 1.837-1.844 -> 1.806-1.813 ms, step_variants_early_loads_fp8.json).
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
    if ADD_NORM:
        lw0 = tl.load(lnw_ptr + ks, mask=ks < H, other=0.0).to(tl.float32)
    pdl_start(PDL)
    inv_rms = 0.0
    if ADD_NORM:
        # the row norm (residual_inv_rms_after) and the router input share block 0's residual sum
        h0 = residual_sum(x_ptr + t * stride_x, res_ptr + t * H, ks, H, 1)
        inv_rms = residual_inv_rms_after(h0, x_ptr + t * stride_x, res_ptr + t * H, new_res_ptr + t * H, H, 1, eps,
                                         j == 0, BLOCK_H)
        xv = _router_normed(h0, lw0, inv_rms, normed_ptr, t, j, ks, H, x_ptr.dtype.element_ty)
    else:
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
            ws, ids = _topk_of_row(logits_ptr, t, E, E - 1, TOP_K, RENORM, BLOCK_E, BLOCK_KK, VOLATILE=True)
            gate = tl.load(logits_ptr + t * E + E - 1, volatile=True)
            ws = tl.where(tl.arange(0, BLOCK_KK) == TOP_K, 1.0 / (1.0 + tl.exp(-gate)), ws)
            ids = tl.where(tl.arange(0, BLOCK_KK) == TOP_K, E - 1, ids)
        else:
            ws, ids = _topk_of_row(logits_ptr, t, E, E, TOP_K, RENORM, BLOCK_E, BLOCK_KK, VOLATILE=True)
        kk = tl.arange(0, BLOCK_KK)
        n_out: tl.constexpr = TOP_K + SHARED_GATE
        tl.store(tw_ptr + t * n_out + kk, ws, mask=kk < n_out)
        tl.store(ids_ptr + t * n_out + kk, ids, mask=kk < n_out)
        tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")


# ----------------------------------------------------------------------------- launchers
def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    T, E = router_logits.shape
    logits = config.rows_contiguous(router_logits)
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, w, ids, E, logits.stride(0), TOP_K=top_k, RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_KK=triton.next_power_of_2(top_k),
                            num_warps=1 if E <= 256 else 4)
    return w, ids


def route_hidden(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
                 scoring: str = "softmax", expert_bias: torch.Tensor | None = None, scaling: float = 1.0,
                 shared_expert_gate: bool = False, add_norm: tuple | None = None):
    """Routing straight from hidden states ``x [T, H]`` and the router weight ``[E, H]``, T <= 64.

    One launch instead of a router GEMV (cuBLAS) plus the route kernel: at batch-1 decode each
    launch costs ~2 us inside a CUDA graph, and the 128 x 2048 router (0.5 MB) is too small for
    cuBLAS to stream fast. Rows per program: ``config.router_tile``, so the 0.5 MB is read by many
    SMs at once.

    ``add_norm = (residual, norm_weight, eps, normed_out, new_residual_out)`` (contiguous [T, H]
    rows): route from ``add_rmsnorm(x, residual, norm_weight, eps)`` instead of x, writing its two
    outputs too (one launch fewer per decoder layer).
    """
    x = config.rows_contiguous(x)
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
    # memory round trips. Now the whole K range (up to 4096) is one load per program.
    # A top-k by parallel rank counting (one [E, E] compare-and-count instead of the 8 dependent
    # max/argmin reductions) measured no faster in the decode step (2.734 vs 2.727 ms), so the
    # serial picks stay.
    block_r, warps = config.router_tile(E, x.device)
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
        num_warps=warps, **pdl_options(x.device))
    return w, ids


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
