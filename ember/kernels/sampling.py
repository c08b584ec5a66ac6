"""Triton kernels for softmax, log-softmax, argmax and sorting-free sampling.

Two shapes of work:
  * rows up to ``ROW_BLOCK_MAX`` elements: one row per program, the row held in registers (1 launch);
  * longer rows: split over ``P <= 128`` programs per row. Launch 1 (``_chunk_stats_kernel``) writes
    each chunk's max, sum of exp and first argmax; launch 2 combines the P statistics of its row and
    finishes (normalise, or sample).
  * longer rows, one launch: inside a CUDA graph every dependent launch costs ~2 us of latency, more
    than the HBM time of a [1, 128256] row (0.12 us), so the few-row cases run as ONE launch:
      - argmax (``_argmax_split_kernel``): every program packs (value key, inverted index) into an
        int64 ``atomic_max`` on its row's slot; the last program of the row (arrival counter) writes
        the index and puts slot and counter back to their initial values;
      - softmax / log-softmax (``_softmax_one_launch_kernel``), when all B * P programs fit on the
        GPU at once (B * P <= SM count, real GPU only): each program publishes its chunk's max and sum
        of exp, waits at a grid barrier, combines its row's P partials and normalises the chunk it
        still holds in registers (the row is read once, not twice).
      - softmax / log-softmax of MANY long rows (B * P > SM count; ``_softmax_waves_kernel``): one
        persistent launch of as many programs as fit on the GPU at once (``wave_plan``); each row is
        split over P programs and the programs walk the rows in waves, meeting their row's P siblings
        (tagged partial words, a relaxed counter as the hint of when to read them) between publishing
        their chunk's (max, sum of exp) and writing the normalised chunk from registers. Again x is
        read once: [256, 128256] fp32 moves 131 MB in + 131 MB out = 263 MB, 63 us at 4.15 TB/s copy
        bandwidth. Measured (H200, graph-timed): 78.7-79.6 us, 79.4-80.4% of copy bandwidth, against
        107.6 us for the two launches, which read x twice (394 MB: 131 MB > the 50 MB L2, so the
        second read mostly misses) and 135-136 us for torch.softmax (the kernel docstring has the
        sweeps).
      ``EMBER_SOFTMAX_ONE_LAUNCH=0`` forces the two-launch path for both softmax cases and for sampling (A/B timing).
    All keep their counters in a small persistent per-device workspace (``_workspace``) that every
    launch leaves in its initial state, so no memset launch is needed and the ops stay capturable.
    All launch with programmatic dependent launch on sm_90+ (``pdl_options``): back to back in a graph
    the next call's programs are resident before this one ends. H200, [1, 128256] fp32 (graph-timed,
    bench/results/h200/sampling_latency_probe.json): softmax 3.16 us, argmax 2.41 us; floors there:
    an empty 126-program kernel 1.02 us, a 126-program load-and-reduce 1.36 us.
    Limitation: the workspace is per device, not per stream; two of these calls running concurrently
    on two streams of one device would share counters (ember issues them from one stream).

Sampling (``sample``; the semantics are ember/ops/sampling.py's float64 reference) is the same two
launches, or for few rows (B * P <= SM count with chunks grown by ``fit_split``, GPU; up to 16 rows of
128256) both in one (``_sample_one_launch_kernel``: grid barrier between them; H200 [1, 128256] T 0.7 / top-k 50 / top-p 0.9: 8.3 us (two launches: 11.6, measured
before the small sort), temperature alone 6.7 us). More rows take the same kernel as one persistent
launch walking the rows in waves behind per-row barriers (``wave_rows_plan``) when some row may need
top-p alone (``_waves_pay``), the two launches otherwise.
Temperature alone (scalar parameters: t > 0, no top-k, top-p or min-p) needs no row statistic: the
one-launch sampler then races each chunk without its barrier (``_free_race_row``; H200 [1, 128256]:
4.41 vs 6.19 us with the barrier). Launch 2 draws with an exponential race (Gumbel-max): token ``argmax(z - log(-log u))``
over the surviving tokens, ``u`` from Philox keyed on (seed, token, row, offset), so no sort and no
cumulative sum over the row. The survivors are ``{z >= tau}`` for one threshold tau:
  * no top-k / top-p: tau comes from the row max alone (min-p), every program races its chunk and
    the winners meet in a packed int64 ``atomic_max``; the last program of the row writes the token;
  * top-k / top-p: a lower bound L on tau comes from the chunk maxima (the k-th largest chunk max is
    <= the k-th largest value). Each program appends its values >= L to a small candidate list; the
    last program of the row sorts those (<= CAP values, not the row; a SMALL_SORT block when they
    fit), reads tau_k and tau_p off the sorted prefix sums, and races the candidates;
  * top-p alone in the one-launch sampler: the nucleus search (``_nucleus_bracket``) spread over the
    row's resident programs: rounds of pivot masses meeting at per-round row barriers narrow a
    bracket of z to <= CAP values; those are listed, the values above the bracket are raced by
    their own programs, the row's last program cuts the list and races it (H200 [1, 128256]:
    13-24 us over peaked to flat rows, 1-4 rounds; the one-program bisection it replaced took
    0.03-0.9 ms there: bench/results/h200/nucleus_probe.json);
  * when the list overflows CAP or cannot decide top-p (two launches: a flat row whose nucleus
    reaches below L; one launch: ties wider than CAP at the threshold), the last program falls
    back to an exact bisection on the order-preserving integer key of z with passes over the row:
    same distribution, but slow (H200 [1, 128256], top-p 0.9 alone on N(0, 4.3^2) logits, a
    ~400-token nucleus: 0.7 ms). Many rows in two launches (parameters that rule out top-p alone
    for every row) take it only for top-k above the chunk count.
Where the one-launch sampler's time goes (H200 [1, 128256] T 0.7 / top-k 50 / top-p 0.9, 8.3 us;
``bench/sampling_stages_probe.py`` stamps each stage; sampling_stages_probe.json): chunk statistics
1.0 us, grid barrier 1.0, row statistics 0.7, candidate bound (sort of the 126 chunk maxima) 1.1,
append (one relaxed reservation atomic, ~50 of the 126 programs) 1.15, arrival 0.7, the last
program's selection 2.0 (sort of 128; 3.8 with the 512 sort). An acq_rel reservation: 8.7 us.
Top-k rows then stopped reading the row statistics after the barrier (``_topk_sample``: the bound and
the row max come from the piece maxima, the mass from the candidates): 8.60 -> 7.75 us. Top-k known
from the scalars then went to tagged words (``_topk_tagged_row``: no release drain at the barrier, the
reservation and the arrival one relaxed atomic, a 64-block sort when the candidates fit): 7.80 ->
6.66 us (bench/results/h200/sample_tagged_probe.json).
Thresholds by counting ([n, n] comparisons in registers instead of sorts) measured slower: bound
2.2 us, selection 6.2 us.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels._common import (await_tagged, bulk_prefetch_l2, generation_tag, hopper_or_newer, pdl_options,
                                   pdl_start, tagged, tagged_load, untagged)

ROW_BLOCK_MAX = 16384     # one-row-per-program in registers up to here
MAX_PROGRAMS_PER_ROW = 128
MIN_CHUNK = 1024          # split rows: at least this many elements per program
CAP = 512                 # candidate list per row (top-k / top-p path)
TOPP_CANDIDATE_CHUNKS = 32  # top-p only: L = this-th largest chunk max
SMALL_SORT = 128          # up to this many candidates: a sort of this block, not of CAP
NUCLEUS_PIVOTS = 8        # top-p alone, one launch: pivots per round of the distributed search (H200:
                          # 4 needs too many rounds, 16 costs registers: nucleus_probe.json)
NUCLEUS_ROUNDS = 6        # rounds before the bisection fallback (each narrows the bracket ~7x)
FALLBACK_BLOCK = 4096     # elements per step of the bisection fallback's passes over the row:
                          # H200, top-p alone at [1, 128256]: 721 vs 1534 us with 1024 (8192 spills)
RESERVE_SEM = "relaxed"    # one-launch sampler: the candidate-slot reservation atomic (A/B: "acq_rel")
WAVE_ROWS = 8             # more rows than fit at once: waves of the chunks that fit this many rows
TWO_LAUNCH_FALLBACK_BLOCK = 1024  # many rows: 4096 takes 207 registers, halves the programs per SM
                                  # (H200 [64, 128256] k 50 / p 0.9: 145.6 vs 91.8 us; the
                                  # 145.6 run's JSON was not kept: raw/README.md)
INT64_MIN = tl.constexpr(-9223372036854775807 - 1)  # triton 3.6 reads only tl.constexpr(...) globals
# grid barrier: every launch adds exactly BARRIER_GEN to the counter (module docstring of
# _softmax_one_launch_kernel), so it is a multiple of BARRIER_GEN between launches
BARRIER_GEN = tl.constexpr(1 << 20)
ROW_SLOT_WORDS = tl.constexpr(2 * MAX_PROGRAMS_PER_ROW)  # int64 words of tagged partials per row
GRID_MAXIMA_WORDS = tl.constexpr(MAX_PROGRAMS_PER_ROW)            # a row's tagged piece maxima, then
GRID_SLOT_WORDS = tl.constexpr(MAX_PROGRAMS_PER_ROW + 2 * CAP)  # its CAP tagged candidate pairs
# polls before a one-launch softmax program gives up waiting and recomputes its row: at an
# estimated (unmeasured) 0.3-1 us per poll of an L2 atomic, ~0.3-1 s, far beyond any real wait
SPIN_CAP = 1 << 20


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _ordered_key(z):
    """int32 whose order is the float order of z (z + 0.0 folds -0.0 into +0.0)."""
    b = (z + 0.0).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _argmax_key(x, mask):
    """int32 key whose max is torch.argmax's pick: NaN above everything (torch's rule), padding below."""
    key = tl.where(x != x, 2147483647, _ordered_key(x))
    return tl.where(mask, key, -2147483647 - 1)


@triton.jit
def _first_max(key, cols):
    """(max key, smallest column holding it) of a register block."""
    kmax = tl.max(key, axis=0)
    return kmax, tl.min(tl.where(key == kmax, cols, 2147483647), axis=0)


@triton.jit
def _chunk_max_sum(z):
    """max of z and sum of exp(z - max) over a register block (-inf entries contribute 0)."""
    m = tl.max(z, axis=0)
    return m, tl.sum(tl.where(z > -float("inf"), tl.exp(z - m), 0.0), axis=0)


@triton.jit
def _row_max_sum(m_ptr, s_ptr, row, P, PB: tl.constexpr):
    """Row max and sum of exp(z - max) from the row's P chunk partials.

    Loaded with ".cg" (L2, not the SM's incoherent L1): in the one-launch kernel other programs
    wrote them during this launch.
    """
    c = tl.arange(0, PB)
    cm = c < P
    m = tl.load(m_ptr + row * P + c, mask=cm, other=-float("inf"), cache_modifier=".cg")
    s = tl.load(s_ptr + row * P + c, mask=cm, other=0.0, cache_modifier=".cg")
    M = tl.max(m, axis=0)
    return M, tl.sum(tl.where(m > -float("inf"), s * tl.exp(m - M), 0.0), axis=0)


@triton.jit
def _normalised(z, M, Z, LOG: tl.constexpr):
    if LOG:
        return z - M - tl.log(Z)
    else:
        return tl.exp(z - M) / Z


@triton.jit
def _race_key(z, idx, seed, row, off):
    """z + Gumbel noise from Philox(seed; token, row, offset lo, offset hi)."""
    c0 = idx.to(tl.uint32)
    c1 = tl.zeros_like(c0) + row.to(tl.uint32)
    c2 = tl.zeros_like(c0) + (off & 0xFFFFFFFF).to(tl.uint32)
    c3 = tl.zeros_like(c0) + ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    r0, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    u = tl.uint_to_uniform_float(r0)           # [0, 1); u == 0 gives -inf (never wins)
    return z - tl.log(-tl.log(u))


@triton.jit
def _pack(key, idx):
    """(race key, token) -> int64 whose max is the largest key, then the smallest token."""
    return (_ordered_key(key).to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _token(packed):
    """The token of a packed race winner or argmax slot (``_pack``)."""
    return (0x7FFFFFFF - (packed & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def _row_param(ptr, scalar, row, dtype: tl.constexpr, PER_ROW: tl.constexpr):
    if PER_ROW:
        return tl.load(ptr + row).to(dtype)
    else:
        return tl.cast(scalar, dtype)  # tl.cast takes a Python number (interpreter) or a scalar tensor


@triton.jit
def _combine_stats(m_ptr, s_ptr, row, P, PB: tl.constexpr, CACHE: tl.constexpr):
    """Row max, sum of exp(z - max), the first chunk holding the max, and the chunk maxima (padded
    with -inf). CACHE ".cg" reads them from L2: other programs of the same launch wrote them. The
    argmax (a dependent load of that chunk's first argmax) is left to greedy rows."""
    c = tl.arange(0, PB)
    cm = c < P
    m = tl.load(m_ptr + row * P + c, mask=cm, other=-float("inf"), cache_modifier=CACHE)
    s = tl.load(s_ptr + row * P + c, mask=cm, other=0.0, cache_modifier=CACHE)
    M = tl.max(m, axis=0)
    Z = tl.sum(tl.where(m > -float("inf"), s * tl.exp(m - M), 0.0), axis=0)
    return M, Z, tl.argmax(m, axis=0), m


@triton.jit
def _ld_acquire(ptr):
    """``ld.acquire.gpu`` of an int64: a poll that reads the counter without an atomic round trip
    that would queue behind the arrivals on the same address."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _arrival(first, n):
    """What a program adds to a generation counter (barrier or last-arrival) shared by n programs:
    BARRIER_GEN - (n - 1) for the ``first`` one, 1 for the others, so each launch adds exactly
    BARRIER_GEN and the counter is a multiple of it between launches."""
    return tl.where(first, BARRIER_GEN - (n - 1), 1).to(tl.int64)


@triton.jit
def _barrier_wait(ctr_ptr, v, add, spin_cap, LD_POLL: tl.constexpr):
    """After arriving at a generation counter with ``add`` (``v`` the value before), poll it (acquire)
    until the generation is complete, at most ``spin_cap`` times. Returns whether it gave up.

    LD_POLL (GPU only; the interpreter has no inline PTX): poll with ``ld.acquire`` instead of
    ``atomic_add(0)``. H200, [1, 128256] one-launch softmax, PDL on, two runs: 3.04 vs 3.16 us and
    3.19 vs 3.20 us (bench/results/h200/sampling_latency_probe_run1.json, sampling_latency_probe.json)."""
    target = (v // BARRIER_GEN + 1) * BARRIER_GEN
    cur = v + add
    polls = 0
    while (cur < target) & (polls < spin_cap):
        if LD_POLL:
            cur = _ld_acquire(ctr_ptr)
        else:
            cur = tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    return cur < target


@triton.jit
def _row_max_sum_exact(xrow, V, inv_t, BLOCK: tl.constexpr):
    """Max and sum of exp(z - max) of a whole row of z = x * inv_t, read from memory in BLOCK
    pieces with an online update: what a program computes itself when it gave up on a barrier."""
    M = tl.full([], -float("inf"), tl.float32)
    Z = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        w = tl.load(xrow + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_t
        mw, sw = _chunk_max_sum(w)
        M_new = tl.maximum(M, mw)
        Z = tl.where(M > -float("inf"), Z * tl.exp(M - M_new), 0.0) + \
            tl.where(mw > -float("inf"), sw * tl.exp(mw - M_new), 0.0)
        M = M_new
    return M, Z


# ----------------------------------------------------------------------------- one row per program
@triton.jit
def _softmax_row_kernel(x_ptr, out_ptr, stride_x, stride_out, V, inv_t,
                        LOG: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
    M, Z = _chunk_max_sum(z)
    tl.store(out_ptr + row * stride_out + cols, _normalised(z, M, Z, LOG), mask=mask)


@triton.jit
def _argmax_row_kernel(x_ptr, out_ptr, stride_x, V, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _, first = _first_max(_argmax_key(x, mask), cols)
    tl.store(out_ptr + row, first.to(tl.int64))


# ----------------------------------------------------------------------------- split rows, one launch
@triton.jit
def _slot_then_best_token(packed, row, c, P, slot_ptr, cnt_ptr, out_ptr, PB: tl.constexpr):
    """Publish this chunk's packed (key, token) (``_pack``) in its slot; the row's last program to
    arrive writes the largest slot's token and puts the row's counter back to 0 (argmax, and the
    sampler's races)."""
    tl.store(slot_ptr + row * P + c, packed)
    tl.debug_barrier()  # the slot store precedes the release below
    if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu") == P - 1:
        tl.debug_barrier()
        i = tl.arange(0, PB)
        best = tl.max(tl.load(slot_ptr + row * P + i, mask=i < P, other=INT64_MIN, cache_modifier=".cg"), axis=0)
        tl.store(cnt_ptr + row, 0)
        tl.store(out_ptr + row, _token(best).to(tl.int64))


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


@triton.jit
def _softmax_one_launch_kernel(x_ptr, out_ptr, stride_x, stride_out, V, P, n_programs, m_ptr, s_ptr,
                               bar_ptr, inv_t, spin_cap,
                               LOG: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr, LD_POLL: tl.constexpr = False,
                               PDL: tl.constexpr = False):
    """Softmax of rows split over P programs each, in ONE launch with a grid barrier.

    Legal only when all ``n_programs = B * P`` programs are resident at once (the caller launches it
    only for B * P <= SM count, on a real GPU: Triton's interpreter runs programs one after another).
    Saves the second launch (~2 us in a graph) and the second read of the row (z stays in registers).

    Barrier, generation based so no launch resets it: program (0, 0) adds BARRIER_GEN - (n - 1) to
    ``bar_ptr[0]``, every other program adds 1, so each launch adds exactly BARRIER_GEN and the counter
    is a multiple of it between launches. A program's arrival returns the old value v; everyone has
    arrived once the counter reaches (v // BARRIER_GEN + 1) * BARRIER_GEN.
    Memory order: partials stored -> CTA barrier -> release add; acquire polls -> CTA barrier ->
    partials read from L2 (".cg").
    A program that polls ``spin_cap`` times without seeing everyone (cannot happen when all programs
    are resident; could under an SM-limited MPS share) does not hang or guess: it recomputes its row's
    max and sum from the whole row itself, so the output is still exact, and counts the event in
    ``bar_ptr[1]``.
    """
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    xrow = x_ptr + row * stride_x
    z = tl.load(xrow + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
    m, s = _chunk_max_sum(z)
    tl.store(m_ptr + row * P + c, m)
    tl.store(s_ptr + row * P + c, s)
    tl.debug_barrier()  # every thread's stores precede the release below
    first = (row == 0) & (c == 0)
    add = _arrival(first, n_programs)
    v = tl.atomic_add(bar_ptr, add, sem="acq_rel", scope="gpu")
    gave_up = _barrier_wait(bar_ptr, v, add, spin_cap, LD_POLL)
    tl.debug_barrier()
    M, Z = _row_max_sum(m_ptr, s_ptr, row, P, PB)
    if gave_up:  # the whole row from HBM (slow, exact, counted)
        M, Z = _row_max_sum_exact(xrow, V, inv_t, CHUNK)
        tl.atomic_add(bar_ptr + 1, 1)
    tl.store(out_ptr + row * stride_out + cols, _normalised(z, M, Z, LOG), mask=mask)


@triton.jit
def _chunk_to_l2(x_ptr, sink_ptr, row, B, V, stride_x, c, CHUNK: tl.constexpr, LANES: tl.constexpr,
                 ESIZE: tl.constexpr):
    """Bulk-prefetch chunk c of ``row`` (if < B) into L2 from one lane (16-byte multiple of bytes)."""
    lane = tl.arange(0, LANES)
    n_bytes = (tl.minimum(V - c * CHUNK, CHUNK) * ESIZE) // 16 * 16
    n_bytes = tl.where((row < B) & (lane == 0), n_bytes, 0).to(tl.int32)
    done = bulk_prefetch_l2(x_ptr + row * stride_x + c * CHUNK + lane * 0, n_bytes)
    tl.store(sink_ptr + lane, done.to(tl.float32), mask=done != 0)  # never (keeps the asm alive)


@triton.jit
def _tagged_row_poll(row_slots, P, tag, PB: tl.constexpr, FIRST: tl.constexpr):
    """One read of a row's P tagged (max, sum of exp) pairs: (row max, sum of exp(z - max)); the sum
    is +inf while some pair does not carry ``tag`` yet (a real one is at most the row length), so
    the freshness check costs no reduction of its own. FIRST: a plain L2 read (.cg), else volatile
    (a re-poll the compiler must not hoist)."""
    k = tl.arange(0, PB)
    km = k < P
    base = row_slots + 2 * k
    wm = tagged_load(base, km, FIRST)
    ws = tagged_load(base + 1, km, FIRST)
    fresh = ((wm >> 32) == tag) & ((ws >> 32) == tag)
    m = tl.where(km & fresh, untagged(wm), -float("inf"))
    M = tl.max(m, axis=0)
    part = tl.where(m > -float("inf"), untagged(ws) * tl.exp(m - M), 0.0)
    return M, tl.sum(tl.where(fresh | (k >= P), part, float("inf")), axis=0)


@triton.jit
def _tagged_row_stats(row_slots, P, tag, spin_cap, PB: tl.constexpr):
    """Wait (at most ``spin_cap`` reads) until all P programs of a row published their pair at
    ``row_slots`` with ``tag``; returns (row max, sum of exp(z - max), gave up)."""
    M, Z = _tagged_row_poll(row_slots, P, tag, PB, True)
    polls = 1
    while (Z == float("inf")) & (polls < spin_cap):
        M, Z = _tagged_row_poll(row_slots, P, tag, PB, False)
        polls += 1
    return M, Z, Z == float("inf")


# B, P, R, spin_cap: no divisibility / == 1 specialisation (it would compile a variant per batch
# size and buys nothing); the strides and V keep theirs (vectorised loads and masks)
@triton.jit(do_not_specialize=["B", "P", "R", "spin_cap"])
def _softmax_waves_kernel(x_ptr, out_ptr, stride_x, stride_out, B, V, P, R, m_ptr, s_ptr, bar_ptr, row_bar_ptr,
                          inv_t, spin_cap, slot_ptr,
                          LOG: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr, PREFETCH: tl.constexpr,
                          FALLBACK_BLOCK: tl.constexpr, LD_POLL: tl.constexpr = False, PDL: tl.constexpr = False,
                          LANES: tl.constexpr = 32, ESIZE: tl.constexpr = 4, HINTED: tl.constexpr = False):
    """Softmax of MANY rows split over P programs each, in ONE persistent launch that reads x once.

    The grid is R * P programs, all resident at once (``wave_plan``: at most SM count x programs per
    SM, with a register cap that lets that many fit). Program (r, c) = (pid // P, pid % P) owns chunk
    c of rows r, r + R, r + 2R, ... (wave i: rows i*R .. i*R + R - 1). Per row it loads its chunk,
    publishes (max, sum of exp) for the row, waits for its P siblings (all resident: no deadlock),
    combines the P partials and writes the normalised chunk from registers. The x row is read from
    HBM once: 4 bytes in + 4 out per fp32 element, so [256, 128256] fp32 is 263 MB, a 63 us floor at
    4.15 TB/s; 80% of the measured copy bandwidth is 79.1 us.

    Softmax (not LOG) keeps exp(z - m) of its chunk from the statistics pass, so the output is one
    multiply per element, not an exp and a divide: at 8192,8,2,2, 91.8 -> 84.0 us (the work sits
    between the barrier and the stores of every wave; softmax_barrier_probe.json and raw/).

    HINTED (the default): the partials are int64 words, a 31-bit tag (the row barrier's generation
    + 1, ``generation_tag``: never 0) above the float's bits, stored relaxed in ``slot_ptr[row, 2c]``
    / ``[row, 2c + 1]`` (a layout independent of P); a 64-bit aligned store or load is single-copy
    atomic, so a word that carries this launch's tag holds this launch's value. The row counter is
    then only a hint of when to look: arrival is a relaxed ``atomic_add``, and after the counter
    completes the program reads the row's 2P words once (re-reading any whose tag is older). The
    acq_rel arrival it replaces made every program wait, once per row, until its earlier stores were
    performed, the previous row's chunk of output among them. A word's tag only grows (each launch
    adds one generation to every row it touches; after 2^31 - 1 launches it wraps to 1, skipping the
    zeroed slots' 0), and the slots are replaced whenever the workspace is (``_tagged_slots``), so a
    stale word never carries the tag a launch looks for (after a wrap: unless it was last written
    exactly 2^31 - 1 launches before). H200 [256, 128256] fp32, same runs
    (bench/results/h200/softmax_barrier_probe.json at the default shape, raw/ at 8192,8,2,2):
        16384,16,1,2   acq_rel counter 91.5-92.0 us   hinted 79.0-79.6 us (79.4-80.0% of copy)
        8192,8,2,2     acq_rel counter 83.6-84.4 us   hinted 80.5-81.4 us
    Polling the tagged words without the counter was slower (91-116 us: every program re-reading
    2P words), as was waiting for the counter's target derived from the generation instead of the
    atomic's return (84.4 vs 79.6 us, the polls then start while the arrivals are still landing).
    HINTED off: the partials are floats published by stores, CTA barrier, acq_rel arrival; acquire
    polls, CTA barrier, ".cg" reads (the memory order of the grid barrier); kept for A/B.

    Shapes (``wave_sweep``, CHUNK,WARPS,PER_SM,PREFETCH -> programs = R x P; hinted, exp once;
    sampling_waves_hinted_sweep*.json): 16384,16,1,2 (128 = 16 x 8, the default) 78.7-78.9 us;
    8192,8,2,2 (256 = 16 x 16) 80.4-81.0; 16384,16,1,1 / 1,3 81.1 / 81.3; 4096,4,4,2 85.7; more
    programs per SM spill (8192,8,3,2 109 us). Before the two changes 8192,8,2,2 was the best at
    92.1-93.6 us and 16384,16,1,x the worst (114 us): its 64 exps and divides per thread were on
    the critical path. Two launches (x read twice) 107.6 us, torch.softmax 135-136 us.
    Also measured, no better: ``_softmax_lagged_kernel`` (the barrier LAG rows behind: 100.8 us
    at best, old kernel), longer shares of a row per program (sampling_waves_segments_sweep.json);
    Triton's pipeliner gives a plain-load row loop no cp.async on sm_90 (triton 3.6).

    Row counter: ``row_bar_ptr[row]``, generation based like the grid barrier of
    ``_softmax_one_launch_kernel``: chunk 0 adds BARRIER_GEN - (P - 1), the others 1, so each launch
    adds exactly BARRIER_GEN per row and the counter is a multiple of it between launches; arrival v
    -> complete at (v // BARRIER_GEN + 1) * BARRIER_GEN. One counter per row (not per wave slot):
    a program that gave up on one row cannot confuse its siblings' counts on the next rows. A
    program reads its next row's generation one iteration ahead: it has not arrived there, so that
    row cannot be complete and the value // BARRIER_GEN is the generation of this launch.
    PREFETCH: the next row's chunk is loaded (raw, converted only in the next iteration so no
    instruction waits on it) right after the arrival, so the HBM read overlaps the wait.
    PREFETCH >= 2 also has one lane bulk-prefetch (``cp.async.bulk.prefetch.L2``) the chunk PREFETCH
    rows ahead into L2: more bytes in flight per SM than registers allow, and the register load of
    that row later hits L2. The register loads are ``evict_first`` (each chunk is read once; 92.6 ->
    91.5 us with the old kernel, bench/results/h200/softmax_evict_probe.json).
    A program that polls ``spin_cap`` times without seeing its siblings recomputes the row's max and
    sum from the whole row (exact, slow) and counts it in ``bar_ptr[1]``; the next row's counter is
    its own, unaffected.
    """
    pdl_start(PDL)
    pid = tl.program_id(0)
    r = pid // P
    c = pid % P
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    n_rows = (B - r + R - 1) // R          # host guarantees R <= B, so r < B and n_rows >= 1
    row = r.to(tl.int64)
    xr = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf"))
    for d in tl.static_range(2, PREFETCH):  # the L2 prefetch's first rows
        _chunk_to_l2(x_ptr, m_ptr, row + d * R, B, V, stride_x, c, CHUNK, LANES, ESIZE)
    if HINTED:  # the row's generation before this program arrives (it cannot be complete yet)
        gen = tl.load(row_bar_ptr + row, cache_modifier=".cg") // BARRIER_GEN
    for i in range(0, n_rows):
        row = (r + i * R).to(tl.int64)
        z = xr.to(tl.float32) * inv_t
        if LOG:
            m, s = _chunk_max_sum(z)
        else:  # keep exp(z - m): the output is then one multiply per element, not an exp and a divide
            m = tl.max(z, axis=0)
            z = tl.exp(z - tl.where(m == -float("inf"), 0.0, m))  # -inf entries -> 0 without a select
            s = tl.sum(z, axis=0)
        add = _arrival(c == 0, P)
        if HINTED:  # tagged partials, relaxed: nothing waits for this program's earlier stores to drain
            tag = generation_tag(gen)
            tl.store(slot_ptr + row * ROW_SLOT_WORDS + 2 * c, tagged(m, tag))
            tl.store(slot_ptr + row * ROW_SLOT_WORDS + 2 * c + 1, tagged(s, tag))
            v = tl.atomic_add(row_bar_ptr + row, add, sem="relaxed", scope="gpu")  # when to look: a hint
        else:
            tl.store(m_ptr + row * P + c, m)
            tl.store(s_ptr + row * P + c, s)
            tl.debug_barrier()  # every thread's stores precede the release below
            v = tl.atomic_add(row_bar_ptr + row, add, sem="acq_rel", scope="gpu")
        nxt = row + R
        # past the last row: an all-false mask (written as a comparison: the interpreter mis-types
        # block_mask & scalar_bool)
        nxt_mask = cols < tl.where(nxt < B, V, 0)
        if PREFETCH:  # read once: evict_first leaves L2 to the rows prefetched ahead (91.5 vs 92.6 us)
            xr = tl.load(x_ptr + nxt * stride_x + cols, mask=nxt_mask, other=-float("inf"),
                         eviction_policy="evict_first")
        if PREFETCH >= 2:  # and the chunk PREFETCH rows ahead into L2 (one bulk prefetch, no registers)
            _chunk_to_l2(x_ptr, m_ptr, row + PREFETCH * R, B, V, stride_x, c, CHUNK, LANES, ESIZE)
        if HINTED:  # the next row's generation, read now (used next iteration)
            gen_next = tl.load(row_bar_ptr + tl.minimum(nxt, B - 1), cache_modifier=".cg") // BARRIER_GEN
        gave_up = _barrier_wait(row_bar_ptr + row, v, add, spin_cap, LD_POLL)
        if HINTED:
            M, Z, stale = _tagged_row_stats(slot_ptr + row * ROW_SLOT_WORDS, P, tag, spin_cap, PB)
            gave_up = gave_up | stale
            gen = gen_next
        else:
            tl.debug_barrier()
            M, Z = _row_max_sum(m_ptr, s_ptr, row, P, PB)
        if gave_up:  # the whole row from HBM (slow, exact, counted)
            M, Z = _row_max_sum_exact(x_ptr + row * stride_x, V, inv_t, FALLBACK_BLOCK)
            tl.atomic_add(bar_ptr + 1, 1)
        if LOG:
            y = _normalised(z, M, Z, LOG)
        else:
            y = z * (tl.exp(m - M) / Z)
        tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
        if not PREFETCH:
            xr = tl.load(x_ptr + nxt * stride_x + cols, mask=nxt_mask, other=-float("inf"),
                         eviction_policy="evict_first")


@triton.jit(do_not_specialize=["B", "P", "R", "spin_cap"])
def _softmax_lagged_kernel(x_ptr, out_ptr, stride_x, stride_out, B, V, P, R, m_ptr, s_ptr, bar_ptr, row_bar_ptr,
                           inv_t, spin_cap,
                           LOG: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr, LAG: tl.constexpr,
                           FALLBACK_BLOCK: tl.constexpr, LD_POLL: tl.constexpr = False, PDL: tl.constexpr = False):
    """``_softmax_waves_kernel`` with the row barrier LAG rows behind: no program waits for a row
    its siblings published moments ago.

    Same grid, rows and barriers. Iteration i: phase A reads row i's chunk from HBM (``evict_last``:
    it stays in L2), publishes its (max, sum of exp) and arrives at row i's barrier without waiting;
    phase B finishes row i - LAG: waits at its barrier (its siblings arrived LAG iterations ago, so
    normally it is complete), combines, re-reads the chunk (from L2) and writes the normalised chunk.
    HBM traffic stays one read and one write per element; the barrier round trip leaves the critical
    path. L2 holds the LAG rows in flight: R * LAG * V * 4 bytes (16 x 2 x 513 KB = 16 MB at
    [256, 128256] fp32 with 8192-element chunks, of a 60 MB L2).
    Order without deadlock: every program finishes phase A of iteration i before it waits in phase
    B of iteration i, for rows <= i - LAG whose arrivals need only earlier phases A.
    Measured SLOWER than the waves kernel, so opt-in only (``EMBER_SOFTMAX_WAVES=...,0,LAG``): H200
    [256, 128256] fp32 (bench/results/h200/sampling_waves_lag_sweep.json) 8192,8,2,0,1 100.8 us and
    8192,8,2,0,2 108.8 us against 95.4 us for the default 8192,8,2,1 and 117.9 us for 8192,8,2,0
    (no prefetch, barrier right behind). So the barrier round trip is not what holds the default at
    66% of copy bandwidth; one row load in flight per program (phase A waits for its own load) is
    the likelier limit, and the default's prefetch keeps two.
    The arrival values of the last two rows are carried (prev1, prev2): LAG is 1 or 2.
    """
    pdl_start(PDL)
    pid = tl.program_id(0)
    r = pid // P
    c = pid % P
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    n_rows = (B - r + R - 1) // R          # host guarantees R <= B, so r < B and n_rows >= 1
    add = _arrival(c == 0, P)
    prev1 = add * 0  # arrival value at row i - 1's barrier
    prev2 = add * 0  # ... at row i - 2's
    for i in range(0, n_rows + LAG):
        # phase A: row i (masked off past the last row)
        live_a = i < n_rows
        row_a = (r + tl.minimum(i, n_rows - 1) * R).to(tl.int64)
        mask_a = cols < tl.where(live_a, V, 0)
        z = tl.load(x_ptr + row_a * stride_x + cols, mask=mask_a, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32) * inv_t
        m, s = _chunk_max_sum(z)
        if live_a:
            tl.store(m_ptr + row_a * P + c, m)
            tl.store(s_ptr + row_a * P + c, s)
        tl.debug_barrier()  # every thread's stores precede the release below
        v = tl.atomic_add(row_bar_ptr + row_a, add, mask=live_a, sem="acq_rel", scope="gpu")
        # phase B: row i - LAG
        j = i - LAG
        live_b = j >= 0
        row_b = (r + tl.maximum(j, 0) * R).to(tl.int64)
        if LAG == 1:
            vb = prev1
        else:
            vb = prev2
        if live_b:
            gave_up = _barrier_wait(row_bar_ptr + row_b, vb, add, spin_cap, LD_POLL)
            tl.debug_barrier()
            M, Z = _row_max_sum(m_ptr, s_ptr, row_b, P, PB)
            if gave_up:  # the whole row from HBM (slow, exact, counted)
                M, Z = _row_max_sum_exact(x_ptr + row_b * stride_x, V, inv_t, FALLBACK_BLOCK)
                tl.atomic_add(bar_ptr + 1, 1)
            zb = tl.load(x_ptr + row_b * stride_x + cols, mask=mask, other=-float("inf"),
                         eviction_policy="evict_first").to(tl.float32) * inv_t
            tl.store(out_ptr + row_b * stride_out + cols, _normalised(zb, M, Z, LOG), mask=mask)
        prev2 = prev1
        prev1 = v


# ----------------------------------------------------------------------------- split rows, launch 1
# Scalar args listed in do_not_specialize stay tensors even when an int equals 1 (Triton would
# otherwise turn it into a constexpr with no .to()).
@triton.jit(do_not_specialize=["t_scalar", "offset_scalar"])
def _chunk_stats_kernel(x_ptr, stride_x, V, P, m_ptr, s_ptr, a_ptr,
                        t_ptr, t_scalar,
                        cnt_ptr, best_ptr, offset_ptr, offset_scalar, off_out_ptr,
                        T_PER_ROW: tl.constexpr, SAMPLE: tl.constexpr, OFFSET_TENSOR: tl.constexpr,
                        CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Per (row, chunk): max of z = x / T, sum of exp(z - max), first index of the max.

    T == 0 (greedy sampling rows) uses z = x. With SAMPLE, chunk 0 of each row also zeroes the
    row's counters for launch 2, and program (0, 0) reads the RNG offset and advances the tensor.
    """
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = _row_param(t_ptr, t_scalar, row, tl.float32, T_PER_ROW)
    t = tl.where(t == 0.0, 1.0, t)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32) / t
    m, s = _chunk_max_sum(z)
    a = c * CHUNK + tl.argmax(z, axis=0)
    tl.store(m_ptr + row * P + c, m)
    tl.store(s_ptr + row * P + c, s)
    tl.store(a_ptr + row * P + c, a)
    if SAMPLE:
        if c == 0:
            # counters for launch 2: done programs, candidate count, best packed race key
            tl.store(cnt_ptr + row * 2, 0)
            tl.store(cnt_ptr + row * 2 + 1, 0)
            tl.store(best_ptr + row, row * 0 + INT64_MIN)
            if row == 0:
                if OFFSET_TENSOR:
                    off = tl.load(offset_ptr)
                    tl.store(offset_ptr, off + 1)
                else:
                    off = tl.cast(offset_scalar, tl.int64)
                tl.store(off_out_ptr, off)


# ----------------------------------------------------------------------------- split rows, launch 2
@triton.jit
def _softmax_finish_kernel(x_ptr, out_ptr, stride_x, stride_out, V, P, m_ptr, s_ptr, a_ptr, inv_t, n_rows,
                           LOG: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr, PDL: tl.constexpr = False):
    # Rows in reverse order of launch 1: the rows it read last are still in L2.
    pdl_start(PDL)
    row = (n_rows - 1 - tl.program_id(0)).to(tl.int64)
    c = tl.program_id(1)
    M, Z = _row_max_sum(m_ptr, s_ptr, row, P, PB)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
    tl.store(out_ptr + row * stride_out + cols, _normalised(z, M, Z, LOG), mask=mask)


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
        key = tl.where(keep, _race_key(z, cols, seed, row, off), -float("inf"))
        better = key > best_key
        best_key = tl.where(better, key, best_key)
        best_idx = tl.where(better, cols, best_idx)
    w = tl.argmax(best_key, axis=0)
    return tl.sum(tl.where(tl.arange(0, BLOCK) == w, best_idx, 0), axis=0)


@triton.jit
def _row_sampling_params(t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar, seed_ptr, seed_scalar,
                         row, V, T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr,
                         MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr):
    """(temperature, top_k (0 when >= V), top_p, min_p, seed) of ``row``."""
    t = _row_param(t_ptr, t_scalar, row, tl.float32, T_PER_ROW)
    k = _row_param(k_ptr, k_scalar, row, tl.int32, K_PER_ROW)
    p = _row_param(p_ptr, p_scalar, row, tl.float32, P_PER_ROW)
    minp = _row_param(mp_ptr, mp_scalar, row, tl.float32, MP_PER_ROW)
    if SEED_MODE == 0:
        seed = tl.cast(seed_scalar, tl.int64)
    elif SEED_MODE == 1:
        seed = tl.load(seed_ptr).to(tl.int64)
    else:
        seed = tl.load(seed_ptr + row).to(tl.int64)
    return t, tl.where(k >= V, 0, k), p, minp, seed


@triton.jit
def _chunk_race(z, cols, inb, M, minp, seed, row, off, c, CHUNK: tl.constexpr):
    """Min-p (or no) filter: this chunk's packed best race key (``_pack``)."""
    keep = inb & (tl.exp(z - M) >= minp) & (z > -float("inf"))
    key = tl.where(keep, _race_key(z, cols, seed, row, off), -float("inf"))
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
    key = tl.where(keep, _race_key(cz, ci, seed, row, off), -float("inf"))
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
            tl.store(out_ptr + row, tl.load(a_ptr + row * P + first_chunk).to(tl.int64))
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
                tl.store(out_ptr + row, _token(packed).to(tl.int64))
        else:
            L = _candidate_bound(chunk_max, k, p, P, V, PB, CAP, KC)
            _append_candidates(z, cols, inb, L, done_ptr + 1, cand_z_ptr, cand_i_ptr, row, CAP, False, "acq_rel")
            if tl.atomic_add(done_ptr, 1) == P - 1:
                n = tl.atomic_add(done_ptr + 1, 0)
                tok = _select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, Z, L, n, cand_z_ptr, cand_i_ptr,
                                       seed, off, CAP, FALLBACK_BLOCK, SMALL_SORT)
                tl.store(out_ptr + row, tok.to(tl.int64))


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
                 cnt_ptr, cand_z_ptr, cand_i_ptr, gave_up, SUB: tl.constexpr, QB: tl.constexpr,
                 CHUNK: tl.constexpr, CAP: tl.constexpr, KC: tl.constexpr, FALLBACK_BLOCK: tl.constexpr,
                 SMALL_SORT: tl.constexpr, RESERVE_SEM: tl.constexpr):
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
        tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit
def _race_tagged(cand_ptr, n, tag, row, k, p, minp, M, seed, off, spin_cap, BLOCK: tl.constexpr,
                 PACKED_MAX: tl.constexpr):
    """(packed winner, gave up) over the row's n <= BLOCK tagged candidate pairs (tag | z, tag | column);
    the winner is INT64_MIN if none survived (PACKED_MAX, ``_race_values``)."""
    wz, wi, stale = await_tagged(cand_ptr, n, tag, spin_cap, True, BLOCK)
    cz = tl.where(tl.arange(0, BLOCK) < n, untagged(wz), -float("inf"))
    # Z: unused for k > 0 (the mass is the candidates'); 1.0 keeps the expressions finite
    won, _ = _race_values(cz, (wi & 0xFFFFFFFF).to(tl.int32), row, k, p, minp, M, 1.0, 0.0, seed, off, BLOCK,
                          PACKED_MAX)
    return won, stale


@triton.jit
def _topk_tagged_row(row, c, z, cols, inb, off, tag, x_ptr, stride_x, V, P, n_programs, out_ptr, offset_ptr,
                     t, k, p, minp, seed, bar_ptr, cnt_ptr, slots, spin_cap,
                     OFFSET_TENSOR: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, QB: tl.constexpr,
                     CAP: tl.constexpr, KC: tl.constexpr, FALLBACK_BLOCK: tl.constexpr,
                     SMALL_SORT: tl.constexpr, LD_POLL: tl.constexpr, OFF_BY_FINISHER: tl.constexpr = False,
                     PACKED_RACE: tl.constexpr = False):
    """Program c's part of row ``row`` (chunk ``z``) when the host knows every row takes top-k (scalar
    t > 0, scalar 0 < k < V; grid case): ``_topk_sample``'s algorithm with no release drain and no
    reservation round trip. The piece maxima are tagged int64 words (``tagged``; the tag is the grid
    counter's generation + 1, read before this program arrives), stored relaxed; the arrival is
    relaxed, the counter only says when to read, and a reader re-reads any word with an older tag.
    A sender reserves its slots and arrives in one relaxed atomic on the row's counter (+ 1 << 32 +
    its count) and then stores its candidates as tagged pairs; the last sender knows the list's
    length from that atomic and re-reads the pairs until all carry the tag. Slots ``slots[row]``:
    [GRID_MAXIMA_WORDS] maxima, then [CAP] pairs (``_tagged_slots(ws, rows, "grid")``: tags only grow there).
    OFF_BY_FINISHER (one row, default): only the row's finisher uses the RNG offset (the senders store
    values, not keys), so it reads it with a plain load like every program and advances it itself
    after its race: one program reads and writes, no acquire and no cross-program order needed.
    PACKED_RACE (default): the finisher's winner by one packed max (``_race_values`` PACKED_MAX)."""
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
                won, late = _race_tagged(cand, n, tag, row, k, p, minp, M, seed, off, spin_cap, SMALL_SORT // 2,
                                         PACKED_RACE)
            elif n <= SMALL_SORT:
                won, late = _race_tagged(cand, n, tag, row, k, p, minp, M, seed, off, spin_cap, SMALL_SORT,
                                         PACKED_RACE)
            else:
                won, late = _race_tagged(cand, n, tag, row, k, p, minp, M, seed, off, spin_cap, CAP, PACKED_RACE)
            if late:  # pairs that never came (counted): exact
                tl.atomic_add(bar_ptr + 1, 1)
            exact = late | (won == INT64_MIN)   # (no survivor: cannot happen, but never a made-up token)
        if exact:
            tok = _fallback_select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, seed, off, FALLBACK_BLOCK)
        else:
            tok = _token(won)
        tl.store(cnt_ptr + row, 0)
        tl.store(out_ptr + row, tok.to(tl.int64))
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
                          cnt_ptr, out_ptr, PB)


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
                     seed, cnt_ptr, cand_z_ptr, cand_i_ptr, gave_up, SUB, QB, CHUNK, CAP, KC, FALLBACK_BLOCK,
                     SMALL_SORT, RESERVE_SEM)
    else:
        M, Z, first_chunk, chunk_max = _combine_stats(m_ptr, s_ptr, row, P, PB, ".cg")
        if gave_up:  # the whole row from HBM (slow, exact, counted above)
            M, Z, first_max, chunk_max = _row_stats_exact(xrow, V, t1, P, CHUNK, PB)
        else:
            first_max = tl.load(a_ptr + row * P + first_chunk, cache_modifier=".cg", mask=t == 0.0, other=0)
        if t == 0.0:  # greedy row: the first index of the max logit
            if c == 0:
                tl.store(out_ptr + row, first_max.to(tl.int64))
        elif (k == 0) & (p >= 1.0):
            _slot_then_best_token(_chunk_race(z, cols, inb, M, minp, seed, row, off, c, CHUNK), row, c, P, slot_ptr,
                                  cnt_ptr, out_ptr, PB)
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
                tl.store(out_ptr + row, tok.to(tl.int64))
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
                              TAGGED: tl.constexpr = False, slots=None, OFF_BY_FINISHER: tl.constexpr = False,
                              PACKED_RACE: tl.constexpr = False):
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
                         t, k, p, minp, seed, bar_ptr, cnt_ptr, slots, spin_cap, OFFSET_TENSOR, CHUNK, SUB, QB,
                         CAP, KC, FALLBACK_BLOCK, SMALL_SORT, LD_POLL, OFF_BY_FINISHER, PACKED_RACE)
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


# ----------------------------------------------------------------------------- launch helpers
def _split(V: int) -> tuple[int, int, int]:
    """(CHUNK, P, PB): chunks of >= MIN_CHUNK elements, at most 128 per row.

    ``EMBER_SAMPLING_MIN_CHUNK`` (a power of 2, 1024..16384) overrides MIN_CHUNK, for sweeps
    (``ember.bench.sampling.sweep``): fewer, longer chunks mean fewer atomics on a row's slot."""
    min_chunk = int(os.environ.get("EMBER_SAMPLING_MIN_CHUNK", MIN_CHUNK))
    if min_chunk & (min_chunk - 1) or not 1024 <= min_chunk <= ROW_BLOCK_MAX:
        raise ValueError(f"EMBER_SAMPLING_MIN_CHUNK: expected a power of 2 in [1024, {ROW_BLOCK_MAX}], got {min_chunk}")
    chunk = max(min_chunk, triton.next_power_of_2(triton.cdiv(V, MAX_PROGRAMS_PER_ROW)))
    P = triton.cdiv(V, chunk)
    return chunk, P, max(2, triton.next_power_of_2(P))


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _split_warps(chunk: int) -> int:
    """Warps of a split-row program that finishes in one launch: at least 4. H200, [1, 128256] fp32,
    one-launch softmax with PDL, chunk 1024: 3.16 us with 4 warps, 3.43 with 2, 3.45 with 8."""
    return max(4, _warps(chunk))


def _stats(x2, t_ptr, t_scalar, t_per_row, chunk, P, sample_state=None):
    B, V = x2.shape
    ws = torch.empty((3, B, P), dtype=torch.float32, device=x2.device)
    m, s, a = ws[0], ws[1], ws[2].view(torch.int32)
    if sample_state is None:
        cnt, best, off_t, off_s, off_out, has_off = m, m, m, 0, m, False
    else:
        cnt, best, off_t, off_s, off_out, has_off = sample_state
    _chunk_stats_kernel[(B, P)](x2, x2.stride(0), V, P, m, s, a, t_ptr, t_scalar, cnt, best, off_t, off_s, off_out,
                                T_PER_ROW=t_per_row, SAMPLE=sample_state is not None, OFFSET_TENSOR=has_off,
                                CHUNK=chunk, num_warps=_warps(chunk), **pdl_options(x2.device))
    return m, s, a


# ----------------------------------------------------------------------------- persistent workspace
# One int64 buffer per device: [grid barrier counter, barrier give-ups, count[cap] (0), row
# barrier[1 + NUCLEUS_ROUNDS, cap] (0): the waves' row barrier, then one per nucleus search round].
# Every launch that uses it leaves it in this state (the
# barrier counters: a multiple of BARRIER_GEN). Never freed: CUDA graphs captured earlier keep pointing at it, so an
# outgrown buffer is parked in _OUTGROWN rather than released.
_WORKSPACES: dict[tuple[str, int | None], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def _fresh_workspace(device: torch.device, cap: int) -> torch.Tensor:
    return torch.zeros(2 + (2 + NUCLEUS_ROUNDS) * cap, dtype=torch.int64, device=device)


def _workspace_cap(ws: torch.Tensor) -> int:
    return (ws.numel() - 2) // (2 + NUCLEUS_ROUNDS)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _warn_capture_temporary(what: str, rows: int) -> None:
    warnings.warn(f"{what} first needed (or needed larger) during CUDA-graph capture; using a per-graph "
                  "temporary with a captured fill (one extra node per replay). Call the op once outside "
                  f"capture with >= {rows} rows to avoid it.", stacklevel=5)


def _workspace_buffer(device: torch.device, rows: int) -> torch.Tensor:
    """The device's workspace with room for ``rows`` (see _workspace)."""
    key = (device.type, device.index)
    ws = _WORKSPACES.get(key)
    if ws is None or _workspace_cap(ws) < rows:
        cap = max(64, triton.next_power_of_2(rows))
        fresh = _fresh_workspace(device, cap)
        if _capturing(device):
            _warn_capture_temporary("ember sampling: workspace", rows)
            return fresh
        if ws is not None:
            _OUTGROWN.append(ws)
        ws = _WORKSPACES[key] = fresh
    return ws


def _workspace_views(ws: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cap = _workspace_cap(ws)
    return ws[:2], ws[2:2 + rows], ws[2 + cap:].view(1 + NUCLEUS_ROUNDS, cap)[:, :rows]


def _workspace(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grid barrier [2], arrival count [rows], row barriers [1 + NUCLEUS_ROUNDS, rows]) views of the
    device's workspace, in their initial state (row barriers: [0] the many-row softmax's, [1 + r] the
    nucleus search's round r).

    First needed (or needed larger) during CUDA-graph capture: the buffer is a temporary of that
    capture, initialised by a fill that is captured too (it reruns before the kernel on every replay,
    one extra node), and is not cached, because the eager state of memory allocated during capture is
    never initialised. Warm up once outside capture (as Triton's compile needs anyway) to avoid that.
    """
    return _workspace_views(_workspace_buffer(device, rows), rows)


# Tagged-word slots, per device and kind, zeroed when made and paired with the workspace whose
# counters give the tags: a new workspace (counters back at 0) gets new slots, so a stale word's tag
# is always older than the generation a launch looks for. "row": the many-row softmax's partials
# (``_softmax_waves_kernel`` HINTED), int64 [rows, ROW_SLOT_WORDS] (a layout that does not depend on
# P), tags from the row counters; "grid": the one-launch top-k sampler's piece maxima and candidate
# pairs (``_topk_tagged_row``), [rows, GRID_SLOT_WORDS], tags from the grid counter.
_SLOTS: dict[tuple[str, str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
_SLOT_WORDS = {"row": int(ROW_SLOT_WORDS), "grid": int(GRID_SLOT_WORDS)}


def _tagged_slots(ws: torch.Tensor, rows: int, kind: str) -> torch.Tensor:
    """Tagged-word slots of ``kind`` for ``rows`` rows that go with workspace ``ws`` (a capture temporary
    ``ws`` gets a temporary, zero-filled on every replay like it)."""
    device = ws.device
    key = (kind, device.type, device.index)
    owner, slots = _SLOTS.get(key, (None, None))
    if owner is ws and slots.shape[0] >= rows:
        return slots
    fresh = torch.zeros((max(64, triton.next_power_of_2(rows)), _SLOT_WORDS[kind]), dtype=torch.int64,
                        device=device)
    if _capturing(device):
        if _WORKSPACES.get((device.type, device.index)) is ws:  # (a temporary workspace has warned already)
            _warn_capture_temporary(f"ember sampling: {kind} slots", rows)
        return fresh
    if slots is not None:
        _OUTGROWN.append(slots)
    _SLOTS[key] = (ws, fresh)
    return fresh


def barrier_give_ups(device: torch.device) -> int:
    """How often a one-launch softmax program stopped waiting at the grid barrier (expected: 0).

    Each such program recomputed its row instead (exact, slower). Syncs with the device.
    """
    ws = _WORKSPACES.get((device.type, device.index))
    return 0 if ws is None else int(ws[1])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _one_launch_enabled(x2: torch.Tensor) -> bool:
    """One-launch (barrier) kernels need a real GPU: the interpreter runs programs one at a time, so a
    barrier would never fill. ``EMBER_SOFTMAX_ONE_LAUNCH=0`` turns them off (two launches, for A/B)."""
    if os.environ.get("EMBER_SOFTMAX_ONE_LAUNCH", "1") in ("0", "false", "False"):
        return False
    return x2.device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _device_sms(x2: torch.Tensor) -> int:
    return _sm_count(x2.device.index if x2.device.index is not None else torch.cuda.current_device())


def _one_launch_split(x2: torch.Tensor) -> tuple[int, int, int] | None:
    """(CHUNK, P, PB) for the few-row one-launch softmax, or None when it must not run.

    Needs every program resident at once: B * P <= SM count, one program per SM at most. Chunks grow
    from _split's up to ROW_BLOCK_MAX to fit more rows (P shrinks), e.g. 4 rows of 128256 -> 4 x 32.
    """
    if not _one_launch_enabled(x2):
        return None
    B, V = x2.shape
    return fit_split(B, V, _device_sms(x2))


def fit_split(B: int, V: int, sms: int) -> tuple[int, int, int] | None:
    """_split's chunks, doubled (up to ROW_BLOCK_MAX) until B * P <= sms; None if they never fit."""
    chunk, P, _ = _split(V)
    while B * P > sms and chunk < ROW_BLOCK_MAX:
        chunk *= 2
        P = triton.cdiv(V, chunk)
    if B * P > sms:
        return None
    return chunk, P, max(2, triton.next_power_of_2(P))


def softmax_one_launch(x2: torch.Tensor, out: torch.Tensor, temperature: float, log: bool,
                       chunk: int, P: int, spin_cap: int = SPIN_CAP) -> None:
    """The grid-barrier launch; the caller guarantees co-residency (_one_launch_split)."""
    B, V = x2.shape
    part = torch.empty((2, B, P), dtype=torch.float32, device=x2.device)
    barrier, _, _ = _workspace(x2.device, 0)
    _softmax_one_launch_kernel[(B, P)](x2, out, x2.stride(0), out.stride(0), V, P, B * P, part[0], part[1],
                                       barrier, 1.0 / temperature, spin_cap,
                                       LOG=log, CHUNK=chunk, PB=max(2, triton.next_power_of_2(P)),
                                       LD_POLL=x2.device.type == "cuda", num_warps=_split_warps(chunk),
                                       **pdl_options(x2.device))


# ----------------------------------------------------------------------------- many long rows, one launch
class WaveConfig(NamedTuple):
    """Shape of the persistent many-row softmax (``_softmax_waves_kernel``).

    ``per_sm`` programs fit on one SM when their registers do (``max_registers`` is passed to ptxas as
    .maxnreg, so they do by construction; too low a cap spills, slower but still resident), their
    threads do (per_sm * warps * 32 <= 2048, checked by ``wave_config``) and their shared memory does
    (<= 16 KB each, sm_90 compile: a layout conversion for 16-bit input; an SM has 228 KB).
    """
    chunk: int     # elements per program (power of 2, held in registers)
    warps: int     # num_warps per program
    per_sm: int    # programs resident per SM (the register cap below makes them fit)
    prefetch: int  # 1: load the next row's chunk before waiting at the row barrier; d >= 2: that,
                   # and a bulk prefetch into L2 of the chunk d rows ahead (sm_90+, 16-byte aligned
                   # rows; else 1): H200 2 -> 3.5% faster, 3+ slower (sampling_waves_l2_sweep.json)
    lag: int = 0   # 1 or 2: ``_softmax_lagged_kernel``, the barrier this many rows behind (prefetch 0)

    def max_registers(self) -> int:
        """Per-thread register cap (ptxas .maxnreg) so ``per_sm`` programs fit in an SM's 64K registers."""
        return min(255, 65536 // (self.per_sm * self.warps * 32) // 8 * 8)


# Measured best (H200, ember.bench.sampling.wave_sweep, [256, 128256] fp32): 16384,16,1,2, one
# program of 16 warps per SM, 8 per row: 78.7-78.9 us = 80.2-80.4% of copy bandwidth against
# 80.4-81.0 us for 8192,8,2,2 (16 per row, two per SM; the best before the output became one
# multiply per element and the partials tagged words: 92.1-93.6 us then, and 16384,16,1,x the
# worst at 114 us, its 64 exps and divides per thread on the critical path), 81.1 / 81.3 us with
# prefetch 1 / 3, 90.7 with 4 (sampling_waves_hinted_sweep*.json). The chunk two rows ahead
# bulk-prefetched into L2 (prefetch 2) wins at every shape tried.
WAVES_DEFAULT = WaveConfig(16384, 16, 1, 2)


def wave_config() -> WaveConfig:
    """WAVES_DEFAULT, or ``EMBER_SOFTMAX_WAVES="CHUNK,WARPS,PER_SM,PREFETCH"`` (A/B sweeps)."""
    text = os.environ.get("EMBER_SOFTMAX_WAVES", "")
    if not text:
        return WAVES_DEFAULT
    try:
        values = [int(v) for v in text.split(",")]
        cfg = WaveConfig(*values) if len(values) in (4, 5) else None
    except (TypeError, ValueError):
        cfg = None
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    if (cfg is None or not pow2(cfg.chunk) or not 1024 <= cfg.chunk <= ROW_BLOCK_MAX or not pow2(cfg.warps)
            or cfg.warps > 32 or cfg.per_sm < 1 or cfg.per_sm * cfg.warps > 64 or not 0 <= cfg.prefetch <= 8
            or cfg.lag not in (0, 1, 2) or (cfg.lag and cfg.prefetch)):
        raise ValueError("EMBER_SOFTMAX_WAVES: expected 'CHUNK,WARPS,PER_SM,PREFETCH[,LAG]' with CHUNK a power of 2 "
                         f"in [1024, {ROW_BLOCK_MAX}], WARPS a power of 2 <= 32, PER_SM * WARPS <= 64 (2048 threads "
                         f"per SM), PREFETCH 0..8 (>= 2: also an L2 bulk prefetch that many rows ahead), LAG 0, 1 "
                         f"or 2 (LAG > 0 needs PREFETCH 0); got {text!r}")
    return cfg


def wave_plan(B: int, V: int, sms: int, cfg: WaveConfig) -> tuple[int, int, int] | None:
    """(P, PB, R) for the persistent many-row softmax: P programs per row, R rows per wave.

    At most ``sms * per_sm`` programs (all resident). The waves are balanced: R = ceil(B / waves) with
    as few waves as the slots allow, e.g. 256 rows of 128256 on 132 SMs x 1: P = 8, 16 waves of 16
    rows (128 programs). None when one row needs more programs than there are slots.
    """
    P = triton.cdiv(V, cfg.chunk)
    slots = sms * cfg.per_sm
    if P > slots or B < 1:
        return None
    waves = triton.cdiv(B, slots // P)
    R = triton.cdiv(B, waves)
    return P, max(2, triton.next_power_of_2(P)), R


def softmax_waves(x2: torch.Tensor, out: torch.Tensor, temperature: float, log: bool, cfg: WaveConfig,
                  P: int, R: int, spin_cap: int = SPIN_CAP, hinted: bool = True):
    """The persistent row-barrier launch: R * P programs; the caller guarantees co-residency (wave_plan).
    ``hinted``: ``_softmax_waves_kernel``'s HINTED (False: the acq_rel counter barrier, for A/B probes).

    Returns what Triton's launch returns (the compiled kernel on a GPU: its n_regs / n_spills for sweeps).
    """
    B, V = x2.shape
    part = torch.empty((2, B, P), dtype=torch.float32, device=x2.device)
    ws = _workspace_buffer(x2.device, B)
    barrier, _, row_barriers = _workspace_views(ws, B)
    row_barrier = row_barriers[0]
    slots = _tagged_slots(ws, B, "row") if hinted and not cfg.lag else barrier
    if cfg.lag:
        return _softmax_lagged_kernel[(R * P,)](x2, out, x2.stride(0), out.stride(0), B, V, P, R, part[0], part[1],
                                                barrier, row_barrier, 1.0 / temperature, spin_cap,
                                                LOG=log, CHUNK=cfg.chunk, PB=max(2, triton.next_power_of_2(P)),
                                                LAG=cfg.lag, FALLBACK_BLOCK=min(cfg.chunk, 2048),
                                                LD_POLL=x2.device.type == "cuda", num_warps=cfg.warps,
                                                maxnreg=cfg.max_registers(), **pdl_options(x2.device))
    return _softmax_waves_kernel[(R * P,)](x2, out, x2.stride(0), out.stride(0), B, V, P, R, part[0], part[1],
                                    barrier, row_barrier, 1.0 / temperature, spin_cap, slots,
                                    LOG=log, CHUNK=cfg.chunk, PB=max(2, triton.next_power_of_2(P)), HINTED=hinted,
                                    PREFETCH=cfg.prefetch if cfg.prefetch < 2 or _bulk_ok(x2) else 1,
                                    LANES=32 * cfg.warps, ESIZE=x2.element_size(), FALLBACK_BLOCK=min(cfg.chunk, 2048),
                                    LD_POLL=x2.device.type == "cuda", num_warps=cfg.warps,
                                    maxnreg=cfg.max_registers(), **pdl_options(x2.device))


def _bulk_ok(x2: torch.Tensor) -> bool:
    """Whether the L2 bulk prefetch (PREFETCH 2) can address x2's chunks: 16-byte aligned rows, sm_90+."""
    es = x2.element_size()
    return x2.data_ptr() % 16 == 0 and x2.stride(0) * es % 16 == 0 and hopper_or_newer(x2.device)


def softmax_path(B: int, V: int, sms: int, one_launch: bool, cfg: WaveConfig | None = None) -> tuple:
    """Which softmax kernel runs for B rows of V on ``sms`` SMs (pure: tested on CPU):

    ("row",) V <= ROW_BLOCK_MAX, one row per program; ("grid", CHUNK, P) few long rows, one launch
    with a grid barrier; ("waves", cfg, P, R) many long rows, one persistent launch with per-row
    barriers; ("two",) two launches (x read twice): when ``one_launch`` is off, or a row needs more
    programs than the GPU holds at once.
    """
    if V <= ROW_BLOCK_MAX:
        return ("row",)
    if one_launch:
        fit = fit_split(B, V, sms)
        if fit is not None:
            return ("grid", fit[0], fit[1])
        cfg = cfg or wave_config()
        plan = wave_plan(B, V, sms, cfg)
        if plan is not None:
            return ("waves", cfg, plan[0], plan[2])
    return ("two",)


def softmax(x2: torch.Tensor, out: torch.Tensor, temperature: float, log: bool) -> None:
    """Row softmax (or log-softmax) of ``x2 / temperature`` into fp32 ``out`` (both 2-d, unit last stride).

    The kernel is ``softmax_path``'s choice: the one-launch paths (grid barrier, or per-row barriers
    in waves) read x once; they need a real GPU and ``EMBER_SOFTMAX_ONE_LAUNCH`` not 0.
    """
    B, V = x2.shape
    enabled = V > ROW_BLOCK_MAX and _one_launch_enabled(x2)
    path = softmax_path(B, V, _device_sms(x2) if enabled else 0, enabled)
    if path[0] == "row":
        block = triton.next_power_of_2(V)
        _softmax_row_kernel[(B,)](x2, out, x2.stride(0), out.stride(0), V, 1.0 / temperature,
                                  LOG=log, BLOCK=block, num_warps=_warps(block), **pdl_options(x2.device))
    elif path[0] == "grid":
        softmax_one_launch(x2, out, temperature, log, path[1], path[2])
    elif path[0] == "waves":
        softmax_waves(x2, out, temperature, log, *path[1:])
    else:
        chunk, P, PB = _split(V)
        m, s, a = _stats(x2, x2, temperature, False, chunk, P)
        _softmax_finish_kernel[(B, P)](x2, out, x2.stride(0), out.stride(0), V, P, m, s, a, 1.0 / temperature, B,
                                       LOG=log, CHUNK=chunk, PB=PB, num_warps=_warps(chunk), **pdl_options(x2.device))


def argmax(x2: torch.Tensor, out: torch.Tensor) -> None:
    """First index of the row max into int64 ``out [rows]`` (NaN counts as the max, as in torch)."""
    B, V = x2.shape
    if V <= ROW_BLOCK_MAX:
        block = triton.next_power_of_2(V)
        _argmax_row_kernel[(B,)](x2, out, x2.stride(0), V, BLOCK=block, num_warps=_warps(block),
                                 **pdl_options(x2.device))
        return
    chunk, P, PB = _split(V)
    _, count, _ = _workspace(x2.device, B)
    part = torch.empty((B, P), dtype=torch.int64, device=x2.device)
    # H200 [1, 128256] fp32, chunk 1024, PDL on (bench/results/h200/sampling_latency_probe*.json):
    # 2.56 us with 4 warps; the previous kernel (atomic_max into one row slot) 3.81 us with 4 warps,
    # 4.25 with 2
    _argmax_split_kernel[(B, P)](x2, out, x2.stride(0), V, P, part, count, CHUNK=chunk, PB=PB,
                                 num_warps=_split_warps(chunk), **pdl_options(x2.device))


def _param(v, dtype_scalar):
    """(pointer-or-dummy, scalar, per_row) for a per-row tensor or a Python scalar."""
    if isinstance(v, torch.Tensor):
        return v, dtype_scalar(0), True
    return None, dtype_scalar(v), False


def _sampling_args(temperature, top_k, top_p, min_p, seed, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The sample kernels' (pointer-or-dummy, scalar) argument pairs for temperature, top_k, top_p,
    min_p and seed, and their PER_ROW / SEED_MODE constexprs."""
    params = [_param(v, kind) for v, kind in ((temperature, float), (top_k, int), (top_p, float), (min_p, float))]
    if isinstance(seed, torch.Tensor):
        seed_mode, seed_ptr, seed_s = (1 if seed.numel() == 1 else 2), seed.view(-1), 0
    else:
        seed_mode, seed_ptr, seed_s = 0, dummy, int(seed)
    args = tuple(v for ptr, scalar, per_row in params for v in (ptr if per_row else dummy, scalar)) + (seed_ptr, seed_s)
    flags = dict(zip(("T_PER_ROW", "K_PER_ROW", "P_PER_ROW", "MP_PER_ROW"), (per_row for _, _, per_row in params)))
    return args, dict(flags, SEED_MODE=seed_mode)


def small_sort() -> int:
    """Candidates sorted as a small block instead of CAP: SMALL_SORT, or ``EMBER_SAMPLING_SMALL_SORT``
    (a power of 2 in [16, CAP]; CAP: always the CAP sort; A/B)."""
    v = int(os.environ.get("EMBER_SAMPLING_SMALL_SORT", SMALL_SORT))
    if v & (v - 1) or not 16 <= v <= CAP:
        raise ValueError(f"EMBER_SAMPLING_SMALL_SORT: expected a power of 2 in [16, {CAP}], got {v}")
    return v


def _waves_pay(temperature, top_k, top_p, V: int) -> bool:
    """Whether rows beyond what one launch fits take the persistent waves (``EMBER_SAMPLE_WAVES=1|0``
    forces it): unless the scalar parameters rule out top-p alone (top_k >= V is off). H200, [32, 128256]
    (many_rows_sample_probe.json): top-p alone 175 vs 1761 us for the two launches (whose row's
    last program bisects a wide nucleus alone), but k50 + p0.9 59 vs 51 us and greedy 23 vs 14:
    per-row tensors (unknown to the host) take the waves, the cheaper miss."""
    env = os.environ.get("EMBER_SAMPLE_WAVES")
    if env is not None:
        return env != "0"
    scalar = lambda v: not isinstance(v, torch.Tensor)  # noqa: E731
    return not ((scalar(temperature) and temperature == 0.0) or (scalar(top_k) and 0 < top_k < V)
                or (scalar(top_p) and top_p >= 1.0))


def sample(x2: torch.Tensor, out: torch.Tensor, temperature, top_k, top_p, min_p, seed, offset) -> None:
    """One token per row into int64 ``out``; parameters are Python scalars or per-row tensors (validated).

    ``seed`` is an int or an int64 tensor of 1 or ``rows`` elements; ``offset`` an int, None, or a
    one-element int64 tensor that launch 1 advances by one.
    """
    B, V = x2.shape
    chunk, P, PB = _split(V)
    cap = min(CAP, max(16, triton.next_power_of_2(V)))  # a short row sorts only itself
    dev = x2.device
    if V > ROW_BLOCK_MAX and _one_launch_enabled(x2):
        fit = fit_split(B, V, _device_sms(x2))
        if fit is not None:
            sample_one_launch(x2, out, temperature, top_k, top_p, min_p, seed, offset, chunk=fit[0])
            return
        plan = wave_rows_plan(B, V, _device_sms(x2)) if _waves_pay(temperature, top_k, top_p, V) else None
        if plan is not None:
            sample_one_launch(x2, out, temperature, top_k, top_p, min_p, seed, offset, chunk=plan[0],
                              rows_per_wave=plan[1])
            return
    # launch 1 zeroes these for launch 2 (no memset launch): per row [done programs, candidates],
    # the best packed race key per row, and the RNG offset this call uses
    cnt = torch.empty((B, 2), dtype=torch.int32, device=dev)
    state = torch.empty(B + 1, dtype=torch.int64, device=dev)
    best, off_out = state[:B], state[B:]
    cand_z = torch.empty((B, cap), dtype=torch.float32, device=dev)
    cand_i = torch.empty((B, cap), dtype=torch.int32, device=dev)
    has_off = isinstance(offset, torch.Tensor)
    args, flags = _sampling_args(temperature, top_k, top_p, min_p, seed, state)
    m, s, a = _stats(x2, args[0], args[1], flags["T_PER_ROW"], chunk, P,
                     sample_state=(cnt, best, offset.view(-1) if has_off else state, 0 if has_off else int(offset or 0),
                                   off_out, has_off))
    _sample_kernel[(B, P)](
        x2, x2.stride(0), V, P, m, s, a, out, *args, off_out, cnt, best, cand_z, cand_i, **flags,
        CHUNK=chunk, PB=PB, CAP=cap, KC=TOPP_CANDIDATE_CHUNKS, FALLBACK_BLOCK=TWO_LAUNCH_FALLBACK_BLOCK,
        SMALL_SORT=min(small_sort(), cap), num_warps=_warps(chunk) * 2,
        **pdl_options(x2.device))


def wave_rows_plan(B: int, V: int, sms: int) -> tuple[int, int] | None:
    """(chunk, rows per wave) for sampling more rows than ``fit_split`` fits at once: the chunks of a
    WAVE_ROWS-row one-launch (fewer rows if V is too long for that), as many rows a wave as fit."""
    for rows in (WAVE_ROWS, 4, 2, 1):
        fit = fit_split(rows, V, sms)
        if fit is not None:
            return fit[0], min(B, sms // fit[1])
    return None


def sample_one_launch(x2: torch.Tensor, out: torch.Tensor, temperature, top_k, top_p, min_p, seed, offset,
                      spin_cap: int = SPIN_CAP, chunk: int | None = None, rows_per_wave: int | None = None) -> None:
    """``sample`` as one grid-barrier launch (``_sample_one_launch_kernel``); the caller guarantees that
    all B * P programs are resident at once (``sample`` takes it when ``fit_split`` finds chunks with
    B * P <= SM count on a GPU: one row of 128256 as 126 programs of 1024, 8 rows as 8 x 16 of 8192).

    ``chunk``: elements per program, a power-of-2 multiple of ``_split``'s (default: that one). Each
    program publishes the maxima of its chunk's pieces of ``_split``'s size, so the candidate bound
    (the k-th largest piece max) is the two launches' at any chunk and top-k keeps its candidate list
    for k up to 128 whatever the batch. Programs take 8 warps (``_sample_warps``: 4 at the base chunk
    when top-k may be on; 16 would cap the registers at 128, and the kernel uses 255 at 4); bigger
    chunks also take the nucleus search's per-pivot sums.

    ``rows_per_wave`` (G < B): a persistent launch of G x P programs (G * P <= SM count) that walks the
    rows in waves (``sample`` takes it past what ``fit_split`` fits, with ``wave_rows_plan``)."""
    B, V = x2.shape
    if rows_per_wave is not None and rows_per_wave < 1:
        raise ValueError(f"sample_one_launch: rows_per_wave must be >= 1, got {rows_per_wave}")
    G = B if rows_per_wave is None else min(rows_per_wave, B)
    base, _, _ = _split(V)
    chunk = base if chunk is None else chunk
    if chunk % base or (chunk // base) & (chunk // base - 1):
        raise ValueError(f"sample_one_launch: chunk {chunk} is not a power-of-2 multiple of {base}")
    sub = chunk // base
    P = triton.cdiv(V, chunk)
    PB = max(2, triton.next_power_of_2(P))
    cap = min(CAP, max(16, triton.next_power_of_2(V)))
    dev = x2.device
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
    args, flags = _sampling_args(temperature, top_k, top_p, min_p, seed, slots)
    topk_on = isinstance(top_k, torch.Tensor) or 0 < top_k < V
    free = _temperature_alone(temperature, top_k, top_p, min_p, V)
    tagged = G == B and _topk_tagged(temperature, top_k, V)
    grid_slots = _tagged_slots(ws, B, "grid") if tagged else None
    _sample_one_launch_kernel[(G, P)](
        x2, x2.stride(0), B, G, V, P, G * P, part[0], part[1], part[2].view(torch.int32), piece_max, slots, out,
        *args, offset.view(-1) if has_off else slots, 0 if has_off else int(offset or 0), pivots[0],
        pivots[1].view(torch.int32), round_barriers, round_barriers.stride(0), row_barriers[0], barrier, count,
        cand_z, cand_i, spin_cap, **flags, WAVES=G < B,
        OFFSET_TENSOR=has_off, CHUNK=chunk, PB=PB, SUB=sub, QB=max(2, triton.next_power_of_2(P * sub)), CAP=cap,
        KC=TOPP_CANDIDATE_CHUNKS, FALLBACK_BLOCK=FALLBACK_BLOCK,
        SMALL_SORT=min(small_sort(), cap), RESERVE_SEM=RESERVE_SEM, NB=NUCLEUS_PIVOTS, ROUNDS=NUCLEUS_ROUNDS,
        LD_POLL=dev.type == "cuda", FREE=free, TAGGED=tagged, slots=grid_slots,
        # H200 [1, 128256] k50 + p0.9, offset tensor, same run: 6.92 us (every program acquires the
        # offset) -> 6.79 (the finisher's) -> 6.54 (and the packed race); sample_tagged_probe_offset.json
        OFF_BY_FINISHER=tagged and B == 1 and os.environ.get("EMBER_SAMPLE_OFFSET_BY_FINISHER", "1") == "1",
        PACKED_RACE=tagged and os.environ.get("EMBER_SAMPLE_PACKED_RACE", "1") == "1",
        num_warps=_sample_warps(base, sub, topk_on), **pdl_options(dev))


def _topk_tagged(temperature, top_k, V: int) -> bool:
    """Whether every row of a one-launch (not waves) sample takes top-k, known from the scalars: t > 0
    and 0 < k < V (top-p and min-p may be anything, per-row too). Such a launch takes the tagged-word
    path (``_topk_tagged_row``); ``EMBER_SAMPLE_TAGGED=0`` keeps ``_topk_sample`` (A/B timing)."""
    if os.environ.get("EMBER_SAMPLE_TAGGED", "1") == "0":
        return False
    if isinstance(temperature, torch.Tensor) or isinstance(top_k, torch.Tensor):
        return False
    return temperature > 0.0 and 0 < top_k < V


def _temperature_alone(temperature, top_k, top_p, min_p, V: int) -> bool:
    """Whether every row samples by temperature alone (scalars: t > 0, top-k off (0 or >= V), top-p 1,
    min-p 0): the one-launch sampler then races without its barrier (``_free_race_row``).
    ``EMBER_SAMPLE_FREE_RACE=0`` keeps the barrier (A/B timing)."""
    if os.environ.get("EMBER_SAMPLE_FREE_RACE", "1") == "0":
        return False
    if any(isinstance(v, torch.Tensor) for v in (temperature, top_k, top_p, min_p)):
        return False
    return temperature > 0.0 and (top_k == 0 or top_k >= V) and top_p >= 1.0 and min_p == 0.0


def _sample_warps(base: int, sub: int, topk_on: bool) -> int:
    """Warps of a one-launch sampler program: 8, except 4 (2 x _warps) at _split's chunk when top-k
    may be on (``topk_on``: a per-row tensor, or a scalar 0 < k < V); ``EMBER_SAMPLE_WARPS`` (1, 2,
    4, 8 or 16) overrides it, for sweeps (bench/sample_warps_probe.py).
    H200 [1, 128256], the same tokens at every count: k 50 + p 0.9 7.73 us with 4 warps, 8.43 with 8;
    top-p alone 16.53 vs 14.90; temperature alone 6.63 vs 6.15 (2 warps 8.3 / 32.8 / 8.5 us, 1 warp
    slower still: raw/sample_warps_probe_4_2_8_1_2026-12-01.json); a second run with 16 warps
    (sample_warps_probe.json): 9.9 / 17.1 / 6.8 us, 4 and 8 as before. Top-k's path after the
    barrier is a chain of small sorts and loads that more warps only slow; the nucleus search and
    the plain race are throughput over the chunk."""
    env = os.environ.get("EMBER_SAMPLE_WARPS")
    if env is None:
        return _warps(base) * 2 if sub == 1 and topk_on else 8
    if env not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"EMBER_SAMPLE_WARPS: expected 1, 2, 4, 8 or 16, got {env!r}")
    return int(env)
