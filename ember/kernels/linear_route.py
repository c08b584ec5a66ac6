"""A decoder layer's output projection, post-attention add_rmsnorm and MoE routing in one launch (one row).

At batch-1 decode the router launch (add_rmsnorm + router GEMV + softmax top-k) adds ~5 us a layer
to the H200 Qwen3-30B-A3B step for 0.5 MB of weights; with the launch taken out (fixed routing) the
fp8 step went 1.816 -> 1.606 ms (bench/results/h200/launch_removal_fp8.json). The router reads the
whole normalised row, and the norm needs the whole row's sum of squares, so it cannot start before
every output of the projection exists. But the router is linear in the row and the norm is one
scale per row:

    logits[e] = sum_j R[e, j] * normed[j],  normed[j] ~= h[j] * lnw[j] / rms(h)
              = (1 / rms(h)) * sum_j R[e, j] * h[j] * lnw[j]

so each program of the projection GEMV, which owns BLOCK_N outputs j, also computes its share of
every expert's sum and of sum h^2 from its own h[j] (h = projection + residual, rounded as
add_rmsnorm stores it) and stores them; the last program to arrive (acq_rel counter) adds the shares
in program order (the same bits whichever program is last), scales by 1 / rms, rounds the logits to
the I/O dtype (as F.linear returns them), routes (the router kernel's softmax top-k) and writes the
normalised row for the expert GEMVs. One rounding differs from the two-op path: the router
multiplies h * lnw / rms unrounded where add_rmsnorm rounds the normalised row to the I/O dtype
first (the same kind of difference as the deferred pre-attention norm, ARCHITECTURE.md).

The projection loop is the shared GEMV's (``gemv._weight_tile`` / ``gemv._accumulate``); its tiles
are wider (16 rows a program, so at most 128-256 programs' shares to add).

Measured slower, so the models take it only as an opt-in (``EMBER_LINEAR_ROUTE=1``). H200 Qwen3-30B-A3B
fp8 decode step at a 400 cache (bench/results/h200/step_variants_linear_route_*.json, same weights):
two launches 1.79-1.82 ms; this launch 1.97 (16 rows on 16 warps), 1.87 (8 warps), 1.85 (4 warps,
4 chunks: the best), 2.06-2.54 for the other tiles swept; bf16 2.21 vs 2.30. Where it goes: the
plain o_proj GEMV on this kernel's default tile (16 rows, 16 warps) is as fast as on its own (1.788
vs 1.787 ms), so the ~3.7 us a layer lost is the routing tail of the last program (the shares'
[programs, experts] reduction, the softmax and the eight picks, each a cross-warp reduction over 16
warps, where the router launch's last program has 4). On the 4-warp tile the one launch does beat
the two launches on that same tile (1.85 vs 1.89 ms): the launch boundary itself is worth ~0.9 us
a layer, against the ~4.4 us of the whole router launch (1.816 -> 1.606 ms with fixed routing).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels._common import arrival_counters, parse_ints, pdl_options, pdl_start, round_to
from ember.kernels.gemv import ROW_BYTES, _accumulate, _weight_tile
from ember.kernels.moe import softmax_topk

MAX_PROGRAMS = 256  # the last program adds a [programs, experts] tile of shares
MAX_EXPERTS = 256
MAX_HIDDEN = 8192  # the last program writes the normalised row as one [hidden] vector


@triton.jit
def _linear_route_kernel(a_ptr, w_ptr, s_ptr, res_ptr, lnw_ptr, router_ptr,
                         new_res_ptr, normed_ptr, part_ptr, ss_ptr, cnt_ptr, tw_ptr, ids_ptr,
                         N, K, E, n_prog, eps,
                         B_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, KW: tl.constexpr,
                         EVEN_K: tl.constexpr, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_KK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
                         PACKED: tl.constexpr = True, PDL: tl.constexpr = False):
    """Program p: outputs j = p * BLOCK_N .. of ``a @ w.T`` (x row scale ``s`` when B_SCALED), then
    h = round(out) + residual (rounded), its shares of sum h^2 and of R @ (h * lnw); the last of the
    n_prog programs routes (module docstring). part_ptr: [n_prog, BLOCK_E] fp32, ss_ptr: [n_prog]."""
    pid = tl.program_id(0)
    dt = a_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = (w_ptr + offs_n.to(tl.int64) * K)[:, None, None]
    mask_rows = mask_n[:, None, None]
    offs_c = tl.arange(0, CHUNKS)
    offs_k = offs_c[None, :, None] * KW + tl.arange(0, KW)[None, None, :]
    shape: tl.constexpr = (BLOCK_N, CHUNKS, KW)
    acc = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    ss = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)  # unused (the GEMV's folded-norm sums)
    offs_e = tl.arange(0, BLOCK_E)
    # before waiting for the previous kernel: weights nothing writes (the first tile, the router's columns)
    w = _weight_tile(rows, offs_k, mask_rows, K, False, EVEN_K)
    r_cols = tl.load(router_ptr + offs_e[:, None] * N + offs_n[None, :],
                     mask=(offs_e < E)[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    pdl_start(PDL)
    acc, ss = _accumulate(acc, ss, w, a_ptr, offs_k, 0, K, 1, s_ptr, s_ptr, 0, 0, 0, offs_c, offs_n, mask_n,
                          a_ptr, a_ptr, a_ptr, False, shape, False, False, 1, EVEN_K, True, False)
    for k0 in range(CHUNKS * KW, K, CHUNKS * KW):
        ks = k0 + offs_k
        w = _weight_tile(rows, ks, mask_rows, K, False, EVEN_K)
        acc, ss = _accumulate(acc, ss, w, a_ptr, ks, k0, K, 1, s_ptr, s_ptr, 0, 0, 0, offs_c, offs_n, mask_n,
                              a_ptr, a_ptr, a_ptr, False, shape, False, False, 1, EVEN_K, True, False)
    out = tl.sum(acc, axis=1)
    if B_SCALED:
        out = out * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    # the projection's output as ops.linear stores it, then add_rmsnorm's residual sum
    r = tl.load(res_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    h = round_to(round_to(out, dt).to(tl.float32) + r, dt).to(tl.float32)
    tl.store(new_res_ptr + offs_n, h.to(new_res_ptr.dtype.element_ty), mask=mask_n)
    h = tl.where(mask_n, h, 0.0)
    lw = tl.load(lnw_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(part_ptr + pid * BLOCK_E + offs_e, tl.sum(r_cols * (h * lw)[None, :], axis=1))
    tl.store(ss_ptr + pid, tl.sum(h * h, axis=0))
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        offs_p = tl.arange(0, BLOCK_P)
        parts = tl.load(part_ptr + offs_p[:, None] * BLOCK_E + offs_e[None, :], mask=(offs_p < n_prog)[:, None],
                        other=0.0, volatile=True)
        ss_all = tl.load(ss_ptr + offs_p, mask=offs_p < n_prog, other=0.0, volatile=True)
        offs_h = tl.arange(0, BLOCK_H)
        hv = tl.load(new_res_ptr + offs_h, mask=offs_h < N, other=0.0, volatile=True).to(tl.float32)
        lw_all = tl.load(lnw_ptr + offs_h, mask=offs_h < N, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(ss_all, axis=0) / N + eps)
        tl.store(normed_ptr + offs_h, round_to(hv * inv_rms * lw_all, dt), mask=offs_h < N)
        in_range = offs_e < E
        logits = round_to(tl.sum(parts, axis=0) * inv_rms, dt).to(tl.float32)
        ws, ids = softmax_topk(tl.where(in_range, logits, -float("inf")), offs_e, in_range, TOP_K, RENORM,
                               BLOCK_E, BLOCK_KK, PACKED)
        kk = tl.arange(0, BLOCK_KK)
        tl.store(tw_ptr + kk, ws, mask=kk < TOP_K)
        tl.store(ids_ptr + kk, ids, mask=kk < TOP_K)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def tile(N: int, K: int, elsize: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, CHUNKS, KW, num_warps) for an N x K weight of ``elsize``-byte elements.

    One weight row per warp and a whole 4096-wide K row in one step (as the shared GEMV's measured
    o_proj tiles: 2 rows on 2 warps fp8, 8 rows on 8 warps bf16), 16 rows a program so that N = 2048
    gives 128 programs' shares to add; ``EMBER_LINEAR_ROUTE_TILE=BLOCK_N,CHUNKS,num_warps`` overrides
    it (decode-step sweeps; read per call)."""
    kw = min(ROW_BYTES // elsize, triton.next_power_of_2(K))
    block_n = max(16, triton.next_power_of_2(triton.cdiv(N, 128)))
    chunks = min(triton.next_power_of_2(triton.cdiv(K, kw)), 4096 // kw)
    warps = 16 if device.type == "cuda" else 4
    env = os.environ.get("EMBER_LINEAR_ROUTE_TILE", "")
    if env:
        block_n, chunks, warps = parse_ints("EMBER_LINEAR_ROUTE_TILE", env, "BLOCK_N,CHUNKS,num_warps")
        for name, v in (("BLOCK_N", block_n), ("CHUNKS", chunks), ("num_warps", warps)):
            if v & (v - 1):
                raise ValueError(f"EMBER_LINEAR_ROUTE_TILE: expected {name} a power of 2, got {v}")
    return block_n, chunks, kw, warps


def fits(N: int, E: int, block_n: int) -> bool:
    """Whether the one-launch path takes a projection of N outputs and E experts with BLOCK_N rows a program."""
    return E <= MAX_EXPERTS and N <= MAX_HIDDEN and triton.cdiv(N, block_n) <= MAX_PROGRAMS


def linear_add_norm_route(a: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor | None,
                          residual: torch.Tensor, norm_weight: torch.Tensor, router: torch.Tensor, top_k: int,
                          renormalize: bool, eps: float):
    """One row ``a [1, K]``; ``weight [N, K]`` (bf16/fp16/fp32 as ``a``, or float8_e4m3fn with an fp32
    ``row_scale [N]``), ``residual``, ``norm_weight [N]``, ``router [E, N]``, all contiguous (validated by
    ``ember.ops.linear_add_rmsnorm_route_hidden``). Returns (normed, new_residual, topk_weights, topk_ids)."""
    N, K = weight.shape
    E = router.shape[0]
    block_n, chunks, kw, warps = tile(N, K, weight.element_size(), a.device)
    if not fits(N, E, block_n):
        raise ValueError(f"linear_add_norm_route: {N} outputs in {block_n}-row programs and {E} experts exceed "
                         f"{MAX_PROGRAMS} programs / {MAX_EXPERTS} experts / {MAX_HIDDEN} outputs")
    n_prog = triton.cdiv(N, block_n)
    block_e = triton.next_power_of_2(E)
    normed = torch.empty((1, N), dtype=a.dtype, device=a.device)
    new_res = torch.empty((1, N), dtype=a.dtype, device=a.device)
    parts = torch.empty((n_prog, block_e), dtype=torch.float32, device=a.device)
    ss = torch.empty((n_prog,), dtype=torch.float32, device=a.device)
    w = torch.empty((1, top_k), dtype=torch.float32, device=a.device)
    ids = torch.empty((1, top_k), dtype=torch.int32, device=a.device)
    _linear_route_kernel[(n_prog,)](
        a, weight, row_scale if row_scale is not None else parts, residual, norm_weight, router,
        new_res, normed, parts, ss, arrival_counters("linear_route", a.device, 1), w, ids,
        N, K, E, n_prog, float(eps),
        B_SCALED=row_scale is not None, BLOCK_N=block_n, CHUNKS=chunks, KW=kw, EVEN_K=K % (chunks * kw) == 0,
        TOP_K=top_k, RENORM=renormalize, BLOCK_E=block_e, BLOCK_KK=triton.next_power_of_2(top_k),
        BLOCK_P=triton.next_power_of_2(n_prog), BLOCK_H=triton.next_power_of_2(N),
        PACKED=os.environ.get("EMBER_ROUTER_PACKED_TOPK", "1") != "0", num_warps=warps, num_stages=1,
        **pdl_options(a.device))
    return normed, new_res, w, ids
