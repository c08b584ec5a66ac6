"""Triton kernels of the SwiGLU activation (``ember.ops.swiglu``) and its backward: elementwise over
[rows, I] blocks of a ``[gate | up]`` row pair, float32 math, one rounding per output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import exp_f32, round_to, silu_f32


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, M, I, stride_gu, stride_out, LIBDEVICE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    mask = (rows < M) & (cols < I)
    g = tl.load(gu_ptr + rows * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_f32(g, LIBDEVICE) * u
    tl.store(out_ptr + rows * stride_out + cols, round_to(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(grad_ptr, gu_ptr, dgu_ptr, M, I, stride_grad, stride_gu, stride_dgu,
                            LIBDEVICE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
    mask = (rows < M) & (cols < I)
    dy = tl.load(grad_ptr + rows * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + rows * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + exp_f32(-g, LIBDEVICE))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))  # d silu(g) / dg = sig * (1 + g * (1 - sig))
    du = dy * g * sig
    dt = dgu_ptr.dtype.element_ty
    tl.store(dgu_ptr + rows * stride_dgu + cols, round_to(dg, dt), mask=mask)
    tl.store(dgu_ptr + rows * stride_dgu + I + cols, round_to(du, dt), mask=mask)


def _grid(M: int, I: int):
    block_i = min(triton.next_power_of_2(I), 1024)
    block_m = max(1, 4096 // block_i)  # ~4k elements per program: enough bytes in flight per SM
    return (triton.cdiv(M, block_m), triton.cdiv(I, block_i)), block_m, block_i


def swiglu(gu2: torch.Tensor, out2: torch.Tensor) -> None:
    """``out2 = silu(gu2[:, :I]) * gu2[:, I:]`` on 2-d rows with contiguous last dims."""
    M, I = out2.shape
    if M * I == 0:
        return
    grid, bm, bi = _grid(M, I)
    _swiglu_kernel[grid](gu2, out2, M, I, gu2.stride(0), out2.stride(0), LIBDEVICE=gu2.device.type == "cuda",
                         BLOCK_M=bm, BLOCK_I=bi, num_warps=4)


def swiglu_backward(grad2: torch.Tensor, gu2: torch.Tensor, dgu2: torch.Tensor) -> None:
    """The [M, 2I] gradient of gate_up into ``dgu2`` from the output's gradient ``grad2`` [M, I]."""
    M, I = grad2.shape
    if M * I == 0:
        return
    grid, bm, bi = _grid(M, I)
    _swiglu_backward_kernel[grid](grad2, gu2, dgu2, M, I, grad2.stride(0), gu2.stride(0), dgu2.stride(0),
                                  LIBDEVICE=gu2.device.type == "cuda", BLOCK_M=bm, BLOCK_I=bi, num_warps=4)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
