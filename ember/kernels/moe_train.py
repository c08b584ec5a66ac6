"""Triton kernels of ``ember.ops.moe_experts_train``: the SwiGLU experts forward and backward as
grouped GEMMs over the (token, expert) pairs sorted by expert.

The T*k pairs are sorted by expert once per call (``ember.kernels.moe.align``: each expert's run
padded to whole blocks of BLOCK_M rows, so a block never crosses an expert boundary). Then:

forward   gate_up   gu[p] = W_gu[e] x[t]             (stores gu = [g; u] and h = silu(g) * u, rounded)
          down      rows[p] = tw[p] * W_d[e] h[p]    (out[t] = sum_j rows[t*k + j], float32 sum)
backward  down      gh[p] = W_d[e]^T grad_out[t]     (epilogue: dtw[p] = <gh, h>, dgu = SwiGLU' * tw * gh,
                                                      hw[p] = tw[p] * h[p] for the weight grad)
          gate_up   dx_rows[p] = W_gu[e]^T dgu[p]    (dx[t] = sum_j dx_rows[t*k + j])
          weights   dW_gu[e] = sum_p dgu[p] x[t]^T,  dW_d[e] = sum_p grad_out[t] hw[p]^T

``_rows_kernel`` runs the four data GEMMs (one program per (sorted block, column tile); the weight
side is addressed by strides, so W and W^T are the same code) with four epilogues; ``_wgrad_kernel``
the two weight gradients (one program per (expert, output tile), looping over the expert's blocks).
The forward keeps only gu ([T*k, 2I] in x.dtype) for the backward; h is recomputed from it in the
backward's down epilogue (an elementwise op on data the epilogue loads anyway).

Tiles are tuning data (family "moe_train", key "tiles": a dict overriding any of DEFAULT_TILES'
fields); CPU tensors (the interpreter) take CPU_TILES, small so tiny shapes hit masks and loops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember import tuning
from ember.kernels._common import round_to
from ember.kernels.moe.align import align

FAMILY = "moe_train"
# Epilogues of _rows_kernel
GATE_UP_FWD, DOWN_FWD, DOWN_BWD, GATE_UP_BWD = 0, 1, 2, 3

# Starting tiles for sm_90 (H200: 227 KB shared memory): 128-row blocks keep one or few blocks per
# expert at 8k tokens (mean 512 pairs an expert for Qwen3-30B-A3B) and 128-wide tensor-core tiles;
# gate_up carries two accumulators (gate, up), so it takes half the column width.
DEFAULT_TILES = {
    "block_m": 128,
    "gate_up_fwd": dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4),
    "down_fwd": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "down_bwd": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "gate_up_bwd": dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    "wgrad": dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
}
_T = dict(BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)
CPU_TILES = {"block_m": 16, "gate_up_fwd": _T, "down_fwd": _T, "down_bwd": _T, "gate_up_bwd": _T, "wgrad": _T}


def tiles(device: torch.device) -> dict:
    """The tiles in use on ``device``: CPU_TILES off the GPU; on CUDA DEFAULT_TILES updated with the
    tuning entry "tiles" (``ember.tuning.override("moe_train", {"tiles": {...}})`` for sweeps)."""
    if device.type != "cuda":
        return CPU_TILES
    entry = tuning.lookup(FAMILY, "tiles", device) or {}
    unknown = set(entry) - set(DEFAULT_TILES)
    if unknown:
        raise ValueError(f"moe_train tuning entry 'tiles': unknown fields {sorted(unknown)}, "
                         f"expected a subset of {sorted(DEFAULT_TILES)}")
    out = dict(DEFAULT_TILES)
    for k, v in entry.items():
        out[k] = v if k == "block_m" else {**DEFAULT_TILES[k], **v}
    if out["block_m"] not in (16, 32, 64, 128, 256):
        raise ValueError(f"moe_train tuning entry 'tiles': block_m must be 16..256, a power of 2, got {out['block_m']}")
    return out


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 operands (and the interpreter, which multiplies bf16 dots wrongly): no tf32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _block_rows(sorted_pairs_ptr, blk, P, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """The pairs of sorted block ``blk``: (pairs, tokens, mask); padding slots hold P."""
    pairs = tl.load(sorted_pairs_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    mask = pairs < P
    pairs = tl.where(mask, pairs, 0).to(tl.int64)
    return pairs, pairs // TOP_K, mask


@triton.jit
def _rows_kernel(a_ptr, stride_a, w_ptr, stride_we, stride_wn, stride_wk, out_ptr, stride_out,
                 sorted_pairs_ptr, block_expert_ptr, tw_ptr, gu_ptr, h_ptr, dtw_ptr, N, K, P, I,
                 TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, EPI: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[p, n] (per sorted pair p of block program_id(0)) = sum_k a[row(p), k] * W[e][n, k], with
    W[e][n, k] at w_ptr + e*stride_we + n*stride_wn + k*stride_wk, then the epilogue EPI."""
    blk = tl.program_id(0)
    e = tl.load(block_expert_ptr + blk)
    if e >= 0:
        pairs, tokens, row_mask = _block_rows(sorted_pairs_ptr, blk, P, TOP_K, BLOCK_M)
        rows = tokens if A_BY_TOKEN else pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_base = w_ptr + e.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # the up rows (GATE_UP_FWD only)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + rows[:, None] * stride_a + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            wmask = k_mask[:, None] & col_mask[None, :]
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=wmask, other=0.0)
            acc += _dot(a, w.to(a.dtype), IEEE)
            if EPI == 0:
                wu = tl.load(w_base + (cols + I)[None, :] * stride_wn + ks[:, None] * stride_wk, mask=wmask,
                             other=0.0)
                acc_u += _dot(a, wu.to(a.dtype), IEEE)
        m2 = row_mask[:, None] & col_mask[None, :]
        if EPI == 0:  # GATE_UP_FWD: gu = [g; u] and h = silu(g) * u, each rounded once
            dt = gu_ptr.dtype.element_ty
            gu_row = gu_ptr + pairs[:, None] * (2 * I) + cols[None, :]
            tl.store(gu_row, round_to(acc, dt), mask=m2)
            tl.store(gu_row + I, round_to(acc_u, dt), mask=m2)
            h = acc / (1.0 + tl.exp(-acc)) * acc_u
            tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], round_to(h, out_ptr.dtype.element_ty),
                     mask=m2)
        elif EPI == 1:  # DOWN_FWD: the weighted row of the pair
            tw = tl.load(tw_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :],
                     round_to(acc * tw[:, None], out_ptr.dtype.element_ty), mask=m2)
        elif EPI == 2:  # DOWN_BWD: acc = gh = W_d^T grad_out over the I columns `cols`
            dt = gu_ptr.dtype.element_ty
            gu_row = gu_ptr + pairs[:, None] * (2 * I) + cols[None, :]
            g = tl.load(gu_row, mask=m2, other=0.0).to(tl.float32)
            u = tl.load(gu_row + I, mask=m2, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-g))
            h = round_to(g * sig * u, dt).to(tl.float32)  # the forward's rounded h, which W_d multiplied
            tw = tl.load(tw_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
            # this column tile's share of dtw[p] = <grad_out[t], W_d h[p]> = <gh[p], h[p]>
            tl.store(dtw_ptr + tl.program_id(1) * P + pairs, tl.sum(tl.where(m2, acc * h, 0.0), axis=1),
                     mask=row_mask)
            dh = acc * tw[:, None]
            dg = dh * u * sig * (1.0 + g * (1.0 - sig))
            du = dh * g * sig
            tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], round_to(dg, dt), mask=m2)
            tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :] + I, round_to(du, dt), mask=m2)
            tl.store(h_ptr + pairs[:, None] * I + cols[None, :], round_to(h * tw[:, None], h_ptr.dtype.element_ty),
                     mask=m2)
        else:  # GATE_UP_BWD: the pair's row of dx
            tl.store(out_ptr + pairs[:, None] * stride_out + cols[None, :], round_to(acc, out_ptr.dtype.element_ty),
                     mask=m2)


@triton.jit
def _wgrad_kernel(a_ptr, stride_a, b_ptr, stride_b, out_ptr, stride_oe, stride_on, stride_ok, sorted_pairs_ptr,
                  block_start_ptr, N, K, P, TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e, n, k] = sum over expert e's pairs p of a[row_a(p), n] * b[row_b(p), k]; an expert
    with no pairs gets zeros."""
    e = tl.program_id(0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask, k_mask = ns < N, ks < K
    b0 = tl.load(block_start_ptr + e)
    b1 = tl.load(block_start_ptr + e + 1)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for blk in range(b0, b1):
        pairs, tokens, row_mask = _block_rows(sorted_pairs_ptr, blk, P, TOP_K, BLOCK_M)
        ra = tokens if A_BY_TOKEN else pairs
        rb = tokens if B_BY_TOKEN else pairs
        a = tl.load(a_ptr + ra[:, None] * stride_a + ns[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        b = tl.load(b_ptr + rb[:, None] * stride_b + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _dot(tl.trans(a), b.to(a.dtype), IEEE)
    tl.store(out_ptr + e.to(tl.int64) * stride_oe + ns[:, None] * stride_on + ks[None, :] * stride_ok,
             round_to(acc, out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])


# ----------------------------------------------------------------------------- launchers
class _Plan:
    """The expert sort of one call: pairs ordered by expert in blocks of block_m, and each
    expert's first block (block_start [E + 1])."""

    def __init__(self, topk_ids: torch.Tensor, E: int, block_m: int):
        self.block_m = block_m
        self.P = topk_ids.numel()
        self.sorted_pairs, self.block_expert, self.n_blocks = align(topk_ids, E, block_m)
        counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=E)[:E]
        ends = torch.cumsum((counts + block_m - 1) // block_m, 0)
        self.block_start = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)


def _ieee(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 or x.device.type != "cuda"


def _rows(plan, cfg, a, w, strides_w, out, N, K, I, tw, top_k, epi, a_by_token, gu=None, h=None, dtw=None):
    grid = (plan.n_blocks, triton.cdiv(N, cfg["BLOCK_N"]))
    _rows_kernel[grid](a, a.stride(0), w, *strides_w, out, out.stride(0), plan.sorted_pairs, plan.block_expert, tw,
                       gu if gu is not None else out, h if h is not None else out, dtw if dtw is not None else tw,
                       N, K, plan.P, I, TOP_K=top_k, A_BY_TOKEN=a_by_token, EPI=epi, IEEE=_ieee(a),
                       BLOCK_M=plan.block_m, **cfg)


def _wgrad(plan, cfg, a, a_by_token, b, b_by_token, out, top_k):
    E, N, K = out.shape
    grid = (E, triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(K, cfg["BLOCK_K"]))
    _wgrad_kernel[grid](a, a.stride(0), b, b.stride(0), out, *out.stride(), plan.sorted_pairs, plan.block_start,
                        N, K, plan.P, TOP_K=top_k, A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, IEEE=_ieee(a),
                        BLOCK_M=plan.block_m, **cfg)


def forward(x, w_gate_up, w_down, topk_weights, topk_ids):
    """(out [T, H], gu [T*k, 2I]) for validated, row-contiguous x and float32 topk_weights."""
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I, top_k = two_i // 2, topk_ids.shape[1]
    cfg = tiles(x.device)
    plan = _Plan(topk_ids, E, cfg["block_m"])
    P = plan.P
    gu = torch.empty((P, two_i), dtype=x.dtype, device=x.device)
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    # gate rows n and up rows n + I of W_gu[e] ([2I, H]): n along dim 1, k along dim 2
    _rows(plan, cfg["gate_up_fwd"], x, w_gate_up, w_gate_up.stride(), h, I, H, I, topk_weights, top_k,
          GATE_UP_FWD, True, gu=gu)
    rows = torch.empty((P, H), dtype=x.dtype, device=x.device)
    _rows(plan, cfg["down_fwd"], h, w_down, w_down.stride(), rows, H, I, I, topk_weights, top_k, DOWN_FWD, False)
    # the k weighted rows of a token summed in float32, rounded once (torch's reduction accumulates
    # 16-bit inputs in float32)
    out = rows.view(T, top_k, H).sum(1)
    return out, gu


def backward(grad_out, x, w_gate_up, w_down, topk_weights, topk_ids, gu):
    """(dx, dW_gu, dW_d, dtw float32 [T, k]) for the forward's inputs and saved gu."""
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I, top_k = two_i // 2, topk_ids.shape[1]
    cfg = tiles(x.device)
    plan = _Plan(topk_ids, E, cfg["block_m"])
    P, dev = plan.P, x.device
    grad_out = grad_out.to(x.dtype).contiguous()
    dgu = torch.empty((P, two_i), dtype=x.dtype, device=dev)
    hw = torch.empty((P, I), dtype=x.dtype, device=dev)
    c = cfg["down_bwd"]
    dtw_parts = torch.empty((triton.cdiv(I, c["BLOCK_N"]), P), dtype=torch.float32, device=dev)
    # gh = W_d[e]^T grad_out: W_d[e] is [H, I], output n over I (dim 2), k over H (dim 1)
    sd = w_down.stride()
    _rows(plan, c, grad_out, w_down, (sd[0], sd[2], sd[1]), dgu, I, H, I, topk_weights, top_k, DOWN_BWD, True,
          gu=gu, h=hw, dtw=dtw_parts)
    dx_rows = torch.empty((P, H), dtype=x.dtype, device=dev)
    sg = w_gate_up.stride()
    _rows(plan, cfg["gate_up_bwd"], dgu, w_gate_up, (sg[0], sg[2], sg[1]), dx_rows, H, two_i, I, topk_weights,
          top_k, GATE_UP_BWD, False)
    dx = dx_rows.view(T, top_k, H).sum(1)
    dw_gu = torch.empty(w_gate_up.shape, dtype=w_gate_up.dtype, device=dev)
    _wgrad(plan, cfg["wgrad"], dgu, False, x, True, dw_gu, top_k)
    dw_d = torch.empty(w_down.shape, dtype=w_down.dtype, device=dev)
    _wgrad(plan, cfg["wgrad"], grad_out, True, hw, False, dw_d, top_k)
    return dx, dw_gu, dw_d, dtw_parts.sum(0).view(T, top_k)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
