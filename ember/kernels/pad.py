"""Triton kernel for constant padding (and cropping) of a strided tensor in one launch.

The host (ember/ops/pad.py) reduces any pad to at most ``MAX_DIMS`` dims and views the data as
integers of the element's width, so the kernel is a pure, bit-exact data movement for every dtype
(bool, integers, floats, fp8). Each program writes a [BLOCK_R rows x BLOCK_C columns] tile of the
output: the per-row multi-index decomposition (integer divisions) is paid once per row, not once per
element, which keeps the kernel at memory speed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_DIMS = 8  # the innermost dim plus up to 7 outer dims


@triton.jit
def _outer_dim(rem, off_x, off_o, valid, size, lo, in_size, x_stride, o_stride):
    idx = rem % size
    src = idx - lo
    valid = valid & (src >= 0) & (src < in_size)
    return rem // size, off_x + src * x_stride, off_o + idx * o_stride, valid


@triton.jit(do_not_specialize=["fill"])
def _pad_kernel(x_ptr, out_ptr, fill, n_rows, n_col_blocks,
                out_c, lo_c, in_c, xs_c, os_c,
                o1, l1, i1, xs1, os1, o2, l2, i2, xs2, os2, o3, l3, i3, xs3, os3,
                o4, l4, i4, xs4, os4, o5, l5, i5, xs5, os5, o6, l6, i6, xs6, os6,
                o7, l7, i7, xs7, os7,
                N_OUTER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    pid_r = pid // n_col_blocks
    pid_c = pid % n_col_blocks
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_ok = rows < n_rows
    valid = row_ok
    rem = rows
    off_x = tl.zeros([BLOCK_R], dtype=tl.int64)
    off_o = tl.zeros([BLOCK_R], dtype=tl.int64)
    # Outer dims, innermost first; unused ones are compiled out.
    if N_OUTER >= 1:
        rem, off_x, off_o, valid = _outer_dim(rem, off_x, off_o, valid, o1, l1, i1, xs1, os1)
    if N_OUTER >= 2:
        rem, off_x, off_o, valid = _outer_dim(rem, off_x, off_o, valid, o2, l2, i2, xs2, os2)
    if N_OUTER >= 3:
        rem, off_x, off_o, valid = _outer_dim(rem, off_x, off_o, valid, o3, l3, i3, xs3, os3)
    if N_OUTER >= 4:
        rem, off_x, off_o, valid = _outer_dim(rem, off_x, off_o, valid, o4, l4, i4, xs4, os4)
    if N_OUTER >= 5:
        rem, off_x, off_o, valid = _outer_dim(rem, off_x, off_o, valid, o5, l5, i5, xs5, os5)
    if N_OUTER >= 6:
        rem, off_x, off_o, valid = _outer_dim(rem, off_x, off_o, valid, o6, l6, i6, xs6, os6)
    if N_OUTER >= 7:
        rem, off_x, off_o, valid = _outer_dim(rem, off_x, off_o, valid, o7, l7, i7, xs7, os7)

    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    col_ok = cols < out_c
    src_c = cols - lo_c
    load_ok = valid[:, None] & ((src_c >= 0) & (src_c < in_c))[None, :]
    vals = tl.load(x_ptr + off_x[:, None] + src_c[None, :] * xs_c, mask=load_ok, other=0)
    vals = tl.where(load_ok, vals, fill.to(vals.dtype))
    tl.store(out_ptr + off_o[:, None] + cols[None, :] * os_c, vals, mask=row_ok[:, None] & col_ok[None, :])


def _block_cols(n: int) -> int:
    """Widest power-of-two column block that keeps >= 85% of its lanes busy on a row of ``n``."""
    for b in (1024, 512, 256, 128, 64, 32):
        if n >= b and n / (triton.cdiv(n, b) * b) >= 0.85:
            return b
    return max(16, triton.next_power_of_2(min(n, 16)))


def pad(x: torch.Tensor, out: torch.Tensor, fill_bits: int,
        dims: list[tuple[int, int, int, int, int]]) -> None:
    """Launch on integer views ``x`` and ``out``.

    ``dims`` lists (out_size, lo, in_size, x_stride, out_stride) per dim, outermost first, at most
    MAX_DIMS of them (the caller merges dims); the output must be non-empty.
    """
    assert 1 <= len(dims) <= MAX_DIMS
    out_c, lo_c, in_c, xs_c, os_c = dims[-1]
    outer = list(reversed(dims[:-1]))  # innermost first
    n_rows = 1
    for d in outer:
        n_rows *= d[0]
    block_c = _block_cols(out_c)
    block_r = max(1, min(triton.next_power_of_2(n_rows), 4096 // block_c))
    n_col_blocks = triton.cdiv(out_c, block_c)
    grid = (triton.cdiv(n_rows, block_r) * n_col_blocks,)
    flat = []
    for k in range(MAX_DIMS - 1):
        flat.extend(outer[k] if k < len(outer) else (1, 0, 1, 0, 0))
    _pad_kernel[grid](x, out, fill_bits, n_rows, n_col_blocks, out_c, lo_c, in_c, xs_c, os_c, *flat,
                      N_OUTER=len(outer), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
