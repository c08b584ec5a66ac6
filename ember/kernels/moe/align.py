"""Prefill's expert sort: the (token, expert) pairs ordered by expert (stable) and each expert's run
padded to whole blocks of BLOCK_M rows, on the device without syncs (capturable).

``align(topk_ids, E, block_m) -> (sorted_pairs, block_expert, n_blocks)``: three small kernels up to
ALIGN_MAX_EXPERTS experts, the torch ops (``align_torch``, the same result) above that.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys


@triton.jit
def _align_ids(ids_ptr, c, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Chunk ``c``'s expert ids; pairs past P (and ids outside [0, E)) become BLOCK_E."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=BLOCK_E)
    return tl.where((e >= 0) & (e < E), e, BLOCK_E)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    # counts[c, e]: pairs of chunk c that chose expert e
    c = tl.program_id(0)
    e = _align_ids(ids_ptr, c, P, E, CHUNK, BLOCK_E)
    outside = tl.sum((e == BLOCK_E).to(tl.int32), axis=0)
    bins = tl.arange(0, BLOCK_E)
    hist = tl.histogram(tl.where(e == BLOCK_E, 0, e), BLOCK_E) - tl.where(bins == 0, outside, 0)
    tl.store(counts_ptr + c * BLOCK_E + bins, hist)


@triton.jit
def _align_plan_kernel(counts_ptr, offset_ptr, sorted_pairs_ptr, block_expert_ptr, n_chunks, P, E, n_slots,
                       n_blocks, BLOCK_M: tl.constexpr, NCH: tl.constexpr, BLOCK_E: tl.constexpr,
                       FILL: tl.constexpr, FILL_B: tl.constexpr):
    # One program: each expert's padded run (start, end) in the sorted list; offset[c, e] = where
    # chunk c's first pair of expert e goes, minus that pair's position in the chunk sorted by expert;
    # padding slots = P; block -> expert (-1 past the end).
    ch = tl.arange(0, NCH)[:, None]
    ex = tl.arange(0, BLOCK_E)[None, :]
    cnt = tl.load(counts_ptr + ch * BLOCK_E + ex, mask=ch < n_chunks, other=0)
    padded = (tl.sum(cnt, axis=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, axis=0)
    earlier_chunks = tl.cumsum(cnt, axis=0) - cnt
    lower_experts = tl.cumsum(cnt, axis=1) - cnt
    tl.store(offset_ptr + ch * BLOCK_E + ex, (pad_end - padded)[None, :] + earlier_chunks - lower_experts,
             mask=ch < n_chunks)
    for s0 in range(0, n_slots, FILL):
        slots = s0 + tl.arange(0, FILL)
        tl.store(sorted_pairs_ptr + slots, tl.zeros([FILL], dtype=tl.int32) + P, mask=slots < n_slots)
    for b0 in range(0, n_blocks, FILL_B):
        blocks = b0 + tl.arange(0, FILL_B)
        # the experts whose padded runs end at or before the block's start (a searchsorted)
        e_of = tl.sum((pad_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(e_of < E, e_of, -1), mask=blocks < n_blocks)


@triton.jit
def _align_scatter_kernel(ids_ptr, offset_ptr, sorted_pairs_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    # chunk c sorted by (expert, pair index), the stable order; position j goes to offset[c, e] + j
    c = tl.program_id(0)
    j = tl.arange(0, CHUNK)
    key = tl.sort(_align_ids(ids_ptr, c, P, E, CHUNK, BLOCK_E) * CHUNK + j)
    e = key // CHUNK
    ok = e < BLOCK_E
    dest = tl.load(offset_ptr + c * BLOCK_E + e, mask=ok, other=0) + j
    tl.store(sorted_pairs_ptr + dest, c * CHUNK + key % CHUNK, mask=ok)


# Experts up to which align runs the three kernels above (the plan's [chunks, experts] tile in one
# program); more take the torch ops (align_torch). The torch form is ~20 small launches a layer; H200
# Qwen3-30B-A3B 2048-token prefill, same run: captured 35.29 ms torch vs 31.64 kernels
# (bench/results/h200/prefill_variants_align.json), eager 8 layers 10.97 vs 7.50 ms (eager_prefill_probe.txt).
ALIGN_MAX_EXPERTS = 256


def _align_chunk(P: int, device: torch.device) -> int:
    """Pairs per program of the align kernels: at most 64 chunks (the plan's tile), 1k-16k pairs each
    on the GPU; on the CPU (interpreter tests) small chunks so that several run."""
    if device.type != "cuda":
        return max(16, triton.next_power_of_2(-(-P // 4)))
    return min(1 << 14, max(1 << 10, triton.next_power_of_2(-(-P // 16))))


def _align_blocks(P: int, E: int, block_m: int) -> int:
    """Blocks of the sorted pair list: the bound ceil((P + min(E, P) * (block_m - 1)) / block_m)."""
    return -(-(P + min(E, P) * (block_m - 1)) // block_m)


def align(topk_ids: torch.Tensor, E: int, block_m: int):
    """Sort the (token, expert) pairs by expert and pad each expert's run to whole blocks of block_m.

    Returns ``sorted_pairs [n_blocks * block_m]`` (pair index t*k+j, or T*k for padding) and
    ``block_expert [n_blocks]`` (-1 for blocks past the end). n_blocks is the bound
    ceil((P + min(E, P) * (block_m - 1)) / block_m), fixed by the shapes, so all of this is device work
    without syncs (capturable). Within an expert the pairs keep their order (as a stable sort).
    More than ALIGN_MAX_EXPERTS experts (or chunks past the plan's 64) take :func:`align_torch`.
    """
    P = topk_ids.numel()
    chunk = _align_chunk(P, topk_ids.device)
    n_chunks = -(-P // chunk)
    if E > ALIGN_MAX_EXPERTS or n_chunks > 64:
        return align_torch(topk_ids, E, block_m)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n_blocks = _align_blocks(P, E, block_m)
    block_e = triton.next_power_of_2(E)
    counts = torch.empty((n_chunks, block_e), dtype=torch.int32, device=dev)
    offset = torch.empty_like(counts)
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    _align_count_kernel[(n_chunks,)](ids, counts, P, E, CHUNK=chunk, BLOCK_E=block_e, num_warps=8)
    gpu = dev.type == "cuda"
    _align_plan_kernel[(1,)](counts, offset, sorted_pairs, block_expert, n_chunks, P, E, n_blocks * block_m, n_blocks,
                             BLOCK_M=block_m, NCH=triton.next_power_of_2(n_chunks), BLOCK_E=block_e,
                             FILL=4096 if gpu else 64, FILL_B=max(1, (8192 if gpu else 256) // block_e), num_warps=8)
    _align_scatter_kernel[(n_chunks,)](ids, offset, sorted_pairs, P, E, CHUNK=chunk, BLOCK_E=block_e, num_warps=8)
    return sorted_pairs, block_expert, n_blocks


def align_torch(topk_ids: torch.Tensor, E: int, block_m: int):
    """:func:`align` in torch ops, for more experts than ALIGN_MAX_EXPERTS: the same result."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    n_blocks = _align_blocks(P, E, block_m)
    sorted_e, order = torch.sort(flat.to(sort_key_dtype(E)), stable=True)
    sorted_e = sorted_e.long()
    counts = torch.zeros(E, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (pad_end - padded)[sorted_e] + rank
    sorted_pairs = torch.full((n_blocks * block_m,), P, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(n_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < E, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert, n_blocks


def sort_key_dtype(E: int) -> torch.dtype:
    """The narrowest integer dtype holding expert ids < E, for align_torch's sort: the GPU radix sort
    takes one pass per key byte (int64 ids: 8 passes, ~47 us a layer at 2048 Qwen3-30B-A3B tokens; one
    byte: ~8 us)."""
    return torch.uint8 if E <= 256 else torch.int16 if E <= 1 << 15 else torch.int32


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
