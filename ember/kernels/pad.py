"""Triton kernel for constant padding (and cropping) of a strided tensor in one launch.

The host (ember/ops/pad.py) reduces any pad to at most ``MAX_DIMS`` dims (the innermost, "columns",
plus outer dims whose flattened index is the "row") and views the data as integers of the element's
width, so the kernel is a pure, bit-exact data movement for every dtype (bool, ints, fp8, complex).

Floor (issue 7 row, bf16 1x96x4x256x512 -> 1x96x6x258x514): 100.7 MB read + 152.8 MB written =
253 MB -> 61 us at 4.15 TB/s (the bench's GB/s counts the same bytes).

History on the H200. v0 tiled [64 rows x 64 cols] with int64 ``//`` and ``%`` per row: sm_90 has
no 64-bit divide, ptxas called ``__cuda_sm20_div_s64`` and spilled 3 KB a thread: 20.7 GB/s. v1
(RB=8 rows x 128 words a program, 4 warps, 16-byte stores realigned from two 8-byte loads, int32
division) measured 2260 GB/s = 54% of copy (112 us; torch F.pad 181 us). Why 54%, from its sm_90
SASS (triton 3.6, ``.exp/pad_sass.py``): it was issue-bound, not memory-bound. ~1,100 warp
instructions per warp for 2 rows (~550 per 1 KB row): a thread held one 16-byte chunk of each
of 4 rows, so the row's multi-index (3 int32 divisions) and byte/word bookkeeping, redone per row
and again in the element path's layout, cost more than the data movement; each chunk took 4
LDG.64 + 4 64-bit funnel shifts (~6 instructions each); and the padding-only frames (the time
pad: 1/3 of the output) ran the same code with masked loads. 148,608 rows x 550 = 82 M warp
instructions: 78 us of issue at 4 x 132 issue slots a clock, more than the 61 us floor before
any stall.

This version (v2). Measured on the H200 (graph-timed, inputs rotated past L2, torch F.pad in the same
process; bench/results/h200/pad_v2.json): the issue shape 69.8 us = 3631 GB/s = 87% of copy
bandwidth (v1 112.8 us, F.pad 184.4 us); spatial-only bf16 pad 92%, fp32 91%, int8 78%, a rank-4
bf16 8x128x512x512 image pad 97%. Tile variants (1 or 2 warps, 4 or 16 chunks a thread) measured
within 4% of the default (best 67.3 us), so the default stays. Design:
  * Rows are RB consecutive indices of outer dim 1 at grid indices 1 (outer dim 2) and 2 (dims
    3..): no per-row division; the per-row values are int32 (int64 only when the host sees
    offsets past 2^31). Rows of outer dims that are all padding (time-pad frames) take a branch
    that only stores the fill.
  * The chunk tile is [rows, 4-byte words] contiguous along the words, so lanes run along a row
    (one 16-byte store a lane, 512 contiguous bytes a warp). One warp per 1 KB row, so a thread
    keeps 2 chunks of each of its 4 rows and shares the row's math between them.
  * A pure data chunk is 4 LDG.32 + 4 LDG.32 (the next word, L1 hits) and 4 ``SHF.R.U64`` funnel
    shifts from x's 4-byte grid onto out's 16-byte grid; a pure padding chunk loads nothing and
    gets the fill through the loads' ``other`` (a fill shifted by whole elements is still the
    fill). The <= 4 pieces of <= 16 bytes a row (its ends, the chunks holding both data and
    padding) go element by element, one [RB, 16 / ES] tile each.
  SASS (triton 3.6, sm_90, issue shape): 64 registers, no spills, ~620 warp instructions for 4 data
  rows (~155 a row) and ~190 for 4 padding rows: ~18 M warp instructions in all, ~4.6x fewer than
  v1, ~17 us of issue against the 76 us that 80% of copy bandwidth allows.
Reflect, replicate and circular (MODE 1..3) are the same gather with another index map per dim
(_source: mirror, clamp, wrap), so no fill and no masked-out loads. On the wide path their
programs split: column blocks below ``n_wide`` store only the rows' pure data chunks (the
realigned copy above), and a few extra column blocks per row block gather the borders element by
element: columns [0, lw) and [out_c - rw, out_c), which hold every column outside those chunks
(each lies within 16 bytes of the data's ends). For the audio row (16x64x1048576 bf16, pad 512
each side) the borders are 0.1% of the output.
Other strides, or a misaligned out, take the element path for the whole row. Rows of <= 512 bytes
run 4 warps with rows side by side across the lanes; there the element pieces are a large share
of a row and cost more than their bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys

MAX_DIMS = 8  # the innermost dim plus up to 7 outer dims
_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535  # CUDA's limit on grid dims 1 and 2
RB_MAX = 1024  # rows a program takes, at most


@triton.jit
def _source(s, n, MODE: tl.constexpr):
    """x's index for the index ``s`` past the input start (constant: unchanged, masked elsewhere)."""
    if MODE == 1:  # reflect: mirror without repeating the edge (pads are below n: one mirror)
        s = tl.abs(s)
        s = tl.where(s >= n, 2 * n - 2 - s, s)
    elif MODE == 2:  # replicate: clamp to the edge
        s = tl.minimum(tl.maximum(s, 0), n - 1)
    elif MODE == 3:  # circular: wrap (pads are at most n: one wrap)
        s = tl.where(s < 0, s + n, s)
        s = tl.where(s >= n, s - n, s)
    return s


@triton.jit
def _outer_dim(rem, off_x, off_o, ok, size, lo, in_size, x_stride, o_stride, LAST: tl.constexpr,
               MODE: tl.constexpr):
    """Peels one outer dim off the index ``rem`` (all of it when LAST: no division) and adds its
    offsets; ``ok`` (0/1: the interpreter mistypes scalar bools) says whether the index lies
    inside the input so far (always, in the modes that take padding from x)."""
    if LAST:
        idx = rem
    else:
        idx = rem % size
        rem = rem // size
    src = idx - lo
    if MODE == 0:
        ok = ok * (src >= 0).to(tl.int32) * (src < in_size).to(tl.int32)
    else:
        src = _source(src, in_size, MODE)
    return rem, off_x + src.to(off_x.dtype) * x_stride, off_o + idx.to(off_o.dtype) * o_stride, ok


@triton.jit
def _realign(lo, hi, shift):
    """The 4 bytes starting ``shift`` bits into the little-endian pair (lo, hi): one funnel shift."""
    return (((hi.to(tl.uint64) << 32) | lo.to(tl.uint64)) >> shift).to(tl.uint32)


@triton.jit
def _elements(x_ptr, out_ptr, off_x, off_o, valid, cols, in_row, lo_c, in_c, xs_c, os_c, fill,
              DATA: tl.constexpr = True, MODE: tl.constexpr = 0):
    """Element by element: output columns ``cols`` ([RB, n]) of the tile's rows, where ``in_row``
    (no loads when not DATA: the rows are all padding)."""
    if DATA:
        src_c = cols - lo_c
        if MODE == 0:
            load_ok = in_row & valid[:, None] & (src_c >= 0) & (src_c < in_c)
        else:
            src_c = _source(src_c, in_c, MODE)
            load_ok = in_row & valid[:, None]
        vals = tl.load(x_ptr + off_x[:, None] + src_c * xs_c, mask=load_ok, other=fill.to(x_ptr.dtype.element_ty))
    else:
        vals = tl.zeros(cols.shape, dtype=x_ptr.dtype.element_ty) + fill.to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + off_o[:, None] + cols * os_c, vals, mask=in_row)


@triton.jit
def _pure_chunks(j, rel_lo, rel_hi):
    """[RB, words]: the word's chunk holds only data (no padding) for its row."""
    return (j >= ((rel_lo + 15) >> 4)[:, None]) & (j < (rel_hi >> 4)[:, None])


@triton.jit
def _wide_rows(x_ptr, out_ptr, off_x, off_o, row_ok, valid, cb, fill, fill_lo, fill_hi, x_shift,
               out_c, lo_c, in_c,
               RB: tl.constexpr, NCH: tl.constexpr, ES: tl.constexpr, DATA: tl.constexpr, MODE: tl.constexpr):
    """The tile's rows with unit column strides on both sides and out 16-byte aligned.

    Whole 16-byte output chunks are stored with 16-byte stores: pure data ones realigned from the
    source, pure padding ones filled; the chunks holding both, and the partial chunks at the
    row's ends, go element by element. Byte offsets: rows from out, columns from the row.
    DATA=False: every row is padding (a frame of time padding), so nothing is loaded. In the modes
    that take padding from x (MODE > 0) only the pure data chunks are stored here: the rest of
    the row is the border programs' (see _pad_kernel).
    """
    idx_t = off_o.dtype
    row_len = out_c * ES
    row_b = off_o * ES
    head = (16 - (row_b & 15)) & 15  # bytes before the row's first whole chunk
    n_ch = tl.where(row_ok, tl.maximum(row_len - head, 0) >> 4, 0)
    # (as [RB] vectors: the interpreter mistypes a bool made from two scalars)
    lo_i = tl.zeros([RB], dtype=idx_t) + tl.maximum(lo_c, 0)
    hi_i = tl.zeros([RB], dtype=idx_t) + tl.minimum(lo_c + in_c, out_c)
    has_data = valid & (hi_i > lo_i)
    d_lo = tl.where(has_data, lo_i * ES, 0)  # the row's data bytes [d_lo, d_hi)
    d_hi = tl.where(has_data, hi_i * ES, 0)
    # Chunk j (bytes [16 j, 16 j + 16) from head) is pure data for ceil(rel_lo / 16) <= j <
    # floor(rel_hi / 16), holds both data and padding for j = m_lo or m_hi (-1: none), and is pure
    # padding otherwise.
    rel_lo = d_lo - head
    rel_hi = d_hi - head
    m_lo = rel_lo >> 4
    m_lo = tl.where(has_data & ((rel_lo & 15) != 0) & (m_lo >= 0) & (m_lo < n_ch), m_lo, -1)
    m_hi = rel_hi >> 4
    m_hi = tl.where(has_data & ((rel_hi & 15) != 0) & (m_hi >= 0) & (m_hi < n_ch), m_hi, -1)
    # The tile is [rows, 4-byte words of whole chunks]: contiguous along the words, so Triton lays
    # lanes along the row (4 words, one 16-byte store, a thread) whatever the row count.
    w = cb * (4 * NCH) + tl.arange(0, 4 * NCH).to(idx_t)
    j = (w // 4)[None, :]  # the word's chunk
    if MODE == 0:
        store_ok = (j < n_ch[:, None]) & (j != m_lo[:, None]) & (j != m_hi[:, None])
    else:
        store_ok = (j < n_ch[:, None]) & _pure_chunks(j, rel_lo, rel_hi)
    if ES == 8:  # the fill's bits over 4-byte words: even and odd words differ for 8-byte elements
        f = tl.where(w[None, :] % 2 == 0, fill_lo.to(tl.uint32), fill_hi.to(tl.uint32))
    else:
        f = fill_lo.to(tl.uint32)
    dst = (((row_b + head) >> 4) * 4)[:, None] + w[None, :]
    if DATA:
        # (formed here, after the store mask: formed before it, Triton 3.6 failed to compile the
        # constant-mode wide path at [3, 1, 11, 195] bf16 in TritonGPURemoveLayoutConversions)
        ld = _pure_chunks(j, rel_lo, rel_hi)
        # source bytes of the first chunk, from x's 4-byte-aligned word 0: word s0 / 4, bit shift sh
        s0 = (off_x - lo_c) * ES + x_shift + head
        sh = ((s0 & 3) * 8).to(tl.uint64)[:, None]
        src = (s0 >> 2)[:, None] + w[None, :]
        x_words = (x_ptr - x_shift // ES).to(tl.pointer_type(tl.uint32))
        # Padding chunks load nothing and get the fill as `other`: shifting a fill by whole
        # elements (sh is a multiple of the element's bits) leaves it a fill, so no select.
        lo = tl.load(x_words + src, mask=ld, other=f)
        hi = tl.load(x_words + src + 1, mask=ld & (sh != 0), other=f)
        word = _realign(lo, hi, sh)
    else:
        word = tl.zeros([RB, 4 * NCH], dtype=tl.uint32) + f
    tl.store(out_ptr.to(tl.pointer_type(tl.uint32)) + dst, word, mask=store_ok)

    if MODE == 0:
        _segments(x_ptr, out_ptr, off_x, off_o, row_ok, valid, cb, fill, out_c, lo_c, in_c, row_len, head,
                  n_ch, m_lo, m_hi, ES, DATA)


@triton.jit
def _segments(x_ptr, out_ptr, off_x, off_o, row_ok, valid, cb, fill, out_c, lo_c, in_c, row_len, head,
              n_ch, m_lo, m_hi, ES: tl.constexpr, DATA: tl.constexpr):
    """The rest of a row after the whole chunks, in 4 segments of at most 16 bytes each: the head,
    the chunks m_lo and m_hi, the tail."""
    idx_t = off_o.dtype
    S: tl.constexpr = 16 // ES
    k = tl.arange(0, S)[None, :].to(idx_t)
    first_only = row_ok & (off_o * 0 + cb == 0)
    tail = tl.minimum(head + 16 * n_ch, row_len)
    for seg in tl.static_range(4):
        if seg == 0:
            start = head * 0
            size = tl.where(first_only, tl.minimum(head, row_len), 0)
        elif seg == 1:
            start = head + 16 * m_lo
            size = tl.where(first_only & (m_lo >= 0), 16, 0)
        elif seg == 2:
            start = head + 16 * m_hi
            size = tl.where(first_only & (m_hi >= 0), 16, 0)
        else:
            start = tail
            size = tl.where(first_only, row_len - tail, 0)
        _elements(x_ptr, out_ptr, off_x, off_o, valid, start[:, None] // ES + k, k < (size // ES)[:, None],
                  lo_c, in_c, 1, 1, fill, DATA)  # unit column strides


# Only n_cb (1: no division) and out's alignment (16-byte stores) are worth specialising on;
# the other ints and x's alignment would each multiply the compiled variants (~2 s of ptxas
# each) for no gain.
_SIZES = ["o1", "l1", "i1", "xs1", "os1", "o2", "l2", "i2", "xs2", "os2", "o3", "l3", "i3", "xs3", "os3",
          "o4", "l4", "i4", "xs4", "os4", "o5", "l5", "i5", "xs5", "os5", "o6", "l6", "i6", "xs6", "os6",
          "o7", "l7", "i7", "xs7", "os7"]


@triton.jit(do_not_specialize=["fill", "fill_lo", "fill_hi", "x_shift", "n_rows", "out_c", "lo_c", "in_c", "xs_c",
                               "os_c", "n_wide", "lw", "rw"] + _SIZES, do_not_specialize_on_alignment=["x_ptr"])
def _pad_kernel(x_ptr, out_ptr, fill, fill_lo, fill_hi, x_shift, n_cb, n_rows,
                out_c, lo_c, in_c, xs_c, os_c, n_wide, lw, rw,
                o1, l1, i1, xs1, os1, o2, l2, i2, xs2, os2, o3, l3, i3, xs3, os3,
                o4, l4, i4, xs4, os4, o5, l5, i5, xs5, os5, o6, l6, i6, xs6, os6,
                o7, l7, i7, xs7, os7,
                N_OUTER: tl.constexpr, FLAT: tl.constexpr, RB: tl.constexpr, NCH: tl.constexpr,
                BLOCK_A: tl.constexpr, WIDE: tl.constexpr, ES: tl.constexpr, IDX64: tl.constexpr,
                ROW64: tl.constexpr, MODE: tl.constexpr):
    # MODE: 0 constant, 1 reflect, 2 replicate, 3 circular (x's index per dim through _source)
    # int32 offsets and row indices unless the host saw values that need 64 bits (sm_90 has no
    # 64-bit divide: ptxas calls a routine that spills; the row index is what gets divided)
    idx_t = tl.int64 if IDX64 else tl.int32
    row_t = tl.int64 if ROW64 else tl.int32
    t = tl.program_id(0).to(row_t)
    cb = t % n_cb  # column block (n_cb is 1, so no division, unless rows are long)
    t = t // n_cb
    if FLAT:
        # RB consecutive rows over all outer dims, each row's multi-index split on its own
        rem = t * RB + tl.arange(0, RB).to(row_t)
        row_ok = rem < n_rows
        ok = row_ok.to(tl.int32)
        off_x = tl.zeros([RB], dtype=idx_t)
        off_o = off_x
        rem, off_x, off_o, ok = _outer_dim(rem, off_x, off_o, ok, o1, l1, i1, xs1, os1, N_OUTER == 1, MODE)
        if N_OUTER >= 2:
            rem, off_x, off_o, ok = _outer_dim(rem, off_x, off_o, ok, o2, l2, i2, xs2, os2, N_OUTER == 2, MODE)
    else:
        # RB consecutive indices of outer dim 1 (no division per row) at grid index 1 of dim 2 and
        # grid index 2 over dims 3..7: scalars, split once per program
        off_x = tl.program_id(1).to(idx_t) * 0
        off_o = off_x
        ok = 1
        if N_OUTER >= 2:
            rem, off_x, off_o, ok = _outer_dim(tl.program_id(1).to(row_t), off_x, off_o, ok,
                                               o2, l2, i2, xs2, os2, True, MODE)
        rem = tl.program_id(2).to(row_t)
    if N_OUTER >= 3:
        rem, off_x, off_o, ok = _outer_dim(rem, off_x, off_o, ok, o3, l3, i3, xs3, os3, N_OUTER == 3, MODE)
    if N_OUTER >= 4:
        rem, off_x, off_o, ok = _outer_dim(rem, off_x, off_o, ok, o4, l4, i4, xs4, os4, N_OUTER == 4, MODE)
    if N_OUTER >= 5:
        rem, off_x, off_o, ok = _outer_dim(rem, off_x, off_o, ok, o5, l5, i5, xs5, os5, N_OUTER == 5, MODE)
    if N_OUTER >= 6:
        rem, off_x, off_o, ok = _outer_dim(rem, off_x, off_o, ok, o6, l6, i6, xs6, os6, N_OUTER == 6, MODE)
    if N_OUTER >= 7:
        rem, off_x, off_o, ok = _outer_dim(rem, off_x, off_o, ok, o7, l7, i7, xs7, os7, True, MODE)
    if not FLAT:
        ok_outer = ok  # a scalar: dims 2.. put the whole program inside the input, or not
        r1 = t * RB + tl.arange(0, RB).to(row_t)
        row_ok = r1 < o1
        s1 = r1 - l1
        if MODE == 0:
            ok = ok * (s1 >= 0).to(tl.int32) * (s1 < i1).to(tl.int32)
        else:
            s1 = _source(s1, i1, MODE)
        off_x = off_x + s1.to(idx_t) * xs1
        off_o = off_o + r1.to(idx_t) * os1
    # off_x, off_o: element offsets of the rows' output column 0; valid: the row holds input data
    if MODE == 0:
        valid = row_ok & (ok != 0)
    else:  # every row takes its data from x
        valid = row_ok

    if WIDE and MODE != 0:
        # column blocks below n_wide store the rows' pure data chunks; the ones above, the
        # borders: columns [0, lw) and [out_c - rw, out_c), element by element through _source
        if cb < n_wide:
            _wide_rows(x_ptr, out_ptr, off_x, off_o, row_ok, valid, cb, fill, fill_lo, fill_hi, x_shift,
                       out_c, lo_c, in_c, RB, NCH, ES, True, MODE)
        else:
            e = (cb - n_wide).to(idx_t) * BLOCK_A + tl.arange(0, BLOCK_A).to(idx_t)
            cols = tl.where(e < lw, e, out_c - rw + e - lw)[None, :]
            in_row = row_ok[:, None] & (e < lw + rw)[None, :]
            _elements(x_ptr, out_ptr, off_x, off_o, valid, cols, in_row, lo_c, in_c, 1, 1, fill, True, MODE)
    elif WIDE:
        if FLAT:
            _wide_rows(x_ptr, out_ptr, off_x, off_o, row_ok, valid, cb, fill, fill_lo, fill_hi, x_shift,
                       out_c, lo_c, in_c, RB, NCH, ES, True, MODE)
        elif ok_outer != 0:
            _wide_rows(x_ptr, out_ptr, off_x, off_o, row_ok, valid, cb, fill, fill_lo, fill_hi, x_shift,
                       out_c, lo_c, in_c, RB, NCH, ES, True, MODE)
        else:  # the program's rows are all padding in an outer dim: a fill, nothing to load
            _wide_rows(x_ptr, out_ptr, off_x, off_o, row_ok, valid, cb, fill, fill_lo, fill_hi, x_shift,
                       out_c, lo_c, in_c, RB, NCH, ES, False, MODE)
    else:
        cols = cb * BLOCK_A + tl.arange(0, BLOCK_A).to(idx_t)[None, :]
        in_row = row_ok[:, None] & (cols < out_c)
        _elements(x_ptr, out_ptr, off_x, off_o, valid, cols, in_row, lo_c, in_c, xs_c, os_c, fill, True, MODE)


def _fill_words(fill_bits: int, element_size: int) -> tuple[int, int]:
    """The element's fill bits repeated across 8 bytes, as the (low, high) 4-byte words, signed int32."""
    unit = fill_bits & ((1 << (8 * element_size)) - 1)
    word = 0
    for k in range(8 // element_size):
        word |= unit << (8 * element_size * k)
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in (word & 0xFFFFFFFF, word >> 32))


def _offset_bound(dims, stride_at: int, element_size: int) -> int:
    """A bound on the byte offsets the kernel forms from one tensor's strides, padding rows
    (whose source indices run below 0 or past the input) included."""
    return element_size * sum(max(abs(lo), o, n) * abs(d[stride_at]) for d in dims for o, lo, n in [d[:3]])


def pad(x: torch.Tensor, out: torch.Tensor, fill_bits: int, dims: list[tuple[int, int, int, int, int]],
        *, mode: int = 0, num_warps: int | None = None, chunks_per_thread: int = 8) -> None:
    """Launch on integer views ``x`` and ``out``.

    ``dims`` lists (out_size, lo, in_size, x_stride, out_stride) per dim, outermost first, at most
    MAX_DIMS of them (the caller merges dims); the output must be non-empty. ``mode``: 0 constant
    (``fill_bits`` outside x), 1 reflect, 2 replicate, 3 circular (x cropped by the caller, lo >= 0).
    ``num_warps`` and ``chunks_per_thread`` (16-byte chunks a thread stores) override the tile for
    experiments.
    """
    assert 1 <= len(dims) <= MAX_DIMS
    out_c, lo_c, in_c, xs_c, os_c = dims[-1]
    outer = list(reversed(dims[:-1])) or [(1, 0, 1, 0, 0)]  # innermost first; dim 1 always exists
    n_rows = 1
    for d in outer:
        n_rows *= d[0]
    es = x.element_size()
    # the 16-byte chunks need unit column strides and a 16-byte-aligned out (x may be anywhere)
    wide = xs_c == 1 and os_c == 1 and es <= 8 and out.data_ptr() % 16 == 0
    all_dims = outer + [dims[-1]]
    big = max(_offset_bound(all_dims, 3, es), _offset_bound(all_dims, 4, es), n_rows, (out_c + abs(lo_c) + in_c) * es)
    idx64 = big + 64 > _INT32_MAX
    row64 = max([n_rows] + [abs(v) for d in outer for v in d[:3]]) + RB_MAX > _INT32_MAX
    if wide:
        chunks = max(1, out_c * es // 16)
        nch = min(128, max(4, triton.next_power_of_2(chunks)))
        n_cb = triton.cdiv(chunks, nch)
        block_a = 16
        tile = nch * 4  # words of a row
        # Warps side by side along a row only as far as a thread keeps 2 chunks of each of its
        # rows (the per-row index math is then shared by them): one warp for 1 KB rows, two for
        # 2 KB; rows of 512 B or less put rows side by side across the lanes anyway.
        num_warps = num_warps or (4 if nch <= 32 else nch // 64)
        words = num_warps * 32 * 4 * chunks_per_thread
    else:
        nch = 1
        block_a = min(512, max(16, triton.next_power_of_2(out_c)))
        n_cb = triton.cdiv(out_c, block_a)
        tile = block_a
        num_warps = num_warps or 4
        words = 2048
    # (few distinct tiles: each is a compiled variant)
    rb = 1 if n_rows == 1 else max(1, min(words // tile, RB_MAX))
    n_wide, lw, rw = n_cb, 0, 0
    if wide and mode:
        # the columns outside the rows' pure data chunks lie within 16 bytes of the data's ends
        lw = min(out_c, max(lo_c, 0) + 16 // es)
        rw = min(out_c - lw, out_c - min(lo_c + in_c, out_c) + 16 // es)
        block_a = max(16, min(triton.next_power_of_2(lw + rw), max(16, 2048 // rb)))
        n_cb = n_wide + triton.cdiv(lw + rw, block_a)
    # The rows of a program: RB consecutive indices of outer dim 1 at grid indices 1 (outer dim 2)
    # and 2 (dims 3..): no per-row division; or, when dim 1 is shorter than RB or the grid would be
    # too tall, RB consecutive rows over all outer dims (FLAT).
    o1 = outer[0][0]
    o2 = outer[1][0] if len(outer) > 1 else 1
    rest = n_rows // (o1 * o2)
    flat = o1 < rb or o2 > _GRID_YZ_MAX or rest > _GRID_YZ_MAX
    grid = (n_cb * triton.cdiv(n_rows, rb), 1, 1) if flat else (n_cb * triton.cdiv(o1, rb), o2, rest)
    args = []
    for k in range(MAX_DIMS - 1):
        args.extend(outer[k] if k < len(outer) else (1, 0, 1, 0, 0))
    _pad_kernel[grid](x, out, fill_bits, *(_fill_words(fill_bits, es) if wide else (0, 0)),
                      x.data_ptr() % 4, n_cb, n_rows, out_c, lo_c, in_c, xs_c, os_c, n_wide, lw, rw, *args,
                      N_OUTER=len(outer), FLAT=flat, RB=rb, NCH=nch, BLOCK_A=block_a, WIDE=wide, ES=es,
                      IDX64=idx64, ROW64=row64, MODE=mode, num_warps=num_warps)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
