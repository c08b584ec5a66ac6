"""Triton kernels for FP8: activation quantisation and scaled matmul (GEMV and GEMM regimes).

``scaled_mm`` has a GEMV kernel, a few-row kernel and two tiled kernels, chosen by M and the operands:
* M == 1 with a K-contiguous b (``w.t()``, what Fp8Linear passes): the GEMV kernel shared with
  ``ember.ops.linear`` (``ember.kernels.gemv``): one launch, K-fastest tiles, one warp per weight
  row, no split-K. Its config rule and the H200 measurements behind it are in ``gemv.gemv_config``.
* 2 <= M <= 16 with a K-contiguous b (decode batches through Fp8Linear): ``ember.kernels.linear``'s
  ``skinny_mm_kernel``, swapped operands (the 64-row weight tile is the MMA's first operand, the few activation rows its
  narrow second one), split K up to 4 ways (``_skinny_config`` has the H200 figures). fp8
  activations on sm_89+ go to the MMA as fp8 (no upcast in registers).
* M <= 16 otherwise: memory-bound; each weight byte is read once. Programs tile N finely and split K
  (fp32 partials to a workspace, summed by a small second kernel) so that every SM has several
  programs streaming weight bytes. M == 1 multiplies on the CUDA cores (no padding to a 16-row MMA);
  2..16 rows use one 16-row tl.dot.
* M > 16: compute-bound; 128-wide tiles on the tensor cores (fp8 x fp8 dot on sm_89+; weight-only
  mode upcasts weight tiles to the activation dtype in registers), grouped tile order for L2 reuse.
  Past 64 rows, fp8 x fp8 with tensor / row scales and K-contiguous 16-byte-aligned operands on
  sm_90+ takes ``_scaled_mm_tma_kernel`` (tiles fed by TMA descriptors); the rest takes the
  pointer-fed ``_scaled_mm_kernel``.

Tiles (``ember.tuning`` family ``"fp8"``): key ``"<a>:<scale_a>-<scale_b>:<M>x<N>x<K>"`` (``key``),
with ``<a>`` the activation dtype (``fp8``, or ``bf16`` / ``fp16`` / ``fp32`` for weight-only) and the
scale kinds ``none`` / ``tensor`` / ``row`` / ``block``, e.g. ``"fp8:row-row:4096x8192x8192"``; entries
are for the K-contiguous ``b = w.t()`` that Fp8Linear passes. An entry names its kernel and tile
(``ENTRY_FIELDS``): ``{"kernel": "gemv", "BLOCK_N", "CHUNKS", "KW", "num_warps"[, "STEP_REDUCE"]}``,
``{"kernel": "skinny", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"[, "FP8_DOT"]}``,
``{"kernel": "tiled", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages",
"GROUP_M"}`` or ``{"kernel": "tma", "BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages",
"GROUP_M"}``. No entry: the rule (``rule``; at M == 1 it asks the ``"gemv"`` family for the
weight's tile, key ``"fp8:<N>x<K>"``). The tuner lists entries with ``candidates`` and times one with
``scaled_mm(..., config=entry)`` (or ``tuning.override``). TMA needs sm_90 and fp8 MMAs sm_89: an
entry asking for them elsewhere is refused or runs the bf16 MMA.

Scales are read through (row, column) strides, so one kernel serves every granularity: stride 0
broadcasts a tensor scale, per-row / per-column scales stride along one axis, and 128-blocks stride
along K (applied to each 128-wide K step) and along N in groups of 128.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ember.kernels._cache_keys import settle_cache_keys
from ember import _switches, tuning
from ember.kernels import gemv
from ember.kernels._common import dot_acc, pdl_options, pdl_start, round_to
from ember.kernels.linear import k_split, reduce_splits, skinny_mm_kernel

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
                     CHUNK: tl.constexpr, ONE_PASS: tl.constexpr, NATIVE_CVT: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    """One program per (row, column group): amax, then quantise.

    ONE_PASS (the group fits one CHUNK) keeps the group in registers between the two steps; longer
    groups stream it twice. H200, 16 x 8192 bf16 rows (a decode batch), graph-timed
    (bench/results/h200/fp8_probe*.json): 4.3 us with two passes of 4096-wide chunks and the bit-level
    rounding, 3.1 us one pass, 2.3 us one pass with the hardware cast (NATIVE_CVT).
    """
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    offs = tl.arange(0, CHUNK)
    if ONE_PASS:
        cols = start + offs
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
        scale = _group_scale(_finite_abs(x))
        tl.store(s_ptr + row * stride_sr + g * stride_sg, scale)
        tl.store(q_ptr + row * stride_q + cols, _quantized_bits(x, scale, NATIVE_CVT), mask=cols < end)
    else:
        amax = tl.zeros([CHUNK], dtype=tl.float32)
        for c in range(start, end, CHUNK):
            cols = c + offs
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, _finite_abs(x))
        scale = _group_scale(amax)
        tl.store(s_ptr + row * stride_sr + g * stride_sg, scale)
        for c in range(start, end, CHUNK):
            cols = c + offs
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + cols, _quantized_bits(x, scale, NATIVE_CVT), mask=cols < end)


@triton.jit
def _finite_abs(x):
    """|x| with inf and NaN as 0: inf saturates and NaN stays NaN, neither sets the scale."""
    ax = tl.abs(x)
    return tl.where((x == x) & (ax != float("inf")), ax, 0.0)


@triton.jit
def _group_scale(amax):
    return tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), AMAX_EPS), FP8_MAX)


@triton.jit
def _quantized_bits(x, scale, NATIVE_CVT: tl.constexpr):
    """e4m3 bytes of x / scale, saturated. NATIVE_CVT (GPU): the hardware's round-to-nearest-even
    cast, which gives the same bytes as the bit-level rounding the interpreter needs."""
    y = tl.math.div_rn(x, scale)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    if NATIVE_CVT:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _to_e4m3_bits(y)


# one-pass groups up to this many columns (16 warps hold 16384 fp32 values at 32 a thread)
ONE_PASS_MAX = 16384


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
        one_pass = group <= ONE_PASS_MAX
        chunk = triton.next_power_of_2(group) if one_pass else 4096
        _quantize_kernel[(R, n_groups)](x2, q.view(torch.uint8).view(R, K), scale, K, x2.stride(0), K,
                                        scale.stride(0), scale.stride(1), group, CHUNK=chunk, ONE_PASS=one_pass,
                                        NATIVE_CVT=x.device.type == "cuda", num_warps=_quantize_warps(chunk),
                                        **pdl_options(x.device))
    if granularity == "row":
        return q, scale.view(x.shape[:-1] + (1,))
    return q, scale


def _quantize_warps(chunk: int) -> int:
    # H200, 16 x 8192 one pass (fp8_probe3/4.json): 16 warps 2.3 us (3.1 before the hardware cast),
    # 32 warps the same, 8 warps 2.65, 4 warps 5.2
    return max(1, min(16, chunk // 512))


# ============================================================================= scaled matmul
@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr, ws_ptr,
                      M, N, K, k_per_split,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                      stride_sam, stride_sak, stride_sbk, stride_sbn,
                      A_SCALED: tl.constexpr, K_BLOCKED: tl.constexpr, SB_N_GROUP: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                      IEEE: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
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
                acc = dot_acc(a, b, acc, MAX_IMPRECISE)
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
        acc = _apply_scales(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, stride_sam, stride_sbn, SB_N_GROUP, A_SCALED)
    if SPLIT_K == 1:
        _store_tile(acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_on, HAS_BIAS)
    else:
        ws = ws_ptr + pid_k.to(tl.int64) * M * N
        tl.store(ws + offs_m64[:, None] * N + offs_n64[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _scaled_mm_tma_kernel(a_desc, b_desc, sa_ptr, sb_ptr, bias_ptr, out_ptr, M, N, K,
                          stride_om, stride_on, stride_sam, stride_sbn,
                          HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, MAX_IMPRECISE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr):
    """Many rows, fp8 x fp8, tensor or row scales, both operands K-contiguous: tiles arrive by TMA.

    ``a_desc`` [M, K] and ``b_desc`` [N, K] (b transposed) are tensor descriptors; TMA zero-fills
    the ragged edges, so the loop has no masks. H200, M=4096, N=K=8192 rowwise, 128 x 256 x 128 tiles,
    8 warps, 3 stages (bench/results/h200/fp8_probe2.json, fp8_probe3.json, fp8_gemm_alternation.json):
    385-388 us on a GPU fresh from idle, against 461-476 us for the same tiles loaded through pointers
    (cp.async); timed alternately with torch._scaled_mm after other work, 430-455 us against 446-484
    (ratio 1.00-1.11 over 18 alternations on three machines). Both kernels slow as the GPU heats up
    (torch 385 us first in a run, 446 us at its end: fp8_gemm_sweep_drift.json), so only figures
    taken side by side compare. Writing the K loop inside a flattened one-tile loop nest gave no
    measurable gain and wrong results at M=255, K=768 (Triton 3.6), so the loop stays plain.
    """
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        b = b_desc.load([pid_n * BLOCK_N, k0]).T
        if DOT_F32:  # interpreter (CPU CI): exact fp32 products
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = dot_acc(a, b, acc, MAX_IMPRECISE)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _apply_scales(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, stride_sam, stride_sbn, 1, True)
    _store_tile(acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_on, HAS_BIAS)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program ``pid`` in grouped order: GROUP_M row tiles share each
    column tile while it is in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


@triton.jit
def _apply_scales(acc, offs_m, offs_n, M, N, sa_ptr, sb_ptr, stride_sam, stride_sbn, SB_N_GROUP: tl.constexpr,
                  A_SCALED: tl.constexpr):
    """acc [BM, BN] times b's scale per column (group) and, with A_SCALED, a's scale per row."""
    acc = acc * tl.load(sb_ptr + (offs_n // SB_N_GROUP) * stride_sbn, mask=offs_n < N, other=0.0)[None, :]
    if A_SCALED:
        acc = acc * tl.load(sa_ptr + offs_m.to(tl.int64) * stride_sam, mask=offs_m < M, other=0.0)[:, None]
    return acc


@triton.jit
def _store_tile(acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_on, HAS_BIAS: tl.constexpr):
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on,
             round_to(acc, out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & mask_n[None, :])


# ----------------------------------------------------------------------------- configuration
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _shared_memory(device: torch.device) -> int | None:
    """Shared memory one program may use on ``device`` (bytes; None where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)


def fit_shared_memory(cfg: dict, a_bytes: int, limit: int | None) -> dict:
    """Shrink a pointer-fed tile (``tiled`` / ``skinny``) in place until its pipelined operand tiles
    (num_stages x (a tile + fp8 b tile), an estimate) fit ``limit`` bytes: fewer stages (down to 2),
    then narrower N tiles (down to 64). The rule's tiles were sized for the H200's 227 KiB, where
    they all fit as they are; this keeps them launchable on GPUs with less (sm_89: 99 KiB)."""
    if limit is None or cfg["kernel"] not in ("tiled", "skinny"):
        return cfg

    def need():
        bm = 16 if cfg["kernel"] == "skinny" else cfg["BLOCK_M"]
        return cfg["num_stages"] * cfg["BLOCK_K"] * (bm * a_bytes + cfg["BLOCK_N"])

    while need() > limit and cfg["num_stages"] > 2:
        cfg["num_stages"] -= 1
    while need() > limit and cfg["BLOCK_N"] > 64 and cfg["kernel"] == "tiled":
        cfg["BLOCK_N"] //= 2
    return cfg


def _fp8_dot_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _skinny_config(N: int, K: int, k_blocked: bool, device: torch.device, fp8_dot: bool = False) -> dict:
    """2..16 rows, K-contiguous fp8 b (Fp8Linear's ``w.t()``): the swapped-operand MMA kernel.

    64 weight rows a program (one Hopper warpgroup MMA). H200, M=16, graph-timed:
    * weight-only (bf16 activations; bench/results/h200/fp8_skinny_sweep.json): 128-wide K steps, K
      split up to 4 ways for >= 2 programs an SM: 8192^2 29.3 us (bf16 F.linear 33.8), 4096^2 11.5 us
      (bf16 13.6). Far from the 16.2 us floor at 8192^2: the weight tile goes global -> shared ->
      registers -> bf16 -> MMA, and Triton's mixed-input warpgroup MMA path streams ~2.3 TB/s here.
    * fp8 activations on sm_89+ (``fp8_dot``; fp8_probe2..4.json): no upcast, 256-wide K steps, 4
      stages, split only until there is about one program an SM: 8192^2 18.8 us unsplit (512-wide
      steps 18.8-18.9, 128-wide 23.4, split 2 20.8 with its reduce launch, 3 stages 20.5). Asking L2
      for each program's first weight lines before the PDL wait saved ~0.4 us behind the quantiser
      and cost ~0.9 us otherwise, so it is not done.
    """
    bn = 64
    if fp8_dot and not k_blocked:
        bk = 256 if K >= 1024 else 128
        tiles_n = -(-N // bn)
        split = 1
        while tiles_n * split < 0.9 * _sm_count(device) and split < 4 and K // (split * 2) >= 2 * bk:
            split *= 2
        return dict(kernel="skinny", FP8_DOT=True, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4,
                    num_stages=4)
    bk = 128
    tiles_n = -(-N // bn)
    split = 1
    while tiles_n * split < 2 * _sm_count(device) and split < 4 and K // (split * 2) >= 2 * bk:
        split *= 2
    return dict(kernel="skinny", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=3)


def tma_eligible(a: torch.Tensor, b: torch.Tensor, kind_a: str | None, kind_b: str) -> bool:
    """The TMA tile kernel takes fp8 x fp8 with tensor / row scales, both operands K-contiguous with
    16-byte aligned rows (a tensor descriptor's rules), on Hopper or later (or the interpreter)."""
    if a.device.type == "cuda" and torch.cuda.get_device_capability(a.device) < (9, 0):
        return False
    return (a.dtype == torch.float8_e4m3fn and kind_a in ("tensor", "row") and kind_b in ("tensor", "row")
            and a.stride(1) == 1 and b.stride(0) == 1 and a.stride(0) % 16 == 0 and b.stride(1) % 16 == 0
            and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0)


FAMILY = "fp8"
ENTRY_FIELDS = {
    "gemv": ("BLOCK_N", "CHUNKS", "KW", "num_warps"),
    "skinny": ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"),
    "tiled": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages", "GROUP_M"),
    "tma": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "GROUP_M"),
}
_DTYPE_NAMES = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def key(a_dtype: torch.dtype, kind_a: str | None, kind_b: str, M: int, N: int, K: int) -> str:
    """The tuning key of a product (module docstring), e.g. ``"bf16:none-row:16x8192x8192"``."""
    return f"{_DTYPE_NAMES[a_dtype]}:{kind_a or 'none'}-{kind_b}:{M}x{N}x{K}"


def entry_config(entry: dict) -> dict:
    """A copy of tuning entry ``entry`` checked for its kernel's ``ENTRY_FIELDS`` (integers >= 1)."""
    fields = ENTRY_FIELDS.get(entry.get("kernel"))
    if fields is None or any(not isinstance(entry.get(f), int) or entry[f] < 1 for f in fields):
        raise ValueError(f"fp8 tuning entry {entry!r}: expected a 'kernel' of {', '.join(ENTRY_FIELDS)} and "
                         "its fields as integers >= 1 (module docstring)")
    return dict(entry)


def candidates(M: int, N: int, K: int, k_blocked: bool, fp8_a: bool) -> list[dict]:
    """Tuning entries worth timing for one product (``ember tune``), the kernels its regime can take
    (the sweeps of ember/bench/fp8.py): the GEMV at M == 1, the few-row kernel up to 16 rows, the
    tiled kernels beyond; 128-block scales fix BLOCK_K (and the GEMV's KW) at 128."""
    out = []
    if M == 1:
        kw = SCALE_BLOCK if k_blocked else 512
        out += [dict(kernel="gemv", BLOCK_N=bn, CHUNKS=c, KW=kw, num_warps=w, STEP_REDUCE=sr)
                for w in (1, 2, 4, 8) for bn in (1, 2, 4, 8, 16) if bn >= w for c in (1, 2, 4, 8)
                for sr in (True, False)]
    if M <= 16:
        out += [dict(kernel="skinny", BLOCK_N=64, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=st,
                     FP8_DOT=fp8_a and not k_blocked)
                for bk in ((128,) if k_blocked else (128, 256, 512)) for sk in (1, 2, 4) for st in (2, 3, 4)]
    else:
        tiles = [(64, 128), (128, 128), (128, 256), (256, 128)]
        out += [dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=1, num_warps=w, num_stages=st,
                     GROUP_M=8) for bm, bn in tiles for w in (4, 8) for st in (3, 4)]
        if fp8_a and not k_blocked:
            out += [dict(kernel="tma", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, GROUP_M=8)
                    for bm, bn in tiles for bk in (64, 128) for w in (4, 8) for st in (3, 4)]
    return out


def rule(M: int, N: int, K: int, k_blocked: bool, device: torch.device,
            b_k_contiguous: bool = False, fp8_dot: bool = False, tma: bool = False) -> dict:
    """The rule, what a product without a tuning entry launches: the kernel and its tile by regime
    (module docstring; tiles measured on the H200, see ember/bench/fp8.py).

    ``fp8_dot``: fp8 activations whose MMA can take fp8 operands; ``tma``: the operands suit
    ``_scaled_mm_tma_kernel`` (``tma_eligible``).
    """
    if M == 1 and b_k_contiguous:
        return dict(gemv.tile(N, K, torch.float8_e4m3fn, device, k_blocked), kernel="gemv")
    if M <= 16 and b_k_contiguous:
        return _skinny_config(N, K, k_blocked, device, fp8_dot)
    if M <= 16:
        bm = 1 if M == 1 else 16
        bn, bk = (64, 128) if k_blocked else (64, 256)
        tiles_n = -(-N // bn)
        # enough programs for ~4 per SM streaming weight bytes, each with >= 4 K steps
        want = 4 * _sm_count(device)
        split = 1
        while tiles_n * split < want and K // (split * 2) >= 4 * bk:
            split *= 2
        return dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=3,
                    GROUP_M=1)
    if M <= 64:
        return dict(kernel="tiled", BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=4,
                    GROUP_M=8)
    if tma:
        # H200, M=4096, N=K=8192 (fp8_probe2/3.json): 385 us; 128x256x128 with 4 stages 417-436, a
        # persistent grid 405-418, warp-specialised 400, 256x128 452, 128x128 458, 64-wide K 454-458;
        # fp8 MMA promotion every 128 K products (MAX_IMPRECISE) 592
        return dict(kernel="tma", BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, GROUP_M=8)
    return dict(kernel="tiled", BLOCK_M=128, BLOCK_N=256 if N >= 256 and not k_blocked else 128, BLOCK_K=128,
                SPLIT_K=1, num_warps=8, num_stages=3, GROUP_M=8)


def _max_imprecise() -> int:
    """K products an fp8 MMA may sum before promoting to fp32 (0: Triton's default)."""
    return _switches.get("EMBER_FP8_MAX_IMPRECISE")


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None, kind_a: str | None,
              scale_b: torch.Tensor, kind_b: str, bias: torch.Tensor | None, out_dtype: torch.dtype,
              config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch on validated operands (``ember.ops.fp8.scaled_mm`` checks shapes, dtypes, devices).

    ``config``: an explicit tuning entry (module docstring), else this product's entry, else the rule;
    ``out`` is an [M, N] buffer to fill.
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
    fp8_dot = a.dtype == torch.float8_e4m3fn and _fp8_dot_supported(a.device)
    if config is None:
        config = tuning.lookup(FAMILY, key(a.dtype, kind_a, kind_b, M, N, K), a.device)
    from_rule = config is None
    if config is not None:
        cfg = entry_config(config)
    else:
        cfg = rule(M, N, K, k_blocked, a.device, b_k_contiguous=b.stride(0) == 1, fp8_dot=fp8_dot,
                   tma=tma_eligible(a, b, kind_a, kind_b))
    kernel = cfg["kernel"]
    if kernel == "tma":
        if not tma_eligible(a, b, kind_a, kind_b):
            raise ValueError("config: the TMA kernel needs sm_90+, fp8 a, tensor/row scales and K-contiguous, "
                             f"16-byte aligned operands; got a {a.dtype} strides {tuple(a.stride())}, b strides "
                             f"{tuple(b.stride())}, scales {kind_a}/{kind_b}")
        return _launch_tma(a, b, scale_a, kind_a, scale_b, kind_b, bias, out, cfg)
    if kernel == "gemv":
        if M != 1 or b.stride(0) != 1:
            raise ValueError(f"config: the GEMV kernel needs M == 1 and a K-contiguous b, got M={M}, "
                             f"b.stride()={tuple(b.stride())}")
        return _launch_gemv(a, b, scale_a, kind_a, scale_b, kind_b, bias, out, k_blocked, cfg)
    skinny = kernel == "skinny"
    if skinny and M > 16:
        raise ValueError(f"config: the few-row kernel takes M <= 16, got M={M}")
    if skinny:
        cfg["BLOCK_M"] = 16
    if k_blocked:
        cfg["BLOCK_K"] = SCALE_BLOCK  # one K scale block per step
    if a.dtype == torch.float32 and cfg["BLOCK_M"] > 1:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 64)  # fp32 tiles: keep shared memory in bounds
    if from_rule and a.device.type == "cuda":
        fit_shared_memory(cfg, a.element_size(), _shared_memory(a.device))
    bk = cfg["BLOCK_K"]
    k_per_split, split, ws = k_split(M, N, K, cfg["SPLIT_K"], bk, out)
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
    if skinny:
        skinny_mm_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), split)](
            a, b, sa, scale_b, bias if bias is not None else out, out, ws,
            M, N, K, k_per_split,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            s_am, s_ak, s_bk, s_bn,
            A_SCALED=kind_a is not None, K_BLOCKED=k_blocked, SB_N_GROUP=group, HAS_BIAS=bias is not None,
            SPLIT_K=split, DOT_F32=a.device.type != "cuda",
            IEEE=a.device.type != "cuda" or a.dtype == torch.float32, BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk,
            FP8_DOT=cfg.get("FP8_DOT", False) and fp8_dot and not k_blocked,
            MAX_IMPRECISE=_max_imprecise() if fp8_dot else 0,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_options(a.device))
    else:
        _scaled_mm_kernel[(triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), split)](
            a, b, sa, scale_b, bias if bias is not None else out, out, ws,
            M, N, K, k_per_split,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            s_am, s_ak, s_bk, s_bn,
            A_SCALED=kind_a is not None, K_BLOCKED=k_blocked, SB_N_GROUP=group, HAS_BIAS=bias is not None,
            SPLIT_K=split, FP8_DOT=fp8_dot, DOT_F32=a.device.type != "cuda",
            IEEE=a.device.type != "cuda" or a.dtype == torch.float32, MAX_IMPRECISE=_max_imprecise() if fp8_dot else 0,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    reduce_splits(ws, bias, out, split, {})
    return out


def _launch_tma(a, b, scale_a, kind_a, scale_b, kind_b, bias, out, cfg) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b.t(), [bn, bk])  # [N, K], K-contiguous
    s_am = scale_a.stride(0) if kind_a == "row" else 0
    _, s_bn, _ = _b_scale_strides(scale_b, kind_b)
    _scaled_mm_tma_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        a_desc, b_desc, scale_a, scale_b, bias if bias is not None else out, out, M, N, K,
        out.stride(0), out.stride(1), s_am, s_bn,
        HAS_BIAS=bias is not None, DOT_F32=a.device.type != "cuda", MAX_IMPRECISE=_max_imprecise(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
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


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
