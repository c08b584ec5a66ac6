"""Triton kernel of the Snake activation (DAC's Snake1d, BigVGAN / Oobleck's Snake-Beta), one launch.

``y = x + sin(a * x)^2 / (d + 1e-9)`` over a channels-first ``[B, C, T]`` tensor, where ``a`` is the
per-channel alpha and ``d`` is alpha (Snake) or beta (Snake-Beta); with LOGSCALE both are stored as
logarithms and exponentiated first. Math in float32, one rounding to the output dtype; for bf16 /
fp16 outputs the sine is the SFU's approximate one after a range reduction (error ~5e-7, far below
the output's rounding), with libdevice's sinf for a tile holding arguments past 16384.

A program owns a ``[BLOCK_C, BLOCK_T]`` tile of one batch row: it loads its channels' alpha (and beta)
once, so the per-element work is a multiply, a sine, a square and an fma. The tile is laid out along
the unit-stride axis (T for channels-first data, C for channels-last views), so both layouts load and
store coalesced; other strides are correct, just not coalesced.

Tiles: ``tuning.lookup("snake", key, device)`` with key ``time`` (T has unit stride) or ``strided``
returns ``{"BLOCK_C", "BLOCK_T", "num_warps"}``; nothing is shipped, so the rule below decides:
2048 elements a program (an elementwise op is memory-bound; 8 KB of fp32 a program with 4 warps keeps
enough loads in flight), at most the tensor's own extent on each axis.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ember.kernels._cache_keys import settle_cache_keys
from ember import tuning
from ember.kernels._common import exp_f32, round_to

_INT32_MAX = 2**31 - 1
_TILE_ELEMS = 2048


@triton.jit
def _sin_f32(x, LIBDEVICE: tl.constexpr):
    # libdevice's sinf (torch's CUDA sin) keeps full accuracy for large arguments; tl.sin may lower to
    # the approximate sin.approx.f32, whose error grows with |x|
    if LIBDEVICE:
        y = libdevice.sin(x)
    else:
        y = tl.sin(x)
    return y


@triton.jit
def _sin_reduced_approx(y):
    """sin(y) for |y| < 16384: two-constant Cody-Waite reduction to [-pi, pi] (k * 6.28125 is exact
    for |k| < 2^16), then the SFU's sin.approx.f32 (absolute error ~5e-7 there)."""
    k = libdevice.rint(y * 0.15915494309189535)
    r = y - k * 6.28125
    r = r - k * 1.9353071795864769e-3
    return tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _snake_kernel(x_ptr, a_ptr, b_ptr, out_ptr, C, T, n_cb, n_tb,
                  sxb, sxc, sxt, sob, soc, sot, sa, sb,
                  HAS_BETA: tl.constexpr, LOGSCALE: tl.constexpr, LIBDEVICE: tl.constexpr, FAST_SIN: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, IDX64: tl.constexpr):
    pid = tl.program_id(0)
    tb = pid % n_tb
    rest = pid // n_tb
    cb = rest % n_cb
    b = rest // n_cb
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    c_ok = c < C
    if IDX64:
        bi = b.to(tl.int64)
        ci = c.to(tl.int64)
        ti = t.to(tl.int64)
    else:
        bi = b
        ci = c
        ti = t

    alpha = tl.load(a_ptr + ci * sa, mask=c_ok, other=1.0).to(tl.float32)  # [BLOCK_C]
    if LOGSCALE:
        alpha = exp_f32(alpha, LIBDEVICE)
    if HAS_BETA:
        div = tl.load(b_ptr + ci * sb, mask=c_ok, other=1.0).to(tl.float32)
        if LOGSCALE:
            div = exp_f32(div, LIBDEVICE)
    else:
        div = alpha
    # IEEE division: the modules compute (d + 1e-9).reciprocal() exactly
    inv = tl.math.div_rn(tl.full(div.shape, 1.0, tl.float32), div + 1e-9)

    ok = c_ok[:, None] & (t < T)[None, :]
    x = tl.load(x_ptr + bi * sxb + ci[:, None] * sxc + ti[None, :] * sxt, mask=ok, other=0.0).to(tl.float32)
    ax = alpha[:, None] * x
    if FAST_SIN:
        # half-precision output (2^-9 rounding) does not need libdevice's exact sinf, whose
        # instructions made the bf16 kernel compute-bound: 2,523 GB/s, 61 % of copy bandwidth (H200)
        if tl.max(tl.max(tl.abs(ax), axis=1), axis=0) < 16384.0:
            s = _sin_reduced_approx(ax)
        else:
            s = _sin_f32(ax, LIBDEVICE)
    else:
        s = _sin_f32(ax, LIBDEVICE)
    y = x + inv[:, None] * (s * s)
    tl.store(out_ptr + bi * sob + ci[:, None] * soc + ti[None, :] * sot,
             round_to(y, out_ptr.dtype.element_ty), mask=ok)


def _pow2_at_most(n: int, cap: int) -> int:
    return max(1, min(cap, triton.next_power_of_2(max(1, n))))


def tile(x: torch.Tensor) -> tuple[str, dict]:
    """(key, entry) for ``x`` [B, C, T]: a tuning entry if there is one, else the rule."""
    _, C, T = x.shape
    key = "time" if x.stride(2) == 1 or T == 1 else "strided"
    entry = tuning.lookup("snake", key, x.device)
    if entry is not None:
        return key, dict(entry)
    if key == "time":
        bt = _pow2_at_most(T, _TILE_ELEMS)
        bc = _pow2_at_most(C, _TILE_ELEMS // bt)
    else:
        bc = _pow2_at_most(C, 64)
        bt = _pow2_at_most(T, _TILE_ELEMS // bc)
    return key, {"BLOCK_C": bc, "BLOCK_T": bt, "num_warps": 4}


def snake(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, out: torch.Tensor,
          logscale: bool) -> None:
    """Launch on validated tensors: ``x`` and ``out`` [B, C, T] (any strides, same shape and dtype),
    ``alpha`` / ``beta`` 1-d [C] views (any stride); ``out`` may be ``x`` itself."""
    B, C, T = x.shape
    _, entry = tile(x)
    bc, bt = int(entry["BLOCK_C"]), int(entry["BLOCK_T"])
    n_cb, n_tb = triton.cdiv(C, bc), triton.cdiv(T, bt)
    grid = (B * n_cb * n_tb,)
    # offsets past int32 (a long high-channel clip) need 64-bit index math
    span = max(sum(abs(s) * (n - 1) for s, n in zip(t.stride(), t.shape)) for t in (x, out))
    idx64 = span + max(bc, bt) * max(map(abs, x.stride() + out.stride())) > _INT32_MAX
    b = beta if beta is not None else alpha
    _snake_kernel[grid](x, alpha, b, out, C, T, n_cb, n_tb, *x.stride(), *out.stride(),
                        alpha.stride(0), b.stride(0), HAS_BETA=beta is not None, LOGSCALE=bool(logscale),
                        LIBDEVICE=x.device.type == "cuda",
                        FAST_SIN=x.device.type == "cuda" and out.dtype in (torch.bfloat16, torch.float16), BLOCK_C=bc, BLOCK_T=bt, IDX64=idx64,
                        num_warps=int(entry.get("num_warps", 4)))


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
