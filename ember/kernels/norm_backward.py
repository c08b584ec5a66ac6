"""Triton kernel of the RMSNorm / fused add + RMSNorm backward (``ember.ops.rmsnorm`` and
``ember.ops.add_rmsnorm`` under autograd).

With s the normalised rows (x, or the stored sum x + residual), inv = 1 / sqrt(mean(s^2) + eps) and
g the gradient of the normed output, in float32::

    grad_s = inv * (g * w - s * inv^2 * mean(g * w * s))  (+ the new residual's own gradient)
    grad_w = sum over rows of g * s * inv

Each program walks a contiguous run of rows, keeping its share of grad_w in registers, and writes one
float32 partial row; the caller sums the [P, H] partials (P ~ a few per SM): no [N, H] float32
temporary and no atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import round_to


@triton.jit
def _rmsnorm_backward_kernel(g_ptr, gres_ptr, s_ptr, w_ptr, gs_ptr, gw_part_ptr,
                             M, H, stride_g, stride_gres, stride_s, stride_gs, eps, rows_per_program,
                             HAS_GRES: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    gw = tl.zeros((BLOCK,), tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = start + i
        m = mask & ((row + tl.zeros((BLOCK,), tl.int64)) < M)  # the last program's run may pass M: its extra rows read 0, add 0
        s = tl.load(s_ptr + row * stride_s + cols, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)  # the forward kernel's expression
        gxhat = g * w
        c = tl.sum(gxhat * s, axis=0) / H * inv * inv
        gs = inv * (gxhat - s * c)
        if HAS_GRES:
            gs += tl.load(gres_ptr + row * stride_gres + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(gs_ptr + row * stride_gs + cols, round_to(gs, gs_ptr.dtype.element_ty), mask=m)
        gw += g * s * inv
    tl.store(gw_part_ptr + pid * H + cols, gw, mask=mask)


def _programs(M: int, device: torch.device) -> int:
    if device.type == "cuda":
        # ~8 programs per SM keep enough rows in flight to stream at full bandwidth; more would only
        # add partial rows to the final reduction
        return max(1, min(M, 8 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(M, 3))  # the interpreter: a few programs, so the partial reduction is exercised


def rmsnorm_backward(g2: torch.Tensor, gres2: torch.Tensor | None, s2: torch.Tensor, weight: torch.Tensor,
                     eps: float, gs2: torch.Tensor) -> torch.Tensor:
    """Write grad of s into ``gs2`` (2-d rows, contiguous last dims) and return grad_w in float32 [H]."""
    M, H = s2.shape
    if M == 0:
        return torch.zeros(H, dtype=torch.float32, device=s2.device)
    P = _programs(M, s2.device)
    per = triton.cdiv(M, P)
    P = triton.cdiv(M, per)
    part = torch.empty(P, H, dtype=torch.float32, device=s2.device)
    block = triton.next_power_of_2(H)
    num_warps = max(1, min(16, block // 512))  # ~16 elements of each of the row's vectors per thread
    has_gres = gres2 is not None
    _rmsnorm_backward_kernel[(P,)](
        g2, gres2 if has_gres else g2, s2, weight, gs2, part, M, H, g2.stride(0),
        gres2.stride(0) if has_gres else 0, s2.stride(0), gs2.stride(0), eps, per,
        HAS_GRES=has_gres, BLOCK=block, num_warps=num_warps)
    return part.sum(dim=0)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
