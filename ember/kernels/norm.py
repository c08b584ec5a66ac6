"""Triton kernels for RMSNorm, fused residual-add + RMSNorm and gated RMSNorm (one row per program)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start, round_to, silu_f32


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
                        stride_x, stride_res, stride_out, stride_new_res,
                        H, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SILU: tl.constexpr = False,
                        LIBDEVICE: tl.constexpr = False, STORE_SUM: tl.constexpr = True, PDL: tl.constexpr = False):
    """STORE_SUM=False: the residual (a bias row, stride_res 0) is only added, not stored."""
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the I/O dtype first: the residual stream carries that rounding in every
        # model we load (HF adds in bf16), and the norm must see the same value it stores.
        s = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)
        if STORE_SUM:
            tl.store(new_res_ptr + row * stride_new_res + cols, s, mask=mask)
        x = s
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xf * inv_rms * w
    if SILU:  # silu of the norm as the two-step path stores it (rounded to the output dtype first)
        y = silu_f32(round_to(y, out_ptr.dtype.element_ty).to(tl.float32), LIBDEVICE)
    tl.store(out_ptr + row * stride_out + cols, round_to(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_gated_kernel(x_ptr, z_ptr, w_ptr, out_ptr, G, sxm, sxg, szm, szg, som, sog, H, eps,
                          BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    # rows are (m, g) pairs of [M, G, H] views: a head of a fused projection's z slice needs no copy
    pid = tl.program_id(0)
    m = (pid // G).to(tl.int64)
    g = (pid % G).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    xf = tl.load(x_ptr + m * sxm + g * sxg + cols, mask=mask, other=0.0).to(tl.float32)
    # the RMSNorm exactly as _add_rmsnorm_kernel computes it (same expression, block and warps, so
    # the same reduction order on the GPU), rounded to the output dtype as the two-step path stores it
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = round_to(xf * inv_rms * w, out_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + m * szm + g * szg + cols, mask=mask, other=0.0).to(tl.float32)
    out = normed * silu_f32(z, LIBDEVICE)
    tl.store(out_ptr + m * som + g * sog + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)


def _launch_config(H: int) -> tuple[int, int]:
    block = triton.next_power_of_2(H)
    # ~8-16 elements per thread keeps a row in registers without spills up to H = 16384.
    num_warps = max(1, min(16, block // 256))
    return block, num_warps


def add_rmsnorm(x2: torch.Tensor, residual2: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor, new_residual: torch.Tensor | None) -> None:
    """Launch on 2-d row views whose last dimension is contiguous (validated by the caller)."""
    M, H = x2.shape
    if M == 0:
        return
    block, num_warps = _launch_config(H)
    has_res = residual2 is not None
    _add_rmsnorm_kernel[(M,)](
        x2, residual2 if has_res else x2, weight, out, new_residual if has_res else out,
        x2.stride(0), residual2.stride(0) if has_res else 0, out.stride(0),
        new_residual.stride(0) if has_res else 0,
        H, eps, HAS_RESIDUAL=has_res, BLOCK=block, num_warps=num_warps, **pdl_options(x2.device))


def rmsnorm_silu(x2: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
    """silu(RMSNorm) of 2-d rows into ``out`` (rows with a contiguous last dim, any row stride);
    ``bias`` (contiguous, one value per column) is added to every row first, rounded to x's dtype."""
    M, H = x2.shape
    if M == 0:
        return
    block, num_warps = _launch_config(H)  # the same as add_rmsnorm's: the same reduction order
    _add_rmsnorm_kernel[(M,)](x2, bias if bias is not None else x2, weight, out, out, x2.stride(0), 0,
                              out.stride(0), 0, H, eps, HAS_RESIDUAL=bias is not None, BLOCK=block, SILU=True,
                              LIBDEVICE=x2.device.type == "cuda", STORE_SUM=False, num_warps=num_warps,
                              **pdl_options(x2.device))


@triton.jit
def _bias_add_rows_kernel(y_ptr, b_ptr, r_ptr, M, C, stride_y, stride_r,
                          HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = (y + b) rounded, then + r rounded (as the two torch adds store them), in place, on a
    [BLOCK_M, BLOCK_C] tile of [M, C] rows."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (rows < M) & (cols < C)
    dt = y_ptr.dtype.element_ty
    y = tl.load(y_ptr + rows * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
    y = round_to(y + b, dt)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        y = round_to(y.to(tl.float32) + r, dt)
    tl.store(y_ptr + rows * stride_y + cols, y, mask=mask)


def bias_add_rows_(y2: torch.Tensor, bias: torch.Tensor, residual2: torch.Tensor | None) -> None:
    """``y2 += bias`` (then ``+= residual2``) over [M, C] rows with contiguous last dims, in place."""
    M, C = y2.shape
    if M == 0:
        return
    block_c = min(triton.next_power_of_2(C), 1024)
    block_m = max(1, 8192 // block_c)
    has_r = residual2 is not None
    _bias_add_rows_kernel[(triton.cdiv(M, block_m), triton.cdiv(C, block_c))](
        y2, bias, residual2 if has_r else y2, M, C, y2.stride(0), residual2.stride(0) if has_r else 0,
        HAS_RESIDUAL=has_r, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=8)


def rmsnorm_gated(x3: torch.Tensor, z3: torch.Tensor, weight: torch.Tensor, eps: float, out3: torch.Tensor) -> None:
    """Launch on [M, G, H] views whose last dimension is contiguous (made so by the caller)."""
    M, G, H = x3.shape
    if M * G == 0:
        return
    block, num_warps = _launch_config(H)  # the same as add_rmsnorm's: the same reduction order
    _rmsnorm_gated_kernel[(M * G,)](
        x3, z3, weight, out3, G, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1),
        out3.stride(0), out3.stride(1), H, eps, BLOCK=block, LIBDEVICE=x3.device.type == "cuda",
        num_warps=num_warps, **pdl_options(x3.device))


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
