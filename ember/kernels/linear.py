"""The few-row linear: 2..16 rows of activations times a K-contiguous weight on the tensor cores.

``skinny_mm_kernel`` swaps the operands (the 64-row weight tile is the MMA's first operand, the few
activation rows its narrow second one) and splits K up to a few ways (fp32 partials summed in a fixed
order by ``split_k_reduce_kernel``). Two callers:

* ``ember.ops.linear``, 2..16 rows of an unscaled bf16 / fp16 weight on CUDA: ``few_rows_linear``,
  for the weight shapes with a tuning entry (elsewhere cuBLAS).
* ``ember.ops.scaled_mm`` with an fp8 weight (``ember.kernels.fp8``): the default for 2..16 rows and
  ``b = w.t()``.

Tiles (``ember.tuning`` family ``"linear"``, the few-row path of ``ember.ops.linear``): key
``"<N>x<K>"``, the weight's shape, shared by bf16 and fp16 weights (the kernel streams the same bytes
either way; fp32 weights never take it); entry ``{"BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps",
"num_stages"}``. No entry: cuBLAS (the rule). The tuner lists tiles with ``candidates(N, K)`` and times
one with ``few_rows_linear(x, w, b, entry)`` (or ``tuning.override``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember import tuning
from ember.kernels._common import dot_acc, pdl_options, pdl_start, round_to

FAMILY = "linear"
ENTRY_FIELDS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")


@triton.jit
def skinny_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, ws_ptr,
                     M, N, K, k_per_split,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                     stride_sam, stride_sak, stride_sbk, stride_sbn,
                     A_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr, SB_N_GROUP: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP8_DOT: tl.constexpr = False, MAX_IMPRECISE: tl.constexpr = 0, B_SCALED: tl.constexpr = True,
                     PDL: tl.constexpr = False):
    """Few rows (M <= 16), swapped operands: out^T [BLOCK_N, BLOCK_M] = b^T tile @ a^T tile.
    B_SCALED=False: an unscaled b of a's dtype (``few_rows_linear``: bf16 / fp16 weights), no scale
    loaded.

    The weight tile [BLOCK_N, BLOCK_K] is the MMA's first operand, so BLOCK_N = 64 fills Hopper's
    64-row warpgroup MMA and the 16 activation rows are its narrow second operand: a weight tile
    passes through the tensor cores once, upcast to bf16 in registers (e4m3 -> bf16 is exact, so
    fp8 x fp8 products and their fp32 sums are exact too; fp8 MMAs accumulate with less precision,
    measured in tests/ops/test_fp8.py). With fp8 activations and FP8_DOT both operands go to the
    MMA as they are: no upcast in registers, which is what held the bf16 path to ~2.3 TB/s (H200,
    M=16, 8192^2: 18.8 us, against 28-30 us upcast; bench/results/h200/fp8_probe*.json).
    The loop is a plain pipelined stream of weight tiles (``num_stages`` in flight); scales are
    applied after the K loop, or per 128-step for blocks.
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
        elif FP8_DOT:
            pass
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
            acc = dot_acc(w, x, acc, MAX_IMPRECISE)
    if not K_BLOCKED and B_SCALED:
        acc = acc * tl.load(sb_ptr + (offs_n // SB_N_GROUP) * stride_sbn, mask=mask_n, other=0.0)[:, None]
    if not K_BLOCKED and A_SCALED:
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
def split_k_reduce_kernel(ws_ptr, bias_ptr, out_ptr, M, N, stride_om, stride_on,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_start(PDL)
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


# ----------------------------------------------------------------------------- split K
def k_split(M: int, N: int, K: int, split: int, bk: int, out: torch.Tensor):
    """(K per split, a whole number of bk steps; the splits that cover K; the fp32 workspace of their
    partials, or ``out`` itself when K is not split)."""
    k_per_split = -(-K // (split * bk)) * bk
    split = -(-K // k_per_split)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=out.device) if split > 1 else out
    return k_per_split, split, ws


def reduce_splits(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, split: int, pdl: dict) -> None:
    """out = sum of the ``split`` partials in ``ws`` (fixed order) + bias, when K was split."""
    if split > 1:
        M, N = out.shape
        block = 1024
        split_k_reduce_kernel[(triton.cdiv(M * N, block),)](
            ws, bias if bias is not None else out, out, M, N, out.stride(0), out.stride(1),
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl)


# ----------------------------------------------------------------------------- few-row bf16 / fp16 linear
# 2..16 rows of x against an unscaled bf16 / fp16 weight [N, K] (K-contiguous): the dense projections of
# batched decode. cuBLAS picks a split-K GEMM plus a reduce kernel for these (H200, batch-8 Qwen3-30B-A3B
# step timeline: qkv 5120 x 2048 7.96 us against a 5.05 us floor, o_proj 2048 x 4096 7.42 + 1.85 us
# against 4.04; bench/results/h200/step_timeline_b8.json), outside the step's chain of dependent
# launches. The H200 entries (tuning/data/sm_90-nvidia-h200/linear.json) were measured inside the
# batch-8 decode step (bench/results/h200/step_variants_few_rows_b8.json): qkv 128,2,4 + o_proj 128,4,4
# (BLOCK_K, SPLIT_K, num_stages) 7.490-7.515 ms against cuBLAS 7.574-7.604.
def key(N: int, K: int) -> str:
    """The tuning key of an N x K weight, e.g. ``"5120x2048"``."""
    return f"{N}x{K}"


def entry_config(entry: dict) -> dict:
    """A tuning entry checked for ``ENTRY_FIELDS`` (integers >= 1), as the launch config."""
    try:
        cfg = {f: int(entry[f]) for f in ENTRY_FIELDS}
    except (KeyError, TypeError, ValueError):
        cfg = None
    if cfg is None or min(cfg.values()) < 1:
        raise ValueError(f"linear tuning entry {entry!r}: expected integers >= 1 for {', '.join(ENTRY_FIELDS)}")
    return cfg


def few_rows_config(N: int, K: int, device) -> dict | None:
    """The few-row kernel's tile for an N x K bf16 / fp16 weight on ``device`` (its tuning entry), or
    None: cuBLAS. Read per call, so a CUDA graph captured under ``tuning.override`` keeps its tile."""
    entry = tuning.lookup(FAMILY, key(N, K), device)
    return None if entry is None else entry_config(entry)


def candidates(N: int, K: int) -> list[dict]:
    """Tuning entries worth timing for an N x K weight (``ember tune``): the space the H200 sweep
    covered (64-row weight tiles, one Hopper warpgroup MMA)."""
    out = []
    for bk, stages in ((128, 4), (128, 3), (64, 6), (256, 3)):
        for split in (1, 2, 4, 8):
            if K >= split * bk:
                out.append(dict(BLOCK_N=64, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=stages))
    return out


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: dict) -> torch.Tensor:
    """x [M, K] (2 <= M <= 16, any strides) @ weight [N, K].T (+ bias), weight K-contiguous and of x's
    dtype; fp32 accumulation, one rounding (split K: fixed-order fp32 sums, then one rounding).
    ``cfg``: :func:`few_rows_config`'s tile, or a tuning entry."""
    cfg = entry_config(cfg)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bk = cfg["BLOCK_K"]
    k_per_split, split, ws = k_split(M, N, K, cfg["SPLIT_K"], bk, out)
    on_gpu = x.device.type == "cuda"
    pdl = pdl_options(x.device)
    skinny_mm_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), split)](
        x, weight, weight, weight, bias if bias is not None else out, out, ws,  # sa, sb: unused pointers
        M, N, K, k_per_split,
        x.stride(0), x.stride(1), weight.stride(1), weight.stride(0), out.stride(0), out.stride(1),
        0, 0, 0, 0,
        A_SCALED=False, K_BLOCKED=False, SB_N_GROUP=1, HAS_BIAS=bias is not None, SPLIT_K=split,
        DOT_F32=not on_gpu, IEEE=not on_gpu or x.dtype == torch.float32, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=bk, B_SCALED=False, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    reduce_splits(ws, bias, out, split, pdl)
    return out


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
