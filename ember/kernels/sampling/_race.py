"""The sampler's draw, shared by its two-launch and one-launch kernels: per-row parameters, the
exponential race (Gumbel-max over Philox noise), the candidate list (values >= a lower bound L on the
threshold), thresholds read off the sorted candidates, and the exact bisection fallback.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels.sampling._grid import INT64_MIN, _ordered_key, _pack, _race_key, _row_param, _token


@triton.jit
def _kth_largest(vals, k, BLOCK: tl.constexpr):
    """k-th largest of a register block (1 <= k <= BLOCK; -inf padding sorts last)."""
    srt = tl.sort(vals, descending=True)
    return tl.max(tl.where(tl.arange(0, BLOCK) == k - 1, srt, -float("inf")), axis=0)


@triton.jit
def _fallback_select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, seed, off,
                              BLOCK: tl.constexpr):
    """Exact thresholds by bisection on the ordered int32 key of z, with passes over the row."""
    base = x_ptr + row * stride_x
    zero = (k * 0).to(tl.int64)
    # top-k: the largest key t_k with count(key >= t_k) >= k (k == 0: everything)
    lo = zero - 2147483648
    hi = zero + 2147483647
    if k == 0:
        hi = lo
    while lo < hi:  # invariant: count(key >= lo) >= k, answer in [lo, hi]
        mid = (lo + hi + 1) >> 1
        cnt = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32) / t
            cnt += (_ordered_key(z).to(tl.int64) >= mid).to(tl.int32)
        if tl.sum(cnt, axis=0) >= k:
            lo = mid
        else:
            hi = mid - 1
    tk = lo
    massk = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32) / t
        massk += tl.where((_ordered_key(z).to(tl.int64) >= tk) & (z > -float("inf")), tl.exp(z - M), 0.0)
    mass_k = tl.sum(massk, axis=0)
    # top-p: the smallest key t_p with mass(key > t_p) < p * mass_k among the top-k survivors. It is
    # at most key(M) (nothing lies above the max) and above t_lo = M + log((1 - p) * mass_k / V) - 1:
    # below t_lo lies at most V * exp(t_lo - M) < (1 - p) * mass_k of mass. The narrower range
    # cut H200 top-p alone at [1, 128256] from 1921 to 1534 us (1024-element steps; 32 -> ~25 passes)
    lo = tl.maximum(tk, _ordered_key(M + tl.log(tl.maximum((1.0 - p) * mass_k / V, 1e-30)) - 1.0).to(tl.int64))
    hi = _ordered_key(M).to(tl.int64)
    if p >= 1.0:
        hi = lo
    while lo < hi:
        mid = (lo + hi) >> 1
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32) / t
            acc += tl.where((_ordered_key(z).to(tl.int64) > mid) & (z > -float("inf")), tl.exp(z - M), 0.0)
        if tl.sum(acc, axis=0) < p * mass_k:
            hi = mid
        else:
            lo = mid + 1
    tp = lo
    best_key = tl.full([BLOCK], -float("inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32) / t
        keep = (_ordered_key(z).to(tl.int64) >= tp) & (tl.exp(z - M) >= minp) & (z > -float("inf"))
        key = tl.where(keep, _race_key(z, cols, seed, off), -float("inf"))
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, cols, best_idx)
    w = tl.argmax(best_key, axis=0)
    return tl.sum(tl.where(tl.arange(0, BLOCK) == w, best_idx, 0), axis=0)


@triton.jit
def _row_sampling_params(t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar, seed_ptr, seed_scalar,
                         row, V, T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr,
                         MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr):
    """(temperature, top_k (0 when >= V), top_p, min_p, Philox key) of ``row``. SEED_MODE: 0 a scalar
    seed, 1 one seed tensor for the batch (both mixed with the row index), 2 per-row seeds, 3 per-row
    seeds that the row's finisher advances (``_store_token``)."""
    t = _row_param(t_ptr, t_scalar, row, tl.float32, T_PER_ROW)
    k = _row_param(k_ptr, k_scalar, row, tl.int32, K_PER_ROW)
    p = _row_param(p_ptr, p_scalar, row, tl.float32, P_PER_ROW)
    minp = _row_param(mp_ptr, mp_scalar, row, tl.float32, MP_PER_ROW)
    if SEED_MODE >= 2:  # a per-row seed is the row's whole key: its draws do not depend on its index
        seed = tl.load(seed_ptr + row).to(tl.int64)
    else:  # one seed for the batch: mixed with the row index so that rows draw apart
        if SEED_MODE == 0:
            seed = tl.cast(seed_scalar, tl.int64)
        else:
            seed = tl.load(seed_ptr).to(tl.int64)
        seed = seed + tl.cast(row, tl.int64) * 0x632BE59BD9B4E019
    return t, tl.where(k >= V, 0, k), p, minp, seed


@triton.jit
def _chunk_race(z, cols, inb, M, minp, seed, row, off, c, CHUNK: tl.constexpr):
    """Min-p (or no) filter: this chunk's packed best race key (``_pack``)."""
    keep = inb & (tl.exp(z - M) >= minp) & (z > -float("inf"))
    key = tl.where(keep, _race_key(z, cols, seed, off), -float("inf"))
    j = tl.argmax(key, axis=0)
    return _pack(tl.max(key, axis=0), c * CHUNK + j)


@triton.jit
def _candidate_bound(chunk_max, k, p, P, V, PB: tl.constexpr, CAP: tl.constexpr, KC: tl.constexpr):
    """Lower bound L on the final threshold from the chunk maxima (module docstring): the k-th largest
    chunk max for top-k, the KC-th largest for top-p alone; +inf (fallback) when k > P; -inf for a
    row short enough to take whole."""
    rank = tl.where(k > 0, tl.minimum(k, PB), tl.minimum(P, KC))
    L = _kth_largest(chunk_max, rank, PB)
    L = tl.where((k > 0) & (k > P), float("inf"), L)
    return tl.where(V <= CAP, -float("inf"), L)


@triton.jit
def _append_candidates(z, cols, inb, L, n_ptr, cand_z_ptr, cand_i_ptr, row, CAP: tl.constexpr,
                       PACKED: tl.constexpr, SEM: tl.constexpr):
    """Append this chunk's values >= L (and their columns) to the row's list; n_ptr counts them
    (PACKED: in the low 32 bits of an int64 whose high bits count arrivals). SEM "relaxed" is
    enough when the caller's arrival on the same counter releases the stores: the reservation
    only hands out slots, and RMWs on one address keep the release sequence."""
    is_cand = inb & (z >= L) & (z > -float("inf"))
    base = tl.atomic_add(n_ptr, tl.sum(is_cand.to(tl.int32), axis=0).to(n_ptr.dtype.element_ty), sem=SEM,
                         scope="gpu")
    if PACKED:
        base = base & 0xFFFFFFFF
    slot = base + tl.cumsum(is_cand.to(tl.int32), axis=0) - 1
    ok = is_cand & (slot < CAP)
    tl.store(cand_z_ptr + row * CAP + slot, z, mask=ok)
    tl.store(cand_i_ptr + row * CAP + slot, cols, mask=ok)


@triton.jit
def _thresholds_sorted(cz, k, p, M, Z, mass_above, BLOCK: tl.constexpr):
    """(tau, candidate mass) from the candidates ``cz`` ([BLOCK], -inf padded): sort them, read tau_k
    and tau_p off the sorted prefix sums. ``mass_above``: the mass of the row's values above every
    candidate that are not in the list (the nucleus search's bracket; 0 otherwise)."""
    i = tl.arange(0, BLOCK)
    srt = tl.sort(cz, descending=True)
    e = tl.exp(srt - M)
    tau_k = tl.max(tl.where(i == k - 1, srt, -float("inf")), axis=0)   # -inf when k == 0
    ek = tl.where(srt >= tau_k, e, 0.0)
    mass_k = tl.where(k > 0, tl.sum(ek, axis=0), Z)
    # mass strictly before each sorted position; the nucleus ends at the last one < p
    before = tl.cumsum(ek, axis=0) - ek + mass_above
    in_p = (before < p * mass_k) & (srt >= tau_k) & (srt > -float("inf"))
    tau_p = tl.min(tl.where(in_p, srt, float("inf")), axis=0)
    return tl.where(p < 1.0, tau_p, tau_k), tl.sum(e, axis=0)


@triton.jit
def _race_block(cand_z_ptr, cand_i_ptr, n, row, k, p, minp, M, Z, mass_above, seed, off, CAP: tl.constexpr,
                BLOCK: tl.constexpr):
    """(packed winner (``_pack``), candidate mass) from the first BLOCK slots of the row's candidate
    list (n <= BLOCK): the thresholds, then the race among the survivors."""
    i = tl.arange(0, BLOCK)
    cz = tl.load(cand_z_ptr + row * CAP + i, mask=i < n, other=-float("inf"), cache_modifier=".cg")
    ci = tl.load(cand_i_ptr + row * CAP + i, mask=i < n, other=0, cache_modifier=".cg")
    return _race_values(cz, ci, row, k, p, minp, M, Z, mass_above, seed, off, BLOCK)


@triton.jit
def _race_values(cz, ci, row, k, p, minp, M, Z, mass_above, seed, off, BLOCK: tl.constexpr,
                 PACKED_MAX: tl.constexpr = False):
    """(packed winner, candidate mass) of the candidates ``cz`` (-inf padded) at columns ``ci``.
    PACKED_MAX: the winner as one max over packed (key, column) words (the largest key, then the
    smallest column, as the chunk races' slots) instead of an argmax, a max and a gather-by-sum;
    INT64_MIN when no candidate survives (never, with a candidate at the row max and min_p < 1)."""
    i = tl.arange(0, BLOCK)
    tau, cand_mass = _thresholds_sorted(cz, k, p, M, Z, mass_above, BLOCK)
    keep = (cz >= tau) & (tl.exp(cz - M) >= minp) & (cz > -float("inf"))
    key = tl.where(keep, _race_key(cz, ci, seed, off), -float("inf"))
    if PACKED_MAX:
        won = tl.max(tl.where(keep, _pack(key, ci), INT64_MIN), axis=0)
    else:
        w = tl.argmax(key, axis=0)
        won = _pack(tl.max(key, axis=0), tl.sum(tl.where(i == w, ci, 0), axis=0))
    return won, cand_mass


@triton.jit
def _race_list(cand_z_ptr, cand_i_ptr, n, row, k, p, minp, M, Z, mass_above, seed, off, CAP: tl.constexpr,
               SMALL_SORT: tl.constexpr):
    """``_race_block`` over the row's n <= CAP listed candidates, sorted as a SMALL_SORT block when they
    fit (H200: the last program's selection 3.8 us with a 512 sort)."""
    if n <= SMALL_SORT:
        won, cand_mass = _race_block(cand_z_ptr, cand_i_ptr, n, row, k, p, minp, M, Z, mass_above, seed, off, CAP,
                                     SMALL_SORT)
    else:
        won, cand_mass = _race_block(cand_z_ptr, cand_i_ptr, n, row, k, p, minp, M, Z, mass_above, seed, off, CAP,
                                     CAP)
    return won, cand_mass


@triton.jit
def _select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, Z, L, n, cand_z_ptr, cand_i_ptr, seed, off,
                     CAP: tl.constexpr, FALLBACK_BLOCK: tl.constexpr, SMALL_SORT: tl.constexpr):
    """The row's token from its n candidates (every value >= L): sort them (``_race_list``), read
    tau_k and tau_p off the sorted prefix sums, race the survivors; the exact bisection over the row
    when the list overflowed or cannot decide top-p."""
    won, cand_mass = _race_list(cand_z_ptr, cand_i_ptr, n, row, k, p, minp, M, Z, 0.0, seed, off, CAP, SMALL_SORT)
    tok = _token(won)
    # top-k: the candidates hold every value >= L <= tau_k. top-p alone: they hold all the mass
    # above L, so the nucleus is decided iff that mass reaches p
    complete = tl.where(k > 0, L < float("inf"), (cand_mass >= p * Z) | (V <= CAP))
    complete = complete & (n <= CAP)
    if complete == 0:
        tok = _fallback_select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, seed, off, FALLBACK_BLOCK)
    return tok


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
