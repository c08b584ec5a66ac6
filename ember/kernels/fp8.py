"""Triton kernels for FP8: activation quantisation and scaled matmul (GEMV and GEMM regimes).

``scaled_mm`` has a GEMV kernel, a few-row kernel and one tiled kernel, chosen by M and b's layout:
* M == 1 with a K-contiguous b (``w.t()``, what Fp8Linear passes): the GEMV kernel shared with
  ``ember.ops.linear`` (``ember.kernels.gemv``): one launch, K-fastest tiles, one warp per weight
  row, no split-K. Its config rule and the H200 measurements behind it are in ``gemv.gemv_config``.
* 2 <= M <= 16 with a K-contiguous b (decode batches through Fp8Linear): ``_skinny_mm_kernel``,
  swapped operands (the 64-row weight tile is the MMA's first operand, the few activation rows its
  narrow second one), split K up to 4 ways (``_skinny_config`` has the H200 figures).
* M <= 16 otherwise: memory-bound; each weight byte is read once. Programs tile N finely and split K
  (fp32 partials to a workspace, summed by a small second kernel) so that every SM has several
  programs streaming weight bytes. M == 1 multiplies on the CUDA cores (no padding to a 16-row MMA);
  2..16 rows use one 16-row tl.dot.
* M > 16: compute-bound; 128-wide tiles on the tensor cores (fp8 x fp8 dot on sm_89+; weight-only
  mode upcasts weight tiles to the activation dtype in registers), grouped tile order for L2 reuse.

Scales are read through (row, column) strides, so one kernel serves every granularity: stride 0
broadcasts a tensor scale, per-row / per-column scales stride along one axis, and 128-blocks stride
along K (applied to each 128-wide K step) and along N in groups of 128.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.kernels import gemv
from ember.kernels._common import pdl_options, pdl_start, round_to

# tl.constexpr: @triton.jit code may read module globals only in this form (the interpreter is laxer)
FP8_MAX = tl.constexpr(448.0)
AMAX_EPS = tl.constexpr(1e-12)
SCALE_BLOCK = 128


# ============================================================================= quantisation
@triton.jit
def _to_e4m3_bits(x):
    """fp32 (already clamped to +-448) -> e4m3fn bit pattern, round-to-nearest-even.

    Rounded on the bits so the GPU and Triton's interpreter agree: the interpreter's own fp32 -> fp8
    cast returns half the right value when rounding carries into the exponent (31.3 -> 16), and
    turns NaN into 384. Normal range: round the fp32 mantissa to 3 bits; subnormals (< 2^-6): round
    to a multiple of 2^-9 with the add-and-subtract trick; the result is exactly representable, so
    the final cast is exact everywhere.
    """
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = (tl.abs(x) + 24576.0) - 24576.0  # 24576 = 1.5 * 2^14: fp32 spacing there is 2^-9
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    y = tl.where(tl.abs(x) < 0.015625, sub, normal)
    y8 = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return tl.where(x != x, 0x7F, y8).to(tl.uint8)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_sr, stride_sg, GROUP,
                     CHUNK: tl.constexpr):
    """One program per (row, column group); two passes over the group: amax, then quantise."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(start, end, CHUNK):
        cols = c + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        ax = tl.where(ax == float("inf"), 0.0, ax)  # inf saturates, it does not set the scale
        amax = tl.maximum(amax, tl.where(x == x, ax, 0.0))  # nor does NaN
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), AMAX_EPS), FP8_MAX)
    tl.store(s_ptr + row * stride_sr + g * stride_sg, scale)
    for c in range(start, end, CHUNK):
        cols = c + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
        y = tl.math.div_rn(x, scale)
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
        tl.store(q_ptr + row * stride_q + cols, _to_e4m3_bits(y), mask=cols < end)


def quantize(x: torch.Tensor, granularity: str, block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (``granularity="row"``) or 1 x bc block quantisation of a validated ``x``."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    group = K if granularity == "row" else int(block_size[1])
    n_groups = -(-K // group)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((R, n_groups), dtype=torch.float32, device=x.device)
    if R and K:
        chunk = min(triton.next_power_of_2(group), 4096)
        _quantize_kernel[(R, n_groups)](x2, q.view(torch.uint8).view(R, K), scale, K, x2.stride(0), K,
                                        scale.stride(0), scale.stride(1), group, CHUNK=chunk,
                                        num_warps=max(1, min(8, chunk // 256)))
    if granularity == "row":
        return q, scale.view(x.shape[:-1] + (1,))
    return q, scale


# ============================================================================= scaled matmul
@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, ws_ptr,
                      M, N, K, k_per_split,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                      stride_sam, stride_sak, stride_sbk, stride_sbn,
                      A_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr, SB_N_GROUP: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                      IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # ---- tile coordinates (grouped order: GROUP_M row tiles share each column tile in L2)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_m64 = offs_m.to(tl.int64)
    offs_n64 = offs_n.to(tl.int64)

    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_end
        b = tl.load(b_ptr + ks[:, None] * stride_bk + offs_n64[None, :] * stride_bn,
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # [BK, BN] fp8
        if BLOCK_M == 1:
            # decode row: CUDA-core multiply + reduce over K, no MMA padding
            a = tl.load(a_ptr + offs_m64[None, :] * stride_am + ks[:, None] * stride_ak,
                        mask=mask_k[:, None] & mask_m[None, :], other=0.0)  # [BK, 1]
            part = tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=0)[None, :]
        else:
            a = tl.load(a_ptr + offs_m64[:, None] * stride_am + ks[None, :] * stride_ak,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
            if DOT_F32:
                # Triton's interpreter (CPU CI) multiplies bf16 dot operands wrongly; fp32 is exact
                a, b = a.to(tl.float32), b.to(tl.float32)
            elif A_SCALED:
                if not FP8_DOT:  # e4m3 -> bf16 is exact, so this is the same product
                    a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
            else:
                b = b.to(a.dtype)
            if K_BLOCKED:
                if IEEE:
                    part = tl.dot(a, b, input_precision="ieee")
                else:
                    part = tl.dot(a, b)
            elif IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                # accumulate inside the dot: a separate `acc += part` kept Triton from pipelining
                # the loads (one shared-memory stage instead of num_stages, seen compiling for sm_90)
                acc = tl.dot(a, b, acc)
        if K_BLOCKED:
            # BLOCK_K == 128 and k0 is a multiple of 128: one scale block along K per step
            kb = k0 // BLOCK_K
            sb = tl.load(sb_ptr + kb * stride_sbk + (offs_n // SB_N_GROUP) * stride_sbn, mask=mask_n, other=0.0)
            part = part * sb[None, :]
            if A_SCALED:
                sa = tl.load(sa_ptr + offs_m64 * stride_sam + kb * stride_sak, mask=mask_m, other=0.0)
                part = part * sa[:, None]
            acc += part
        elif BLOCK_M == 1:
            acc += part
    if not K_BLOCKED:
        sb = tl.load(sb_ptr + (offs_n // SB_N_GROUP) * stride_sbn, mask=mask_n, other=0.0)
        acc = acc * sb[None, :]
        if A_SCALED:
            sa = tl.load(sa_ptr + offs_m64 * stride_sam, mask=mask_m, other=0.0)
            acc = acc * sa[:, None]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m64[:, None] * stride_om + offs_n64[None, :] * stride_on,
                 round_to(acc, out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(ws + offs_m64[:, None] * N + offs_n64[None, :], acc, mask=mask)


@triton.jit
def _skinny_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, ws_ptr,
                      M, N, K, k_per_split,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                      stride_sam, stride_sak, stride_sbk, stride_sbn,
                      A_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr, SB_N_GROUP: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
                      IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Few rows (M <= 16), swapped operands: out^T [BLOCK_N, BLOCK_M] = b^T tile @ a^T tile.

    The weight tile [BLOCK_N, BLOCK_K] is the MMA's first operand, so BLOCK_N = 64 fills Hopper's
    64-row warpgroup MMA and the 16 activation rows are its narrow second operand: a weight tile
    passes through the tensor cores once, upcast to bf16 in registers (e4m3 -> bf16 is exact, so
    fp8 x fp8 products and their fp32 sums are exact too; fp8 MMAs accumulate with less precision,
    measured in tests/ops/test_fp8.py). The loop is a plain pipelined stream of weight tiles
    (``num_stages`` in flight); scales are applied after the K loop, or per 128-step for blocks.
    """
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    offs_n64 = offs_n.to(tl.int64)
    offs_m64 = offs_m.to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < k_end
        w = tl.load(b_ptr + offs_n64[:, None] * stride_bn + ks[None, :] * stride_bk,
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BN, BK] fp8
        x = tl.load(a_ptr + offs_m64[None, :] * stride_am + ks[:, None] * stride_ak,
                    mask=mask_k[:, None] & mask_m[None, :], other=0.0)  # [BK, BM]
        if DOT_F32:  # interpreter (CPU CI): bf16 dot operands are multiplied wrongly there; fp32 is exact
            w, x = w.to(tl.float32), x.to(tl.float32)
        elif A_SCALED:  # fp8 activations: both operands to bf16, exactly
            w, x = w.to(tl.bfloat16), x.to(tl.bfloat16)
        else:
            w = w.to(x.dtype)
        if K_BLOCKED:  # BLOCK_K == 128, k0 a multiple of 128: one scale block along K per step
            part = tl.dot(w, x, input_precision="ieee") if IEEE else tl.dot(w, x)
            kb = k0 // BLOCK_K
            sb = tl.load(sb_ptr + kb * stride_sbk + (offs_n // SB_N_GROUP) * stride_sbn, mask=mask_n, other=0.0)
            part = part * sb[:, None]
            if A_SCALED:
                sa = tl.load(sa_ptr + offs_m64 * stride_sam + kb * stride_sak, mask=mask_m, other=0.0)
                part = part * sa[None, :]
            acc += part
        elif IEEE:
            acc = tl.dot(w, x, acc, input_precision="ieee")
        else:
            # accumulate inside the dot: a separate `acc += part` leaves the loads unpipelined (sm_90
            # TTGIR: plain ld.global + st.shared each step, no cp.async; 30 us at 8192^2, M=16, H200)
            acc = tl.dot(w, x, acc)
    if not K_BLOCKED:
        acc = acc * tl.load(sb_ptr + (offs_n // SB_N_GROUP) * stride_sbn, mask=mask_n, other=0.0)[:, None]
        if A_SCALED:
            acc = acc * tl.load(sa_ptr + offs_m64 * stride_sam, mask=mask_m, other=0.0)[None, :]
    mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m64[None, :] * stride_om + offs_n64[:, None] * stride_on,
                 round_to(acc, out_ptr.dtype.element_ty), mask=mask)
    else:
        ws = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(ws + offs_m64[None, :] * N + offs_n64[:, None], acc, mask=mask)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, stride_on,
                           SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: deterministic sums
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    m = offs // N
    tl.store(out_ptr + m * stride_om + n * stride_on, round_to(acc, out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- configuration
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fp8_dot_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _gemv_config(N: int, K: int, k_blocked: bool) -> dict:
    """M == 1, K-contiguous fp8 b: the shared GEMV's rule (measured table in ember.kernels.gemv)."""
    return gemv.gemv_config(N, K, 1, k_blocked)


def _skinny_config(N: int, K: int, k_blocked: bool, device: torch.device) -> dict:
    """2..16 rows, K-contiguous fp8 b (Fp8Linear's ``w.t()``): the swapped-operand MMA kernel.

    64 weight rows a program (one Hopper warpgroup MMA), 128-wide K steps, K split up to 4 ways
    for >= 2 programs an SM. H200, M=16, weight-only, graph-timed (bench/results/h200/fp8_skinny_sweep.json):
    8192^2 29.3 us (split 4, 3 stages; the previous 16-row dot kernel 27.9-29.7, bf16 F.linear 33.8);
    4096^2 11.5 us (split 4; previous 13.4, bf16 13.6). Far from the 16.2 us floor at 8192^2: the weight
    tile goes global -> shared (cp.async) -> registers -> bf16 -> MMA, and Triton's mixed-input
    warpgroup MMA path streams ~2.3 TB/s here.
    """
    bn, bk = 64, 128
    tiles_n = -(-N // bn)
    split = 1
    while tiles_n * split < 2 * _sm_count(device) and split < 4 and K // (split * 2) >= 2 * bk:
        split *= 2
    return dict(SKINNY=True, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=3)


def _config(M: int, N: int, K: int, k_blocked: bool, device: torch.device,
            b_k_contiguous: bool = False) -> dict:
    """Tile sizes by regime (measured on the H200; see ember/bench/fp8.py)."""
    override = os.environ.get("EMBER_FP8_CONFIG")
    if override and override.startswith("gemv,"):  # "gemv,BN,CHUNKS,KW,warps"
        bn, c, kw, w = (int(v) for v in override.split(",")[1:])
        return dict(GEMV=True, BLOCK_N=bn, CHUNKS=c, KW=kw, num_warps=w)
    if override and override.startswith("skinny,"):  # "skinny,BN,BK,SPLIT,warps,stages"
        bn, bk, sk, w, st = (int(v) for v in override.split(",")[1:])
        return dict(SKINNY=True, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=st)
    if override:  # "BM,BN,BK,SPLIT,warps,stages" for tuning sweeps
        bm, bn, bk, sk, w, s = (int(v) for v in override.split(","))
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=s, GROUP_M=8)
    if M == 1 and b_k_contiguous:
        return _gemv_config(N, K, k_blocked)
    if M <= 16 and b_k_contiguous:
        return _skinny_config(N, K, k_blocked, device)
    if M <= 16:
        bm = 1 if M == 1 else 16
        bn, bk = (64, 128) if k_blocked else (64, 256)
        tiles_n = -(-N // bn)
        # enough programs for ~4 per SM streaming weight bytes, each with >= 4 K steps
        want = 4 * _sm_count(device)
        split = 1
        while tiles_n * split < want and K // (split * 2) >= 4 * bk:
            split *= 2
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=3, GROUP_M=1)
    if M <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4, GROUP_M=8)
    return dict(BLOCK_M=128, BLOCK_N=256 if N >= 256 and not k_blocked else 128, BLOCK_K=128, SPLIT_K=1,
                num_warps=8, num_stages=3, GROUP_M=8)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None, kind_a: str | None,
              scale_b: torch.Tensor, kind_b: str, bias: torch.Tensor | None, out_dtype: torch.dtype,
              config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on validated operands (``ember.ops.fp8.scaled_mm`` checks shapes, dtypes, devices).

    ``config`` overrides the tile choice (tests and tuning); ``out`` is an [M, N] buffer to fill.
    """
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    k_blocked = kind_b == "block" or kind_a == "block"
    cfg = dict(config or _config(M, N, K, k_blocked, a.device, b_k_contiguous=b.stride(0) == 1))
    if cfg.get("GEMV"):
        if M != 1 or b.stride(0) != 1:
            raise ValueError(f"config: the GEMV kernel needs M == 1 and a K-contiguous b, got M={M}, "
                             f"b.stride()={tuple(b.stride())}")
        return _launch_gemv(a, b, scale_a, kind_a, scale_b, kind_b, bias, out, k_blocked, cfg)
    skinny = cfg.get("SKINNY", False)
    if skinny and M > 16:
        raise ValueError(f"config: the few-row kernel takes M <= 16, got M={M}")
    if skinny:
        cfg["BLOCK_M"] = 16
    if k_blocked:
        cfg["BLOCK_K"] = SCALE_BLOCK  # one K scale block per step
    if a.dtype == torch.float32 and cfg["BLOCK_M"] > 1:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 64)  # fp32 tiles: keep shared memory in bounds
    split = cfg["SPLIT_K"]
    bk = cfg["BLOCK_K"]
    k_per_split = -(-K // (split * bk)) * bk
    split = -(-K // k_per_split)
    # scale strides: (row/K axis, column/N axis); 0 broadcasts
    if kind_a is None:
        sa, s_am, s_ak = b, 0, 0  # unused pointer
    elif kind_a == "tensor":
        sa, s_am, s_ak = scale_a, 0, 0
    elif kind_a == "row":
        sa, s_am, s_ak = scale_a, scale_a.stride(0), 0
    else:
        sa, s_am, s_ak = scale_a, scale_a.stride(0), scale_a.stride(1)
    s_bk, s_bn, group = _b_scale_strides(scale_b, kind_b)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    if skinny:
        _skinny_mm_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), split)](
            a, b, sa, scale_b, bias if bias is not None else out, out, ws,
            M, N, K, k_per_split,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            s_am, s_ak, s_bk, s_bn,
            A_SCALED=kind_a is not None, K_BLOCKED=k_blocked, SB_N_GROUP=group, HAS_BIAS=bias is not None,
            SPLIT_K=split, DOT_F32=a.device.type != "cuda",
            IEEE=a.device.type != "cuda" or a.dtype == torch.float32, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(a.device))
    else:
        _scaled_mm_kernel[(triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split)](
            a, b, sa, scale_b, bias if bias is not None else out, out, ws,
            M, N, K, k_per_split,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            s_am, s_ak, s_bk, s_bn,
            A_SCALED=kind_a is not None, K_BLOCKED=k_blocked, SB_N_GROUP=group, HAS_BIAS=bias is not None,
            SPLIT_K=split, FP8_DOT=_fp8_dot_supported(a.device), DOT_F32=a.device.type != "cuda",
            IEEE=a.device.type != "cuda" or a.dtype == torch.float32,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(M * N, block),)](
            ws, bias if bias is not None else out, out, M, N, out.stride(0), out.stride(1),
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out


def _b_scale_strides(scale_b, kind_b) -> tuple[int, int, int]:
    """(stride along K, stride along N, columns per scale) of b's scale; 0 strides broadcast."""
    if kind_b == "tensor":
        return 0, 0, 1
    if kind_b == "row":
        return 0, scale_b.stride(1), 1
    return scale_b.stride(0), scale_b.stride(1), SCALE_BLOCK


def _launch_gemv(a, b, scale_a, kind_a, scale_b, kind_b, bias, out, k_blocked, cfg) -> torch.Tensor:
    K, N = b.shape
    # scale strides along K and N (0 broadcasts); only M == 1 here, so a's row stride is irrelevant
    s_ak = scale_a.stride(1) if kind_a == "block" else 0
    s_bk, s_bn, group = _b_scale_strides(scale_b, kind_b)
    return gemv.launch(a, a.stride(1), b, b.stride(1), N, K, out, out.stride(1), bias, cfg,
                       scale_a=scale_a if kind_a is not None else None, stride_sak=s_ak,
                       scale_b=scale_b, stride_sbk=s_bk, stride_sbn=s_bn, sb_n_group=group,
                       k_blocked=k_blocked)
