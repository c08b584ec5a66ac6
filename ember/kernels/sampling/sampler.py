"""The sampler's launches: ``sample`` (the dispatch), the two-launch path (``_chunk_stats_kernel`` then
``_sample_kernel``) and the one-launch sampler's host side (``sample_one_launch``; its kernel is in
``one_launch_sampler``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start
from ember.kernels.sampling._grid import (CAP, FALLBACK_BLOCK, INT64_MIN, NUCLEUS_PIVOTS, NUCLEUS_ROUNDS,
                                          RESERVE_SEM, ROW_BLOCK_MAX, SPIN_CAP, TOPP_CANDIDATE_CHUNKS,
                                          TWO_LAUNCH_FALLBACK_BLOCK, _combine_stats, _device_sms, _store_token,
                                          _one_launch_enabled, _stats, _tagged_slots, _token, _warps,
                                          _workspace_buffer, _workspace_views)
from ember.kernels.sampling._plan import (fit_split, min_chunk, sample_warps, small_sort, split, temperature_alone,
                                          topk_tagged, wave_rows_plan, waves_pay)
from ember.kernels.sampling._race import (_append_candidates, _candidate_bound, _chunk_race, _row_sampling_params,
                                          _select_and_race)
from ember.kernels.sampling.one_launch_sampler import _sample_one_launch_kernel


@triton.jit(do_not_specialize=["t_scalar", "k_scalar", "p_scalar", "mp_scalar", "seed_scalar"])
def _sample_kernel(x_ptr, stride_x, V, P, m_ptr, s_ptr, a_ptr, out_ptr,
                   t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar,
                   seed_ptr, seed_scalar, off_ptr, cnt_ptr, best_ptr, cand_z_ptr, cand_i_ptr,
                   T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr,
                   MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr,
                   CHUNK: tl.constexpr, PB: tl.constexpr, CAP: tl.constexpr, KC: tl.constexpr,
                   FALLBACK_BLOCK: tl.constexpr, SMALL_SORT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t, k, p, minp, seed = _row_sampling_params(t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar,
                                               seed_ptr, seed_scalar, row, V, T_PER_ROW, K_PER_ROW, P_PER_ROW,
                                               MP_PER_ROW, SEED_MODE)
    M, Z, first_chunk, chunk_max = _combine_stats(m_ptr, s_ptr, row, P, PB, "")
    if t == 0.0:  # greedy row: the first index of the max logit
        if c == 0:
            _store_token(out_ptr, row, tl.load(a_ptr + row * P + first_chunk), seed_ptr, SEED_MODE)
    else:
        off = tl.load(off_ptr)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        inb = cols < V
        z = tl.load(x_ptr + row * stride_x + cols, mask=inb, other=-float("inf")).to(tl.float32) / t
        done_ptr = cnt_ptr + row * 2
        if (k == 0) & (p >= 1.0):
            # only min-p (or nothing): the threshold is known from the row max; race this chunk
            tl.atomic_max(best_ptr + row, _chunk_race(z, cols, inb, M, minp, seed, row, off, c, CHUNK))
            if tl.atomic_add(done_ptr, 1) == P - 1:
                packed = tl.atomic_max(best_ptr + row, INT64_MIN)
                _store_token(out_ptr, row, _token(packed), seed_ptr, SEED_MODE)
        else:
            L = _candidate_bound(chunk_max, k, p, P, V, PB, CAP, KC)
            _append_candidates(z, cols, inb, L, done_ptr + 1, cand_z_ptr, cand_i_ptr, row, CAP, False, "acq_rel")
            if tl.atomic_add(done_ptr, 1) == P - 1:
                n = tl.atomic_add(done_ptr + 1, 0)
                tok = _select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, Z, L, n, cand_z_ptr, cand_i_ptr,
                                       seed, off, CAP, FALLBACK_BLOCK, SMALL_SORT)
                _store_token(out_ptr, row, tok, seed_ptr, SEED_MODE)



# ----------------------------------------------------------------------------- launch helpers
def _param(v, dtype_scalar):
    """(pointer-or-dummy, scalar, per_row) for a per-row tensor or a Python scalar."""
    if isinstance(v, torch.Tensor):
        return v, dtype_scalar(0), True
    return None, dtype_scalar(v), False


def _sampling_args(temperature, top_k, top_p, min_p, seed, dummy: torch.Tensor,
                   advance_seed: bool = False) -> tuple[tuple, dict]:
    """The sample kernels' (pointer-or-dummy, scalar) argument pairs for temperature, top_k, top_p,
    min_p and seed, and their PER_ROW / SEED_MODE constexprs (``advance_seed``: per-row seeds that
    the kernel advances, SEED_MODE 3; the caller checked one seed per row)."""
    params = [_param(v, kind) for v, kind in ((temperature, float), (top_k, int), (top_p, float), (min_p, float))]
    if advance_seed:
        seed_mode, seed_ptr, seed_s = 3, seed.view(-1), 0
    elif isinstance(seed, torch.Tensor):
        seed_mode, seed_ptr, seed_s = (1 if seed.numel() == 1 else 2), seed.view(-1), 0
    else:
        seed_mode, seed_ptr, seed_s = 0, dummy, int(seed)
    args = tuple(v for ptr, scalar, per_row in params for v in (ptr if per_row else dummy, scalar)) + (seed_ptr, seed_s)
    flags = dict(zip(("T_PER_ROW", "K_PER_ROW", "P_PER_ROW", "MP_PER_ROW"), (per_row for _, _, per_row in params)))
    return args, dict(flags, SEED_MODE=seed_mode)


def sample(x2: torch.Tensor, out: torch.Tensor, temperature, top_k, top_p, min_p, seed, offset,
           every_row: str | None = None, advance_seed: bool = False) -> None:
    """One token per row into int64 ``out``; parameters are Python scalars or per-row tensors (validated);
    ``every_row`` ("temperature_only", "top_k" or None) what the per-row tensors are known to hold
    (``ember.ops.sample``), which selects the specialised one-launch paths as scalars would.

    ``seed`` is an int or an int64 tensor of 1 or ``rows`` elements; ``offset`` an int, None, or a
    one-element int64 tensor that each call advances by one; ``advance_seed``: ``seed`` holds one
    seed per row, and each row's finisher adds SEED_STEP to it after the draw. Long rows on a GPU
    take one launch (``sample_one_launch``): all rows at once when ``fit_split`` fits them, else in
    waves when ``waves_pay``; everything else takes ``sample_two_launch``.
    """
    B, V = x2.shape
    if V > ROW_BLOCK_MAX and _one_launch_enabled(x2):
        mc = min_chunk(x2.device)
        fit = fit_split(B, V, _device_sms(x2), mc)
        if fit is not None:
            sample_one_launch(x2, out, temperature, top_k, top_p, min_p, seed, offset, chunk=fit[0],
                              every_row=every_row, advance_seed=advance_seed)
            return
        pays = waves_pay(temperature, top_k, top_p, V, every_row)
        plan = wave_rows_plan(B, V, _device_sms(x2), mc) if pays else None
        if plan is not None:
            sample_one_launch(x2, out, temperature, top_k, top_p, min_p, seed, offset, chunk=plan[0],
                              rows_per_wave=plan[1], every_row=every_row, advance_seed=advance_seed)
            return
    sample_two_launch(x2, out, temperature, top_k, top_p, min_p, seed, offset, advance_seed)


def sample_two_launch(x2: torch.Tensor, out: torch.Tensor, temperature, top_k, top_p, min_p, seed, offset,
                      advance_seed: bool = False) -> None:
    """``sample`` in two launches: chunk statistics (launch 1 also advances a tensor offset), then the
    race (launch 2). Any shape, any device the kernels run on; on the GPU also the one-launch
    sampler's reference (the same Philox keys, so the same tokens for the same seed and offset)."""
    B, V = x2.shape
    dev = x2.device
    chunk, P, PB = split(V, min_chunk(dev))
    cap = min(CAP, max(16, triton.next_power_of_2(V)))  # a short row sorts only itself
    # launch 1 zeroes these for launch 2 (no memset launch): per row [done programs, candidates],
    # the best packed race key per row, and the RNG offset this call uses
    cnt = torch.empty((B, 2), dtype=torch.int32, device=dev)
    state = torch.empty(B + 1, dtype=torch.int64, device=dev)
    best, off_out = state[:B], state[B:]
    cand_z = torch.empty((B, cap), dtype=torch.float32, device=dev)
    cand_i = torch.empty((B, cap), dtype=torch.int32, device=dev)
    has_off = isinstance(offset, torch.Tensor)
    args, flags = _sampling_args(temperature, top_k, top_p, min_p, seed, state, advance_seed)
    m, s, a = _stats(x2, args[0], args[1], flags["T_PER_ROW"], chunk, P,
                     sample_state=(cnt, best, offset.view(-1) if has_off else state, 0 if has_off else int(offset or 0),
                                   off_out, has_off))
    _sample_kernel[(B, P)](
        x2, x2.stride(0), V, P, m, s, a, out, *args, off_out, cnt, best, cand_z, cand_i, **flags,
        CHUNK=chunk, PB=PB, CAP=cap, KC=TOPP_CANDIDATE_CHUNKS, FALLBACK_BLOCK=TWO_LAUNCH_FALLBACK_BLOCK,
        SMALL_SORT=min(small_sort(dev), cap), num_warps=_warps(chunk) * 2,
        **pdl_options(x2.device))


def sample_one_launch(x2: torch.Tensor, out: torch.Tensor, temperature, top_k, top_p, min_p, seed, offset,
                      spin_cap: int = SPIN_CAP, chunk: int | None = None, rows_per_wave: int | None = None,
                      every_row: str | None = None, advance_seed: bool = False) -> None:
    """``sample`` as one grid-barrier launch (``_sample_one_launch_kernel``); the caller guarantees that
    all B * P programs are resident at once (``sample`` takes it when ``fit_split`` finds chunks with
    B * P <= SM count on a GPU: one row of 128256 as 126 programs of 1024, 8 rows as 8 x 16 of 8192).

    ``chunk``: elements per program, a power-of-2 multiple of ``split``'s (default: that one). Each
    program publishes the maxima of its chunk's pieces of ``split``'s size, so the candidate bound
    (the k-th largest piece max) is the two launches' at any chunk and top-k keeps its candidate list
    for k up to 128 whatever the batch. Programs take 8 warps (``sample_warps``: 4 at the base chunk
    when top-k may be on; 16 would cap the registers at 128, and the kernel uses 255 at 4); bigger
    chunks also take the nucleus search's per-pivot sums.

    ``rows_per_wave`` (G < B): a persistent launch of G x P programs (G * P <= SM count) that walks the
    rows in waves (``sample`` takes it past what ``fit_split`` fits, with ``wave_rows_plan``)."""
    B, V = x2.shape
    if rows_per_wave is not None and rows_per_wave < 1:
        raise ValueError(f"sample_one_launch: rows_per_wave must be >= 1, got {rows_per_wave}")
    G = B if rows_per_wave is None else min(rows_per_wave, B)
    dev = x2.device
    base, _, _ = split(V, min_chunk(dev))
    chunk = base if chunk is None else chunk
    if chunk % base or (chunk // base) & (chunk // base - 1):
        raise ValueError(f"sample_one_launch: chunk {chunk} is not a power-of-2 multiple of {base}")
    sub = chunk // base
    P = triton.cdiv(V, chunk)
    PB = max(2, triton.next_power_of_2(P))
    cap = min(CAP, max(16, triton.next_power_of_2(V)))
    part = torch.empty((3, B, P), dtype=torch.float32, device=dev)
    piece_max = torch.empty((B, P * sub), dtype=torch.float32, device=dev)
    slots = torch.empty((B, P), dtype=torch.int64, device=dev)
    cand_z = torch.empty((B, cap), dtype=torch.float32, device=dev)
    cand_i = torch.empty((B, cap), dtype=torch.int32, device=dev)
    pivots = torch.empty((2, B, NUCLEUS_ROUNDS, P, NUCLEUS_PIVOTS), dtype=torch.float32, device=dev)  # mass, count
    ws = _workspace_buffer(dev, B)
    barrier, count, row_barriers = _workspace_views(ws, B)
    round_barriers = row_barriers[1:]
    has_off = isinstance(offset, torch.Tensor)
    args, flags = _sampling_args(temperature, top_k, top_p, min_p, seed, slots, advance_seed)
    topk_on = every_row != "temperature_only" and (isinstance(top_k, torch.Tensor) or 0 < top_k < V)
    free = temperature_alone(temperature, top_k, top_p, min_p, V, every_row)
    tagged = G == B and topk_tagged(temperature, top_k, V, every_row)
    grid_slots = _tagged_slots(ws, B, "grid") if tagged else None
    _sample_one_launch_kernel[(G, P)](
        x2, x2.stride(0), B, G, V, P, G * P, part[0], part[1], part[2].view(torch.int32), piece_max, slots, out,
        *args, offset.view(-1) if has_off else slots, 0 if has_off else int(offset or 0), pivots[0],
        pivots[1].view(torch.int32), round_barriers, round_barriers.stride(0), row_barriers[0], barrier, count,
        cand_z, cand_i, spin_cap, **flags, WAVES=G < B,
        OFFSET_TENSOR=has_off, CHUNK=chunk, PB=PB, SUB=sub, QB=max(2, triton.next_power_of_2(P * sub)), CAP=cap,
        KC=TOPP_CANDIDATE_CHUNKS, FALLBACK_BLOCK=FALLBACK_BLOCK,
        SMALL_SORT=min(small_sort(dev), cap), RESERVE_SEM=RESERVE_SEM, NB=NUCLEUS_PIVOTS, ROUNDS=NUCLEUS_ROUNDS,
        LD_POLL=dev.type == "cuda", FREE=free, TAGGED=tagged, slots=grid_slots,
        # H200 [1, 128256] k50 + p0.9, offset tensor, same run: 6.92 us (every program acquires the
        # offset) -> 6.79 (the finisher's) -> 6.54 (and the packed race); sample_tagged_probe_offset.json
        OFF_BY_FINISHER=tagged and B == 1, num_warps=sample_warps(dev, base, sub, topk_on), **pdl_options(dev))


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
