"""The one-launch sampler's kernel (``_sample_one_launch_kernel``) and its per-row paths: the top-k
candidates behind the grid barrier (tagged words when the host knows every row takes top-k), the
barrier-free race for temperature alone, the distributed nucleus search for top-p alone, and the
persistent waves over more rows than fit at once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import await_tagged, generation_tag, pdl_start, tagged, untagged
from ember.kernels.sampling._grid import (BARRIER_GEN, GRID_MAXIMA_WORDS, GRID_SLOT_WORDS, INT64_MIN, _arrival,
                                          _barrier_wait, _chunk_max_sum, _combine_stats, _ld_acquire,
                                          _ordered_key, _slot_then_best_token, _store_token, _token)
from ember.kernels.sampling._race import (_append_candidates, _candidate_bound, _chunk_race,
                                          _fallback_select_and_race, _race_list, _race_values, _row_sampling_params,
                                          _select_and_race)


@triton.jit
def _pivot(a, b, lo, jj, NB: tl.constexpr):
    """Pivot jj of a round: NB - 1 spread evenly from b (jj = 0) down to a, the last one at lo."""
    q = b - (b - a) * (tl.full([], jj, tl.float32) / (NB - 2))
    if jj == NB - 1:
        q = lo
    return q


@triton.jit
def _pivot_partials(z, e, a, b, lo, NB: tl.constexpr, PER_PIVOT: tl.constexpr):
    """(pivots q, mass, count): per pivot q_j (``_pivot``) the mass (sum of e) and the count of this
    block's finite values z >= q_j, as one [CHUNK, NB] block and two sums over it. H200, inside the
    one-launch sampler: 13.7-23.9 us a call at NB = 8 vs 15.0-27.3 with two sums per pivot (the
    sampler is at 255 registers; bench/results/h200/raw/nucleus_probe_partials_modes_2026-12-01.json,
    pivot_partials_probe.json).
    PER_PIVOT (chunks of several 1024 pieces, where the block would be NB times the chunk in
    registers): two sums per pivot."""
    j = tl.arange(0, NB)
    q = tl.zeros([NB], tl.float32)
    fin = z > -float("inf")
    if PER_PIVOT:
        g = tl.zeros([NB], tl.float32)
        n = tl.zeros([NB], tl.int32)
        for jj in tl.static_range(NB):
            qj = _pivot(a, b, lo, jj, NB)
            ge = (z >= qj) & fin
            q = tl.where(j == jj, qj, q)
            g = tl.where(j == jj, tl.sum(tl.where(ge, e, 0.0), axis=0), g)
            n = tl.where(j == jj, tl.sum(ge.to(tl.int32), axis=0), n)
    else:
        for jj in tl.static_range(NB):
            q = tl.where(j == jj, _pivot(a, b, lo, jj, NB), q)
        ge = (z[:, None] >= q[None, :]) & fin[:, None]
        g = tl.sum(tl.where(ge, e[:, None], 0.0), axis=0)
        n = tl.sum(ge.to(tl.int32), axis=0)
    return q, g, n


@triton.jit
def _pick(vec, j, i):
    """vec[i] of a register block indexed by j (tl.arange)."""
    return tl.sum(tl.where(j == i, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def _nucleus_bracket(z, e, xrow, V, t1, M, Z0, p, row, c, P, pg_ptr, pn_ptr, round_bar_ptr, round_bar_stride, bar_ptr,
                     spin_cap,
                     CHUNK: tl.constexpr, PB: tl.constexpr, NB: tl.constexpr, ROUNDS: tl.constexpr,
                     CAP: tl.constexpr, PER_PIVOT: tl.constexpr, LD_POLL: tl.constexpr):
    """Top-p alone: a bracket [lo, hi) of z holding the nucleus threshold, searched by the row's P
    programs together (each holds its chunk z and e = exp(z - M) in registers).

    The threshold is the largest row value v with G(v) >= p * Z, G(v) the mass of the values >= v
    and Z the row's mass: the sorted prefix sums' rule without the sort. Per round every program
    stores the mass and count of its values >= each of NB pivots spread over the bracket (the last
    pivot is the bracket's lower end; round 0 has it at -inf, which gives Z), meets its siblings at
    the row's barrier, and sums the P partials: the same sums in the same order in every program,
    so all take the same bracket: [q_j, q_{j-1}) for the first pivot with G(q_j) >= p * Z. Rounds
    stop once the bracket holds <= CAP values. Round 0 spreads the pivots from the row max down to
    M + log((1 - p) * Z0' / V) - 1, Z0' the row statistics' mass floored to a power of 2 (every value
    below it together has < (1 - p) of the mass).
    A program that gives up waiting stores every chunk's partials itself (the values its siblings
    store: same code on the same data) and goes on, counted in ``bar_ptr[1]``.
    Returns (lo, hi, mass of the values >= hi, Z, values in the bracket).
    """
    j = tl.arange(0, NB)
    pid = tl.arange(0, PB)
    fzero = M * 0.0
    lo = fzero - float("inf")
    hi = fzero + float("inf")
    g_hi = fzero
    Z = fzero
    n_hi = (c * 0).to(tl.int32)
    n_br = n_hi + CAP + 1
    # log Z0 floored to a whole power of 2: a looser bound, but the same in a program that recomputed Z0
    # from the row (a sum in another order) unless Z0 sits within rounding of a power of 2
    a0 = tl.maximum(M + tl.log((1.0 - p) / V.to(tl.float32)) + tl.floor(tl.log2(Z0)) * 0.6931471805599453 - 1.0,
                    M - 40.0)
    r = 0
    while (r < ROUNDS) & (n_br > CAP):
        a = tl.where(lo > -float("inf"), lo, a0)
        b = tl.where(hi < float("inf"), hi, M)
        q, g, n = _pivot_partials(z, e, a, b, lo, NB, PER_PIVOT)
        base = (row * ROUNDS + r) * P
        tl.store(pg_ptr + (base + c) * NB + j, g)
        tl.store(pn_ptr + (base + c) * NB + j, n)
        tl.debug_barrier()  # the partial stores precede the release below
        add = _arrival(c == 0, P)
        bar = round_bar_ptr + r * round_bar_stride + row
        v = tl.atomic_add(bar, add, sem="acq_rel", scope="gpu")
        gave_up = _barrier_wait(bar, v, add, spin_cap, LD_POLL)
        if gave_up:
            for c2 in range(0, P):
                cols2 = c2 * CHUNK + tl.arange(0, CHUNK)
                z2 = tl.load(xrow + cols2, mask=cols2 < V, other=-float("inf")).to(tl.float32) / t1
                _, g2, n2 = _pivot_partials(z2, tl.where(z2 > -float("inf"), tl.exp(z2 - M), 0.0), a, b, lo, NB, PER_PIVOT)
                tl.store(pg_ptr + (base + c2) * NB + j, g2)
                tl.store(pn_ptr + (base + c2) * NB + j, n2)
            tl.atomic_add(bar_ptr + 1, 1)
        tl.debug_barrier()
        offs = (base + pid[:, None]) * NB + j[None, :]
        G = tl.sum(tl.load(pg_ptr + offs, mask=pid[:, None] < P, other=0.0, cache_modifier=".cg"), axis=0)
        N = tl.sum(tl.load(pn_ptr + offs, mask=pid[:, None] < P, other=0, cache_modifier=".cg"), axis=0)
        Z = tl.where(r == 0, _pick(G, j, NB - 1), Z)
        js = tl.min(tl.where(G >= p * Z, j, NB - 1), axis=0)
        above = js > 0
        hi = tl.where(above, _pick(q, j, js - 1), hi)
        g_hi = tl.where(above, _pick(G, j, js - 1), g_hi)
        n_hi = tl.where(above, _pick(N, j, js - 1), n_hi)
        lo = _pick(q, j, js)
        n_br = _pick(N, j, js) - n_hi
        r += 1
    return lo, hi, g_hi, Z, n_br


@triton.jit
def _row_stats_exact(xrow, V, t, P, CHUNK: tl.constexpr, PB: tl.constexpr):
    """What ``_combine_stats`` gives, computed by one program from the whole row (the one-launch
    sampler's fallback when it gave up waiting at the grid barrier): M, Z, first argmax, chunk maxima."""
    idx = tl.arange(0, PB)
    cm = tl.full([PB], -float("inf"), tl.float32)
    cs = tl.zeros([PB], tl.float32)
    ca = tl.zeros([PB], tl.int32)
    for c2 in range(0, P):
        cols = c2 * CHUNK + tl.arange(0, CHUNK)
        z = tl.load(xrow + cols, mask=cols < V, other=-float("inf")).to(tl.float32) / t
        m2, s2 = _chunk_max_sum(z)
        cm = tl.where(idx == c2, m2, cm)
        cs = tl.where(idx == c2, s2, cs)
        ca = tl.where(idx == c2, c2 * CHUNK + tl.argmax(z, axis=0), ca)
    M = tl.max(cm, axis=0)
    Z = tl.sum(tl.where(cm > -float("inf"), cs * tl.exp(cm - M), 0.0), axis=0)
    first = tl.argmax(cm, axis=0)
    return M, Z, tl.sum(tl.where(idx == first, ca, 0), axis=0), cm


@triton.jit
def _piece_maxima_exact(xrow, V, t, n_pieces, PIECE: tl.constexpr, QB: tl.constexpr):
    """The row's n_pieces piece maxima ([QB], -inf padded) from memory: what the one-launch sampler's
    programs publish, for one that gave up waiting (maxima are exact, so the same values)."""
    iq = tl.arange(0, QB)
    pm = tl.full([QB], -float("inf"), tl.float32)
    for i in range(0, n_pieces):
        cols = i * PIECE + tl.arange(0, PIECE)
        z = tl.load(xrow + cols, mask=cols < V, other=-float("inf")).to(tl.float32) / t
        pm = tl.where(iq == i, tl.max(z, axis=0), pm)
    return pm


@triton.jit
def _topk_sample(row, c, z, cols, inb, m, off, x_ptr, stride_x, V, P, ms_ptr, out_ptr, t, t1, k, p, minp, seed,
                 seed_ptr, cnt_ptr, cand_z_ptr, cand_i_ptr, gave_up, SEED_MODE: tl.constexpr, SUB: tl.constexpr,
                 QB: tl.constexpr, CHUNK: tl.constexpr, CAP: tl.constexpr, KC: tl.constexpr,
                 FALLBACK_BLOCK: tl.constexpr, SMALL_SORT: tl.constexpr, RESERVE_SEM: tl.constexpr):
    """``_sample_row`` after the barrier for a top-k row (k > 0, t > 0; rows whose top-k the host cannot
    see, per-row tensors or waves; scalar top-k takes ``_topk_tagged_row``): program c holds chunk z of
    max m. The bound L (k-th largest piece max) and the row max M come from the published piece
    maxima alone: the candidates decide tau_k, tau_p and the mass they are taken against. H200
    [1, 128256] T 0.7 / top-k 50 / top-p 0.9, same-run A/B (sampler_ab_topk_skip.json): 8.60 -> 7.75 us
    without the row statistics' read (top-p alone 16.42 -> 16.75 us in the same runs: the kernel's
    code changed around it; temperature alone unchanged)."""
    iq = tl.arange(0, QB)
    if gave_up:
        piece_max = _piece_maxima_exact(x_ptr + row * stride_x, V, t1, P * SUB, CHUNK // SUB, QB)
    else:
        piece_max = tl.load(ms_ptr + row * P * SUB + iq, mask=iq < P * SUB, other=-float("inf"),
                            cache_modifier=".cg")
    M = tl.max(piece_max, axis=0)
    L = _candidate_bound(piece_max, k, p, P * SUB, V, QB, CAP, KC)
    # only the programs holding candidates (chunk max >= L) append and arrive, each with two
    # atomics on the row's counter: + its candidate count (the low 32 bits reserve its slots),
    # then + 1 << 32 (arrival, releasing its stores). The last sender sees every reservation
    # in the value its arrival returns. No sender (L = +inf: the fallback) -> program 0 finishes.
    # A chunk sends when one of its SUB pieces reaches L.
    chunk_max = tl.max(tl.reshape(piece_max, [QB // SUB, SUB]), axis=1)
    sends = (chunk_max >= L) & (chunk_max > -float("inf"))
    senders = tl.sum(sends.to(tl.int32), axis=0)
    mine = (m >= L) & (m > -float("inf"))
    n = 0
    finish = (senders == 0) & (c == 0)
    if mine:
        _append_candidates(z, cols, inb, L, cnt_ptr + row, cand_z_ptr, cand_i_ptr, row, CAP, True, RESERVE_SEM)
        tl.debug_barrier()  # the candidate stores precede the release below
        old = tl.atomic_add(cnt_ptr + row, 1 << 32, sem="acq_rel", scope="gpu")
        finish = (old >> 32) == senders - 1
        n = (old & 0xFFFFFFFF).to(tl.int32)
    if finish:
        tl.debug_barrier()
        # Z: unused for k > 0 (the mass is the candidates'); 1.0 keeps the expressions finite
        tok = _select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, 1.0, L, n, cand_z_ptr, cand_i_ptr,
                               seed, off, CAP, FALLBACK_BLOCK, SMALL_SORT)
        tl.store(cnt_ptr + row, 0)
        _store_token(out_ptr, row, tok, seed_ptr, SEED_MODE)


@triton.jit
def _race_tagged(cand_ptr, n, tag, row, k, p, minp, M, seed, off, spin_cap, BLOCK: tl.constexpr):
    """(packed winner, gave up) over the row's n <= BLOCK tagged candidate pairs (tag | z, tag | column);
    the winner by one max over packed (key, column) words, INT64_MIN if none survived (``_race_values``
    PACKED_MAX: 6.79 -> 6.54 us against an argmax, a max and a gather, sample_tagged_probe_offset.json)."""
    wz, wi, stale = await_tagged(cand_ptr, n, tag, spin_cap, True, BLOCK)
    cz = tl.where(tl.arange(0, BLOCK) < n, untagged(wz), -float("inf"))
    # Z: unused for k > 0 (the mass is the candidates'); 1.0 keeps the expressions finite
    won, _ = _race_values(cz, (wi & 0xFFFFFFFF).to(tl.int32), row, k, p, minp, M, 1.0, 0.0, seed, off, BLOCK,
                          True)
    return won, stale


@triton.jit
def _topk_tagged_row(row, c, z, cols, inb, off, tag, x_ptr, stride_x, V, P, n_programs, out_ptr, offset_ptr,
                     t, k, p, minp, seed, seed_ptr, bar_ptr, cnt_ptr, slots, spin_cap, SEED_MODE: tl.constexpr,
                     OFFSET_TENSOR: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, QB: tl.constexpr,
                     CAP: tl.constexpr, KC: tl.constexpr, FALLBACK_BLOCK: tl.constexpr,
                     SMALL_SORT: tl.constexpr, LD_POLL: tl.constexpr, OFF_BY_FINISHER: tl.constexpr = False):
    """Program c's part of row ``row`` (chunk ``z``) when the host knows every row takes top-k (scalar
    t > 0, scalar 0 < k < V; grid case): ``_topk_sample``'s algorithm with no release drain and no
    reservation round trip. The piece maxima are tagged int64 words (``tagged``; the tag is the grid
    counter's generation + 1, read before this program arrives), stored relaxed; the arrival is
    relaxed, the counter only says when to read, and a reader re-reads any word with an older tag.
    A sender reserves its slots and arrives in one relaxed atomic on the row's counter (+ 1 << 32 +
    its count) and then stores its candidates as tagged pairs; the last sender knows the list's
    length from that atomic and re-reads the pairs until all carry the tag. Slots ``slots[row]``:
    [GRID_MAXIMA_WORDS] maxima, then [CAP] pairs (``_tagged_slots(ws, rows, "grid")``: tags only grow there).
    OFF_BY_FINISHER (one row): only the row's finisher uses the RNG offset (the senders store values,
    not keys), so it reads it with a plain load like every program and advances it itself after its
    race: one program reads and writes, no acquire and no cross-program order needed (H200: 6.92 ->
    6.79 us, sample_tagged_probe_offset.json). Several rows: every program acquires the offset
    before arriving and program (0, 0) advances it after the barrier."""
    rs = slots + row * GRID_SLOT_WORDS
    if SUB == 1:
        m = tl.max(z, axis=0)
        tl.store(rs + c, tagged(m, tag))
    else:  # the maxima of the chunk's SUB pieces: the candidate bound's granularity
        pm = tl.max(tl.reshape(z, [SUB, CHUNK // SUB]), axis=1)
        tl.store(rs + c * SUB + tl.arange(0, SUB), tagged(pm, tag))
        m = tl.max(pm, axis=0)
    first_prog = (row == 0) & (c == 0)
    add = _arrival(first_prog, n_programs)
    v = tl.atomic_add(bar_ptr, add, sem="relaxed", scope="gpu")  # when to look: a hint
    gave_up = _barrier_wait(bar_ptr, v, add, spin_cap, LD_POLL)
    if OFFSET_TENSOR and not OFF_BY_FINISHER:
        if first_prog:  # every program read it (acquire) before arriving
            tl.store(offset_ptr, off + 1)
    wm, _, stale = await_tagged(rs, P * SUB, tag, spin_cap, False, QB)
    iq = tl.arange(0, QB)
    piece_max = tl.where(iq < P * SUB, untagged(wm), -float("inf"))
    if gave_up | stale:  # the maxima from the row itself (exact, slow, counted)
        piece_max = _piece_maxima_exact(x_ptr + row * stride_x, V, t, P * SUB, CHUNK // SUB, QB)
        tl.atomic_add(bar_ptr + 1, 1)
    M = tl.max(piece_max, axis=0)
    L = _candidate_bound(piece_max, k, p, P * SUB, V, QB, CAP, KC)
    chunk_max = tl.max(tl.reshape(piece_max, [QB // SUB, SUB]), axis=1)
    senders = tl.sum(((chunk_max >= L) & (chunk_max > -float("inf"))).to(tl.int32), axis=0)
    finish = (senders == 0) & (c == 0)   # no sender (L = +inf): program 0 takes the fallback
    n = senders * 0
    cand = rs + GRID_MAXIMA_WORDS
    if (m >= L) & (m > -float("inf")):
        is_cand = inb & (z >= L) & (z > -float("inf"))
        mine = tl.sum(is_cand.to(tl.int32), axis=0)
        old = tl.atomic_add(cnt_ptr + row, (1 << 32) + mine.to(tl.int64), sem="relaxed", scope="gpu")
        base = (old & 0xFFFFFFFF).to(tl.int32)
        slot = base + tl.cumsum(is_cand.to(tl.int32), axis=0) - 1
        ok = is_cand & (slot < CAP)
        tl.store(cand + 2 * slot, tagged(z, tag), mask=ok)
        tl.store(cand + 2 * slot + 1, (tag << 32) | cols.to(tl.int64), mask=ok)
        finish = (old >> 32) == senders - 1
        n = base + mine
    if finish:
        exact = (L == float("inf")) | (n > CAP)   # no bound (k above the pieces) or an overflowed list
        won = tl.full([], 0, tl.int64)
        if exact == 0:
            if n <= SMALL_SORT // 2:   # H200 [1, 128256] k 50: 6.79 -> 6.66 us (n ~ 55-82 there)
                won, late = _race_tagged(cand, n, tag, row, k, p, minp, M, seed, off, spin_cap, SMALL_SORT // 2)
            elif n <= SMALL_SORT:
                won, late = _race_tagged(cand, n, tag, row, k, p, minp, M, seed, off, spin_cap, SMALL_SORT)
            else:
                won, late = _race_tagged(cand, n, tag, row, k, p, minp, M, seed, off, spin_cap, CAP)
            if late:  # pairs that never came (counted): exact
                tl.atomic_add(bar_ptr + 1, 1)
            exact = late | (won == INT64_MIN)   # (no survivor: cannot happen, but never a made-up token)
        if exact:
            tok = _fallback_select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, seed, off, FALLBACK_BLOCK)
        else:
            tok = _token(won)
        tl.store(cnt_ptr + row, 0)
        _store_token(out_ptr, row, tok, seed_ptr, SEED_MODE)
        if OFFSET_TENSOR and OFF_BY_FINISHER:
            tl.store(offset_ptr, off + 1)


@triton.jit
def _free_race_row(row, c, off, x_ptr, stride_x, V, P, slot_ptr, out_ptr, t_ptr, t_scalar, k_ptr, k_scalar, p_ptr,
                   p_scalar, mp_ptr, mp_scalar, seed_ptr, seed_scalar, cnt_ptr,
                   T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr,
                   MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr):
    """Program c's part of row ``row`` when the host knows every row samples by temperature alone
    (t > 0, no top-k, top-p or min-p): all tokens race, so no statistic of the row is needed and
    the program goes from its chunk to its slot without the barrier (the same keys, so the same
    token, as the barrier path's race)."""
    t, k, p, minp, seed = _row_sampling_params(t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar,
                                               seed_ptr, seed_scalar, row, V, T_PER_ROW, K_PER_ROW, P_PER_ROW,
                                               MP_PER_ROW, SEED_MODE)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    inb = cols < V
    z = tl.load(x_ptr + row * stride_x + cols, mask=inb, other=-float("inf")).to(tl.float32) / t
    _slot_then_best_token(_chunk_race(z, cols, inb, 0.0, 0.0, seed, row, off, c, CHUNK), row, c, P, slot_ptr,
                          cnt_ptr, out_ptr, PB, seed_ptr, SEED_MODE)


@triton.jit
def _sample_row(row, c, off, x_ptr, stride_x, V, P, n_programs, m_ptr, s_ptr, a_ptr, ms_ptr, slot_ptr, out_ptr,
                t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar, seed_ptr, seed_scalar,
                offset_ptr, pg_ptr, pn_ptr, round_bar_ptr, round_bar_stride, row_bar_ptr, bar_ptr, cnt_ptr,
                cand_z_ptr, cand_i_ptr, spin_cap,
                T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr,
                MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr, OFFSET_TENSOR: tl.constexpr,
                CHUNK: tl.constexpr, PB: tl.constexpr, SUB: tl.constexpr, QB: tl.constexpr,
                CAP: tl.constexpr, KC: tl.constexpr, FALLBACK_BLOCK: tl.constexpr, SMALL_SORT: tl.constexpr,
                RESERVE_SEM: tl.constexpr, NB: tl.constexpr, ROUNDS: tl.constexpr, WAVES: tl.constexpr,
                LD_POLL: tl.constexpr):
    """Program c's part of row ``row`` in ``_sample_one_launch_kernel`` (its docstring)."""
    t, k, p, minp, seed = _row_sampling_params(t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar,
                                               seed_ptr, seed_scalar, row, V, T_PER_ROW, K_PER_ROW, P_PER_ROW,
                                               MP_PER_ROW, SEED_MODE)
    t1 = tl.where(t == 0.0, 1.0, t)  # greedy rows: z = x
    cols = c * CHUNK + tl.arange(0, CHUNK)
    inb = cols < V
    xrow = x_ptr + row * stride_x
    z = tl.load(xrow + cols, mask=inb, other=-float("inf")).to(tl.float32) / t1
    m, s = _chunk_max_sum(z)
    tl.store(m_ptr + row * P + c, m)
    tl.store(s_ptr + row * P + c, s)
    tl.store(a_ptr + row * P + c, c * CHUNK + tl.argmax(z, axis=0))
    if SUB == 1:
        tl.store(ms_ptr + row * P + c, m)
    else:  # the maxima of the chunk's SUB pieces: the candidate bound's granularity (host docstring)
        tl.store(ms_ptr + (row * P + c) * SUB + tl.arange(0, SUB), tl.max(tl.reshape(z, [SUB, CHUNK // SUB]), axis=1))
    tl.debug_barrier()  # every thread's stores precede the release below
    first_prog = (row == 0) & (c == 0)
    if WAVES:  # the row's own barrier: its P programs, all resident
        bar_at = row_bar_ptr + row
        add = _arrival(c == 0, P)
    else:      # the grid barrier
        bar_at = bar_ptr
        add = _arrival(first_prog, n_programs)
    v = tl.atomic_add(bar_at, add, sem="acq_rel", scope="gpu")
    gave_up = _barrier_wait(bar_at, v, add, spin_cap, LD_POLL)
    tl.debug_barrier()
    if OFFSET_TENSOR & (not WAVES):
        if first_prog:  # every program read it before arriving at the grid barrier
            tl.store(offset_ptr, off + 1)
    if gave_up:
        tl.atomic_add(bar_ptr + 1, 1)
    if (k > 0) & (t != 0.0):
        # top-k (and top-p after it): the thresholds come from the candidates alone, so the row's
        # max and sum (_combine_stats, one more dependent read of the partials) are not needed
        _topk_sample(row, c, z, cols, inb, m, off, x_ptr, stride_x, V, P, ms_ptr, out_ptr, t, t1, k, p, minp,
                     seed, seed_ptr, cnt_ptr, cand_z_ptr, cand_i_ptr, gave_up, SEED_MODE, SUB, QB, CHUNK, CAP, KC,
                     FALLBACK_BLOCK, SMALL_SORT, RESERVE_SEM)
    else:
        M, Z, first_chunk, chunk_max = _combine_stats(m_ptr, s_ptr, row, P, PB, ".cg")
        if gave_up:  # the whole row from HBM (slow, exact, counted above)
            M, Z, first_max, chunk_max = _row_stats_exact(xrow, V, t1, P, CHUNK, PB)
        else:
            first_max = tl.load(a_ptr + row * P + first_chunk, cache_modifier=".cg", mask=t == 0.0, other=0)
        if t == 0.0:  # greedy row: the first index of the max logit
            if c == 0:
                _store_token(out_ptr, row, first_max, seed_ptr, SEED_MODE)
        elif (k == 0) & (p >= 1.0):
            _slot_then_best_token(_chunk_race(z, cols, inb, M, minp, seed, row, off, c, CHUNK), row, c, P, slot_ptr,
                                  cnt_ptr, out_ptr, PB, seed_ptr, SEED_MODE)
        elif k == 0:  # top-p alone: the distributed nucleus search (_nucleus_bracket)
            e = tl.where(z > -float("inf"), tl.exp(z - M), 0.0)
            lo, hi, g_hi, Zn, n_br = _nucleus_bracket(z, e, xrow, V, t1, M, Z, p, row, c, P, pg_ptr, pn_ptr,
                                                      round_bar_ptr, round_bar_stride, bar_ptr, spin_cap, CHUNK, PB,
                                                      NB, ROUNDS, CAP, SUB > 1, LD_POLL)
            # the values >= hi are in the nucleus whatever its threshold: each program races its own;
            # the bracket's values go to the list, for the row's last program to cut and race
            tl.store(slot_ptr + row * P + c, _chunk_race(z, cols, inb & (z >= hi), M, minp, seed, row, off, c, CHUNK))
            searched = n_br <= CAP
            in_br = inb & (z >= lo) & (z < tl.where(searched, hi, lo))   # empty when not searched
            if tl.max(in_br.to(tl.int32), axis=0) > 0:
                _append_candidates(z, cols, in_br, -float("inf"), cnt_ptr + row, cand_z_ptr, cand_i_ptr, row, CAP, True,
                                   RESERVE_SEM)
            tl.debug_barrier()  # slot and list stores precede the arrival (release) below
            old = tl.atomic_add(cnt_ptr + row, 1 << 32, sem="acq_rel", scope="gpu")
            if (old >> 32) == P - 1:
                tl.debug_barrier()
                listed = (old & 0xFFFFFFFF).to(tl.int32)
                i = tl.arange(0, PB)
                won = tl.max(tl.load(slot_ptr + row * P + i, mask=i < P, other=INT64_MIN, cache_modifier=".cg"), axis=0)
                bracketed = searched & (listed <= CAP)
                if bracketed:
                    cw, cm = _race_list(cand_z_ptr, cand_i_ptr, listed, row, 0, p, minp, M, Zn, g_hi, seed, off, CAP,
                                        SMALL_SORT)
                    won = tl.maximum(won, cw)
                # no bracket within ROUNDS (ties wider than CAP), or no survivor (a rounding at a bracket
                # edge): the exact bisection over the row
                if (bracketed == 0) | ((won >> 32) <= _ordered_key(M * 0.0 - float("inf")).to(tl.int64)):
                    tok = _fallback_select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, seed, off,
                                                    FALLBACK_BLOCK)
                else:
                    tok = _token(won)
                _store_token(out_ptr, row, tok, seed_ptr, SEED_MODE)
                tl.store(cnt_ptr + row, 0)


@triton.jit(do_not_specialize=["B", "G", "t_scalar", "k_scalar", "p_scalar", "mp_scalar", "seed_scalar",
                               "offset_scalar", "spin_cap"])
def _sample_one_launch_kernel(x_ptr, stride_x, B, G, V, P, n_programs, m_ptr, s_ptr, a_ptr, ms_ptr, slot_ptr, out_ptr,
                              t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar,
                              seed_ptr, seed_scalar, offset_ptr, offset_scalar, pg_ptr, pn_ptr, round_bar_ptr,
                              round_bar_stride, row_bar_ptr, bar_ptr, cnt_ptr, cand_z_ptr, cand_i_ptr, spin_cap,
                              T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr,
                              MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr, OFFSET_TENSOR: tl.constexpr,
                              CHUNK: tl.constexpr, PB: tl.constexpr, SUB: tl.constexpr, QB: tl.constexpr,
                              CAP: tl.constexpr, KC: tl.constexpr,
                              FALLBACK_BLOCK: tl.constexpr, SMALL_SORT: tl.constexpr,
                              RESERVE_SEM: tl.constexpr, NB: tl.constexpr, ROUNDS: tl.constexpr,
                              WAVES: tl.constexpr = False, LD_POLL: tl.constexpr = False,
                              PDL: tl.constexpr = False, FREE: tl.constexpr = False,
                              TAGGED: tl.constexpr = False, slots=None, OFF_BY_FINISHER: tl.constexpr = False):
    """``_chunk_stats_kernel`` + ``_sample_kernel`` in ONE launch (few rows: all B * P programs
    resident, as ``_softmax_one_launch_kernel``): each program publishes its chunk's statistics,
    meets the others at the grid barrier, and goes on from the chunk it still holds in registers.
    Finishing a row is the last-to-arrive pattern on the persistent workspace: per row one counter
    (``cnt``: arrivals; with candidates, arrivals in the high 32 bits and the candidate count in the
    low), put back to 0 by the row's last program; the min-p race combines per-program slots
    (``slot``) instead of an ``atomic_max`` on one. With candidates only the programs holding some
    take part after the barrier (H200 [1, 128256] k 50: ~50 of 126), so the row's two atomics see
    fewer contenders. Top-p alone takes the nucleus search (``_nucleus_bracket``: rounds behind
    per-round row barriers, then every program arrives once; the values above the bracket race in
    the per-program slots, the bracket's values in the list). A chunk of SUB pieces (few rows with
    grown chunks) publishes each piece's max (``ms``), so the top-k bound is taken over the pieces.
    The RNG offset is read by every program before the barrier and advanced by program (0, 0) after
    it. A program that gives up waiting recomputes its row's statistics from the whole row (exact,
    counted in ``bar_ptr[1]``); under Triton's interpreter, where programs run one after another,
    program (0, 0) then advances the offset before the others read it: still exact in distribution.

    WAVES (more rows than fit at once): the grid is G rows x P programs, all resident; program (g, c)
    takes chunk c of rows g, g + G, g + 2G, ..., each behind that row's own barrier (row_bar_ptr, as
    ``_softmax_waves_kernel``) instead of the grid barrier. Every program reads the RNG offset first
    and then arrives at the grid counter; the last to arrive advances the offset.

    FREE (the host knows every row samples by temperature alone): no barrier at all; each program
    races its chunk into its slot (``_free_race_row``), the offset advanced as in WAVES.

    TAGGED (the host knows every row takes top-k: scalar t > 0, scalar 0 < k < V; not WAVES): the
    piece maxima and the candidates are tagged words in ``slots`` behind relaxed atomics
    (``_topk_tagged_row``); the rest of the kernel's paths are ``_sample_rows``.
    """
    pdl_start(PDL)
    g = tl.program_id(0)
    c = tl.program_id(1)
    if TAGGED:
        row = g.to(tl.int64)
        t, k, p, minp, seed = _row_sampling_params(t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr,
                                                   mp_scalar, seed_ptr, seed_scalar, row, V, T_PER_ROW, K_PER_ROW,
                                                   P_PER_ROW, MP_PER_ROW, SEED_MODE)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        inb = cols < V
        z = tl.load(x_ptr + row * stride_x + cols, mask=inb, other=-float("inf")).to(tl.float32) / t
        # issued after the chunk's load: the acquire orders this program's arrival after the read
        # of the offset (which program (0, 0) advances once all have arrived) without delaying x
        if OFFSET_TENSOR:  # (OFF_BY_FINISHER: the finisher reads and advances it, _topk_tagged_row)
            if LD_POLL and not OFF_BY_FINISHER:
                off = _ld_acquire(offset_ptr)
            else:
                off = tl.load(offset_ptr)
        else:
            off = tl.cast(offset_scalar, tl.int64)
        tag = generation_tag(tl.load(bar_ptr, cache_modifier=".cg") // BARRIER_GEN)  # not complete yet
        _topk_tagged_row(row, c, z, cols, inb, off, tag, x_ptr, stride_x, V, P, n_programs, out_ptr, offset_ptr,
                         t, k, p, minp, seed, seed_ptr, bar_ptr, cnt_ptr, slots, spin_cap, SEED_MODE, OFFSET_TENSOR,
                         CHUNK, SUB, QB,
                         CAP, KC, FALLBACK_BLOCK, SMALL_SORT, LD_POLL, OFF_BY_FINISHER)
    else:
        _sample_rows(g, c, x_ptr, stride_x, B, G, V, P, n_programs, m_ptr, s_ptr, a_ptr, ms_ptr, slot_ptr, out_ptr,
                     t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar, seed_ptr, seed_scalar,
                     offset_ptr, offset_scalar, pg_ptr, pn_ptr, round_bar_ptr, round_bar_stride, row_bar_ptr, bar_ptr,
                     cnt_ptr, cand_z_ptr, cand_i_ptr, spin_cap, T_PER_ROW, K_PER_ROW, P_PER_ROW, MP_PER_ROW,
                     SEED_MODE, OFFSET_TENSOR, CHUNK, PB, SUB, QB, CAP, KC, FALLBACK_BLOCK, SMALL_SORT, RESERVE_SEM,
                     NB, ROUNDS, WAVES, LD_POLL, FREE)


@triton.jit
def _sample_rows(g, c, x_ptr, stride_x, B, G, V, P, n_programs, m_ptr, s_ptr, a_ptr, ms_ptr, slot_ptr, out_ptr,
                 t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar, seed_ptr, seed_scalar,
                 offset_ptr, offset_scalar, pg_ptr, pn_ptr, round_bar_ptr, round_bar_stride, row_bar_ptr, bar_ptr,
                 cnt_ptr, cand_z_ptr, cand_i_ptr, spin_cap, T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr,
                 P_PER_ROW: tl.constexpr, MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr,
                 OFFSET_TENSOR: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr, SUB: tl.constexpr,
                 QB: tl.constexpr, CAP: tl.constexpr, KC: tl.constexpr, FALLBACK_BLOCK: tl.constexpr,
                 SMALL_SORT: tl.constexpr, RESERVE_SEM: tl.constexpr, NB: tl.constexpr, ROUNDS: tl.constexpr,
                 WAVES: tl.constexpr, LD_POLL: tl.constexpr, FREE: tl.constexpr):
    """``_sample_one_launch_kernel`` without TAGGED: program (g, c)'s rows (one, or waves, or free races)."""
    if OFFSET_TENSOR:
        off = tl.load(offset_ptr)
    else:
        off = tl.cast(offset_scalar, tl.int64)
    if WAVES or FREE:
        if OFFSET_TENSOR:
            tl.debug_barrier()  # every thread has read the offset before the arrival below
            add = _arrival((g == 0) & (c == 0), n_programs)
            v = tl.atomic_add(bar_ptr, add, sem="acq_rel", scope="gpu")
            if (v + add) % BARRIER_GEN == 0:  # the last reader
                tl.store(offset_ptr, off + 1)
    if FREE:
        for i in range(0, (B - g + G - 1) // G):
            _free_race_row((g + i * G).to(tl.int64), c, off, x_ptr, stride_x, V, P, slot_ptr, out_ptr, t_ptr,
                           t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar, seed_ptr, seed_scalar,
                           cnt_ptr, T_PER_ROW, K_PER_ROW, P_PER_ROW, MP_PER_ROW, SEED_MODE, CHUNK, PB)
    elif WAVES:
        for i in range(0, (B - g + G - 1) // G):
            _sample_row((g + i * G).to(tl.int64), c, off, x_ptr, stride_x, V, P, n_programs, m_ptr, s_ptr, a_ptr,
                        ms_ptr, slot_ptr, out_ptr, t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr,
                        mp_scalar, seed_ptr, seed_scalar, offset_ptr, pg_ptr, pn_ptr, round_bar_ptr,
                        round_bar_stride, row_bar_ptr, bar_ptr, cnt_ptr, cand_z_ptr, cand_i_ptr, spin_cap,
                        T_PER_ROW, K_PER_ROW, P_PER_ROW, MP_PER_ROW, SEED_MODE, OFFSET_TENSOR, CHUNK, PB, SUB, QB,
                        CAP, KC, FALLBACK_BLOCK, SMALL_SORT, RESERVE_SEM, NB, ROUNDS, True, LD_POLL)
    else:
        _sample_row(g.to(tl.int64), c, off, x_ptr, stride_x, V, P, n_programs, m_ptr, s_ptr, a_ptr, ms_ptr,
                    slot_ptr, out_ptr, t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar,
                    seed_ptr, seed_scalar, offset_ptr, pg_ptr, pn_ptr, round_bar_ptr, round_bar_stride,
                    row_bar_ptr, bar_ptr, cnt_ptr, cand_z_ptr, cand_i_ptr, spin_cap, T_PER_ROW, K_PER_ROW,
                    P_PER_ROW, MP_PER_ROW, SEED_MODE, OFFSET_TENSOR, CHUNK, PB, SUB, QB, CAP, KC, FALLBACK_BLOCK,
                    SMALL_SORT, RESERVE_SEM, NB, ROUNDS, False, LD_POLL)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
