"""Argmax kernels: one row per program up to ROW_BLOCK_MAX, longer rows split over programs in ONE
launch whose last program per row combines the chunks' slots (no finish launch: ~2 us less in a graph).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start
from ember.kernels.sampling._grid import (ROW_BLOCK_MAX, _argmax_key, _first_max, _slot_then_best_token,
                                          _split_warps, _warps, _workspace)
from ember.kernels.sampling._plan import min_chunk, split


@triton.jit
def _argmax_row_kernel(x_ptr, out_ptr, stride_x, V, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _, first = _first_max(_argmax_key(x, mask), cols)
    tl.store(out_ptr + row, first.to(tl.int64))



@triton.jit
def _argmax_split_kernel(x_ptr, out_ptr, stride_x, V, P, part_ptr, cnt_ptr, CHUNK: tl.constexpr, PB: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Argmax of rows split over P programs each, in one launch (no finish launch: ~2 us less in a graph).

    Each program stores its chunk's packed (max key, first column) in its own slot ``part[row, c]``
    (high word the key, low word 0x7FFFFFFF - column, so the largest packed value is the first column
    of the largest key), then bumps the row's arrival counter (acq_rel: publishes the slot). The program
    that arrives last reads the row's P slots (one round trip), writes the column and puts the counter
    back to 0, so the persistent workspace is ready for the next launch without a memset.
    Why slots, not an ``atomic_max`` on one row slot: the last program's chain is one atomic and one
    load instead of three atomics (H200, [1, 128256] fp32, PDL on: 2.56 vs 3.81 us, see ``argmax``).
    """
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    kmax, first = _first_max(_argmax_key(x, mask), cols)
    _slot_then_best_token((kmax.to(tl.int64) << 32) | (0x7FFFFFFF - first).to(tl.int64), row, c, P, part_ptr,
                          cnt_ptr, out_ptr, PB)



def argmax(x2: torch.Tensor, out: torch.Tensor) -> None:
    """First index of the row max into int64 ``out [rows]`` (NaN counts as the max, as in torch)."""
    B, V = x2.shape
    if V <= ROW_BLOCK_MAX:
        block = triton.next_power_of_2(V)
        _argmax_row_kernel[(B,)](x2, out, x2.stride(0), V, BLOCK=block, num_warps=_warps(block),
                                 **pdl_options(x2.device))
        return
    chunk, P, PB = split(V, min_chunk(x2.device))
    _, count, _ = _workspace(x2.device, B)
    part = torch.empty((B, P), dtype=torch.int64, device=x2.device)
    # H200 [1, 128256] fp32, chunk 1024, PDL on (bench/results/h200/sampling_latency_probe*.json):
    # 2.56 us with 4 warps; the previous kernel (atomic_max into one row slot) 3.81 us with 4 warps,
    # 4.25 with 2
    _argmax_split_kernel[(B, P)](x2, out, x2.stride(0), V, P, part, count, CHUNK=chunk, PB=PB,
                                 num_warps=_split_warps(chunk), **pdl_options(x2.device))


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
