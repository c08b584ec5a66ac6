"""Triton kernels of the Wan VAE stream (``ember.vae._stream``) that no other op family shares."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import round_to


@triton.jit
def _dup_up_add_kernel(x_ptr, src_ptr, P, OC, T2, H2, W2, s_b, s_c, s_t, s_h, s_w,
                       FT: tl.constexpr, FS: tl.constexpr, REP: tl.constexpr, DROP: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """x[b, o, T, H, W] += src[b, c, t, h, w] (rounded to x's dtype, as the torch add stores it) over
    a [BLOCK_P positions, BLOCK_C channels] tile of channels-last x: DupUp3D's channel repeat and
    unfold (``StreamDecoder.dup_up_add``) as a gather, with c = (((o * FT + a) * FS + i) * FS + j) // REP
    for T + DROP = t * FT + a (the unfolded frames' first DROP dropped, as diffusers' first chunk),
    H = h * FS + i, W = w * FS + j."""
    p = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
    o = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    W = p % W2
    q = p // W2
    H = q % H2
    q = q // H2
    T = q % T2 + DROP
    b = q // T2
    pos = b * s_b + (T // FT) * s_t + (H // FS) * s_h + (W // FS) * s_w
    sub = ((T % FT) * FS + H % FS) * FS + W % FS  # the sub-position (a, i, j)
    c = (o[None, :] * (FT * FS * FS) + sub[:, None]) // REP
    mask = (p < P)[:, None] & (o < OC)[None, :]
    g = tl.load(src_ptr + pos[:, None] + c.to(tl.int64) * s_c, mask=mask, other=0.0).to(tl.float32)
    xs = x_ptr + p[:, None] * OC + o[None, :]
    x = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
    tl.store(xs, round_to(x + g, x_ptr.dtype.element_ty), mask=mask)


def dup_up_add_(x: torch.Tensor, src: torch.Tensor, factor_t: int, factor_s: int, repeats: int,
                drop_frames: int) -> None:
    """``x += DupUp3D(src)`` in place; x [B, OC, t * factor_t - drop_frames, h * factor_s,
    w * factor_s] channels-last contiguous (validated by the caller), src [B, C, t, h, w] any strides;
    the first ``drop_frames`` unfolded frames dropped."""
    B, OC, T2, H2, W2 = x.shape
    P = B * T2 * H2 * W2
    if P == 0 or OC == 0:
        return
    block_c = min(triton.next_power_of_2(OC), 256)
    block_p = max(1, 4096 // block_c)
    _dup_up_add_kernel[(triton.cdiv(P, block_p), triton.cdiv(OC, block_c))](
        x, src, P, OC, T2, H2, W2, *src.stride(), FT=factor_t, FS=factor_s, REP=repeats, DROP=drop_frames,
        BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
