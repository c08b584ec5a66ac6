"""Triton kernel for constant padding (and cropping) of a strided tensor in one launch.

The host (ember/ops/pad.py) reduces any pad to at most ``MAX_DIMS`` dims (the innermost, "columns",
plus outer dims whose flattened index is the "row") and views the data as integers of the element's
width, so the kernel is a pure, bit-exact data movement for every dtype (bool, ints, fp8, complex).

Floor (issue 7 row, bf16 1x96x4x256x512 -> 1x96x6x258x514): 100.7 MB read + 152.8 MB written =
253 MB -> 61 us at 4.15 TB/s (the bench's GB/s counts the same bytes).

Why the first version ran at 20.7 GB/s (12.2 ms, H200): it tiled [64 rows x 64 cols] and split each
row index with int64 ``//`` and ``%`` on runtime sizes. sm_90 has no 64-bit divide: ptxas calls
``__cuda_sm20_div_s64`` (98 CALLs in the SASS), and around every call the thread's 16 row offsets,
masks and loaded values went to local memory: ``STACK:3288`` bytes per thread, 2,884 LDL + 2,112 STL
per thread against 32 useful 2-byte LDG/STG (cuobjdump/nvdisasm of the sm_90 cubin, triton 3.9).
That local traffic (~3 KB per 128 B moved, over the L1 and into L2/DRAM) is the 67x, not the scalar
``ld.global.b16``/``st.global.b16`` accesses, which only cost a few-fold on top. The host was not
at fault: one launch, no copy of x, no reference path, ``.item()`` only on a CPU scalar, the same
specialisation every call (grid 20,898 programs, BLOCK_C 64 for the 514-wide rows).

This version: each program takes RB consecutive output rows (RB x 128 words = 8 KB a tile for
this shape: 8 rows, 18,576 programs); the row multi-index is int32 ``//`` / ``%`` (inline, no call;
int64 only where sizes need it), once per row per warp. When the columns are unit-stride on both
sides and out is 16-byte aligned (the WIDE path), each row splits into
  * a middle of whole 16-byte output chunks (fully interior, or a padding-only row): stored with
    ``st.global.v2.b64`` on the output's 16-byte grid; the source bytes are realigned in registers
    from two 8-byte loads (``ld.global.b64``, the second an L1 hit) and a funnel shift, because
    source and destination rows differ in alignment (514 vs 512 columns here: no common grid);
  * a few leftover elements (left/right padding, the partial chunks at both ends): element loads
    and stores (~16 of 514 a row here).
Other strides, or a misaligned out, take the element path for the whole row.
sm_90 PTX/SASS of the WIDE bf16 kernel (triton 3.9, N_OUTER=3, RB=8, WB=128): before -> after
  loads   32 x ld.global.b16                 -> 16 x ld.global.b64 (+2 b16 for the leftovers)
  stores  32 x st.global.b16                 -> 4 x st.global.v2.b64 (+2 b16)
  div/rem 195 int64 (98 CALL div_s64)        -> 12 div.s32 + 6 rem.s32, no CALL
  local   STACK 3288 B, 2884 LDL / 2112 STL  -> STACK 0, no LDL/STL; 80 registers
Expected effect (UNMEASURED: the H200 budget was spent): from 12.2 ms to near the 61 us floor,
about the 80%-of-copy target (3.3 TB/s); by count, ~200 warp-instructions per 2 KB row against
~520 issue slots a row at full bandwidth, with ~48 KB of loads in flight per SM (6 programs), so
the kernel should be memory-bound. Re-run ``ember bench vae`` to confirm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_DIMS = 8  # the innermost dim plus up to 7 outer dims
_INT32_MAX = 2**31 - 1


@triton.jit
def _outer_dim(rem, off_x, off_o, valid, size, lo, in_size, x_stride, o_stride):
    idx = rem % size
    src = idx - lo
    valid = valid & (src >= 0) & (src < in_size)
    return rem // size, off_x + src.to(tl.int64) * x_stride, off_o + idx.to(tl.int64) * o_stride, valid


@triton.jit(do_not_specialize=["fill", "fill_word"])
def _pad_kernel(x_ptr, out_ptr, fill, fill_word, x_shift, n_rows,
                out_c, lo_c, in_c, xs_c, os_c,
                o1, l1, i1, xs1, os1, o2, l2, i2, xs2, os2, o3, l3, i3, xs3, os3,
                o4, l4, i4, xs4, os4, o5, l5, i5, xs5, os5, o6, l6, i6, xs6, os6,
                o7, l7, i7, xs7, os7,
                N_OUTER: tl.constexpr, RB: tl.constexpr, WB: tl.constexpr, BLOCK_A: tl.constexpr,
                WIDE: tl.constexpr, ES: tl.constexpr, IDX64: tl.constexpr):
    idx_t = tl.int64 if IDX64 else tl.int32
    pid = tl.program_id(0).to(idx_t)
    rows = pid * RB + tl.arange(0, RB).to(idx_t)
    row_ok = rows < n_rows
    valid = row_ok
    rem = rows
    off_x = tl.zeros([RB], dtype=tl.int64)  # element offsets of output column 0's row
    off_o = tl.zeros([RB], dtype=tl.int64)
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

    # Columns [c_a, c_b) of each row go through the 16-byte middle; the rest element by element.
    c_a = tl.zeros([RB], dtype=tl.int64) + out_c
    c_b = c_a
    if WIDE:
        # A row holding input data copies its interior [lo_i, hi_i); any other row is all padding.
        # (as [RB] vectors: the interpreter mistypes a bool made from two scalars)
        lo_i = tl.zeros([RB], dtype=tl.int64) + tl.maximum(lo_c, 0)
        hi_i = tl.zeros([RB], dtype=tl.int64) + tl.minimum(lo_c + in_c, out_c)
        has_data = valid & (hi_i > lo_i)
        lo_i = tl.where(has_data, lo_i, 0)
        hi_i = tl.where(has_data, hi_i, out_c)
        # byte offsets from out (16-byte aligned, the host checks) and from x's 8-byte-aligned word
        row_b = off_o * ES
        first_b = (row_b + lo_i * ES + 15) // 16 * 16
        end_b = (row_b + hi_i * ES) // 16 * 16
        n_chunks = tl.where(row_ok, tl.maximum(end_b - first_b, 0) // 16, 0)
        c_a = tl.where(n_chunks > 0, (first_b - row_b) // ES, out_c)
        c_b = tl.where(n_chunks > 0, (end_b - row_b) // ES, out_c)
        src_b = (off_x + c_a - lo_c) * ES + x_shift  # source byte of column c_a (data rows)
        sh = (src_b & 7) * 8                         # bit shift between source and output words
        src_w = (src_b - (src_b & 7)) // 8
        o_words = out_ptr.to(tl.pointer_type(tl.uint64))
        x_words = (x_ptr - x_shift // ES).to(tl.pointer_type(tl.uint64))
        fill_w = fill_word.to(tl.uint64)
        n_words = 2 * n_chunks
        for it in range(0, tl.cdiv(tl.max(n_words, 0), WB)):
            j = it * WB + tl.arange(0, WB).to(tl.int64)  # it * WB: a known multiple of WB
            in_row = j[None, :] < n_words[:, None]
            load_ok = in_row & has_data[:, None]
            src = src_w[:, None] + j[None, :]
            lo_w = tl.load(x_words + src, mask=load_ok, other=0)
            hi_w = tl.load(x_words + src + 1, mask=load_ok & (sh[:, None] != 0), other=0)
            s = sh[:, None].to(tl.uint64)
            shifted = (lo_w >> s) | (hi_w << ((64 - s) & 63))
            word = tl.where(s == 0, lo_w, shifted)
            word = tl.where(has_data[:, None], word, fill_w)
            # (first_b // 16) * 2 tells the compiler the row's first word is 16-byte aligned
            tl.store(o_words + ((first_b // 16) * 2)[:, None] + j[None, :], word, mask=in_row)

    n_a = c_a + (out_c - c_b)
    for k0 in range(0, tl.max(tl.where(row_ok, n_a, 0), 0), BLOCK_A):
        k = k0 + tl.arange(0, BLOCK_A).to(tl.int64)
        cols = tl.where(k[None, :] < c_a[:, None], k[None, :], c_b[:, None] + k[None, :] - c_a[:, None])
        in_row = row_ok[:, None] & (k[None, :] < n_a[:, None])
        src_c = cols - lo_c
        load_ok = in_row & valid[:, None] & (src_c >= 0) & (src_c < in_c)
        vals = tl.load(x_ptr + off_x[:, None] + src_c * xs_c, mask=load_ok, other=0)
        vals = tl.where(load_ok, vals, fill.to(vals.dtype))
        tl.store(out_ptr + off_o[:, None] + cols * os_c, vals, mask=in_row)


def _fill_word(fill_bits: int, element_size: int) -> int:
    """The element's fill bits repeated across a 64-bit word, as a signed int64."""
    unit = fill_bits & ((1 << (8 * element_size)) - 1)
    word = 0
    for k in range(8 // element_size):
        word |= unit << (8 * element_size * k)
    return word - (1 << 64) if word >= 1 << 63 else word


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
    es = x.element_size()
    # the 16-byte middle needs unit column strides and a 16-byte-aligned out (x may be anywhere)
    wide = xs_c == 1 and os_c == 1 and es <= 8 and out.data_ptr() % 16 == 0
    idx64 = max([n_rows, out_c, abs(lo_c), in_c] + [abs(v) for d in outer for v in d[:3]]) > _INT32_MAX
    if wide:
        row_words = triton.next_power_of_2(max(2, (out_c * es) // 8))
        wb = min(256, row_words)
        block_a = 16
    else:
        wb = 16
        block_a = min(256, triton.next_power_of_2(out_c))
    # 1024 words (8 KB) a tile: 80 registers on sm_90, 6 programs an SM, ~48 KB of loads in flight
    rb = max(1, min(triton.next_power_of_2(n_rows), 1024 // max(wb, block_a)))
    grid = (triton.cdiv(n_rows, rb),)
    flat = []
    for k in range(MAX_DIMS - 1):
        flat.extend(outer[k] if k < len(outer) else (1, 0, 1, 0, 0))
    _pad_kernel[grid](x, out, fill_bits, _fill_word(fill_bits, es) if wide else 0,
                      x.data_ptr() % 8, n_rows, out_c, lo_c, in_c, xs_c, os_c, *flat,
                      N_OUTER=len(outer), RB=rb, WB=wb, BLOCK_A=block_a, WIDE=wide, ES=es, IDX64=idx64,
                      num_warps=4)
