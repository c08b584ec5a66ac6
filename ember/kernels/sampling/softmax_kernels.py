"""Softmax and log-softmax kernels: one row per program (rows up to ROW_BLOCK_MAX), few long rows in
one launch behind a grid barrier, many long rows in one persistent launch of per-row barriers
(waves), and the two-launch path (statistics, then normalise) where neither fits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import (bulk_prefetch_l2, generation_tag, hopper_or_newer, pdl_options, pdl_start,
                                   tagged, tagged_load, untagged)
from ember.kernels.sampling._grid import (BARRIER_GEN, ROW_BLOCK_MAX, ROW_SLOT_WORDS, SPIN_CAP, _arrival,
                                          _barrier_wait, _chunk_max_sum, _device_sms, _normalised,
                                          _one_launch_enabled, _row_max_sum, _row_max_sum_exact, _split_warps, _stats,
                                          _tagged_slots, _warps, _workspace, _workspace_buffer, _workspace_views)
from ember.kernels.sampling._plan import WaveConfig, fit_split, min_chunk, softmax_path, split, wave_config


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



# ----------------------------------------------------------------------------- split rows, one launch
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
def _softmax_waves_kernel(x_ptr, out_ptr, stride_x, stride_out, B, V, P, R, sink_ptr, bar_ptr, row_bar_ptr,
                          inv_t, spin_cap, slot_ptr,
                          LOG: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr, PREFETCH: tl.constexpr,
                          FALLBACK_BLOCK: tl.constexpr, LD_POLL: tl.constexpr = False, PDL: tl.constexpr = False,
                          LANES: tl.constexpr = 32, ESIZE: tl.constexpr = 4):
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

    The partials are int64 words, a 31-bit tag (the row barrier's generation
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

    Shapes (``wave_sweep``, CHUNK,WARPS,PER_SM,PREFETCH -> programs = R x P; hinted, exp once;
    sampling_waves_hinted_sweep*.json): 16384,16,1,2 (128 = 16 x 8, the default) 78.7-78.9 us;
    8192,8,2,2 (256 = 16 x 16) 80.4-81.0; 16384,16,1,1 / 1,3 81.1 / 81.3; 4096,4,4,2 85.7; more
    programs per SM spill (8192,8,3,2 109 us). Before the two changes 8192,8,2,2 was the best at
    92.1-93.6 us and 16384,16,1,x the worst (114 us): its 64 exps and divides per thread were on
    the critical path. Two launches (x read twice) 107.6 us, torch.softmax 135-136 us.
    Also measured, no better: the barrier one or two rows behind (100.8 us at best, old kernel),
    longer shares of a row per program (sampling_waves_segments_sweep.json); Triton's pipeliner
    gives a plain-load row loop no cp.async on sm_90 (triton 3.6).

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
        _chunk_to_l2(x_ptr, sink_ptr, row + d * R, B, V, stride_x, c, CHUNK, LANES, ESIZE)
    # the row's generation before this program arrives (it cannot be complete yet)
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
        # tagged partials, relaxed: nothing waits for this program's earlier stores to drain
        tag = generation_tag(gen)
        tl.store(slot_ptr + row * ROW_SLOT_WORDS + 2 * c, tagged(m, tag))
        tl.store(slot_ptr + row * ROW_SLOT_WORDS + 2 * c + 1, tagged(s, tag))
        v = tl.atomic_add(row_bar_ptr + row, add, sem="relaxed", scope="gpu")  # when to look: a hint
        nxt = row + R
        # past the last row: an all-false mask (written as a comparison: the interpreter mis-types
        # block_mask & scalar_bool)
        nxt_mask = cols < tl.where(nxt < B, V, 0)
        if PREFETCH:  # read once: evict_first leaves L2 to the rows prefetched ahead (91.5 vs 92.6 us)
            xr = tl.load(x_ptr + nxt * stride_x + cols, mask=nxt_mask, other=-float("inf"),
                         eviction_policy="evict_first")
        if PREFETCH >= 2:  # and the chunk PREFETCH rows ahead into L2 (one bulk prefetch, no registers)
            _chunk_to_l2(x_ptr, sink_ptr, row + PREFETCH * R, B, V, stride_x, c, CHUNK, LANES, ESIZE)
        # the next row's generation, read now (used next iteration)
        gen_next = tl.load(row_bar_ptr + tl.minimum(nxt, B - 1), cache_modifier=".cg") // BARRIER_GEN
        gave_up = _barrier_wait(row_bar_ptr + row, v, add, spin_cap, LD_POLL)
        M, Z, stale = _tagged_row_stats(slot_ptr + row * ROW_SLOT_WORDS, P, tag, spin_cap, PB)
        gave_up = gave_up | stale
        gen = gen_next
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



# ----------------------------------------------------------------------------- launch helpers
def _one_launch_split(x2: torch.Tensor) -> tuple[int, int, int] | None:
    """(CHUNK, P, PB) for the few-row one-launch softmax, or None when it must not run.

    Needs every program resident at once: B * P <= SM count, one program per SM at most. Chunks grow
    from ``split``'s up to ROW_BLOCK_MAX to fit more rows (P shrinks), e.g. 4 rows of 128256 -> 4 x 32.
    """
    if not _one_launch_enabled(x2):
        return None
    B, V = x2.shape
    return fit_split(B, V, _device_sms(x2), min_chunk(x2.device))


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


def softmax_waves(x2: torch.Tensor, out: torch.Tensor, temperature: float, log: bool, cfg: WaveConfig,
                  P: int, R: int, spin_cap: int = SPIN_CAP):
    """The persistent row-barrier launch: R * P programs; the caller guarantees co-residency (wave_plan).

    Returns what Triton's launch returns (the compiled kernel on a GPU: its n_regs / n_spills for sweeps).
    """
    B, V = x2.shape
    sink = torch.empty((B, P), dtype=torch.float32, device=x2.device)   # never written (the prefetch's asm)
    ws = _workspace_buffer(x2.device, B)
    barrier, _, row_barriers = _workspace_views(ws, B)
    row_barrier = row_barriers[0]
    slots = _tagged_slots(ws, B, "row")
    return _softmax_waves_kernel[(R * P,)](x2, out, x2.stride(0), out.stride(0), B, V, P, R, sink,
                                           barrier, row_barrier, 1.0 / temperature, spin_cap, slots,
                                           LOG=log, CHUNK=cfg.chunk, PB=max(2, triton.next_power_of_2(P)),
                                           PREFETCH=cfg.prefetch if cfg.prefetch < 2 or _bulk_ok(x2) else 1,
                                           LANES=32 * cfg.warps, ESIZE=x2.element_size(),
                                           FALLBACK_BLOCK=min(cfg.chunk, 2048), LD_POLL=x2.device.type == "cuda",
                                           num_warps=cfg.warps, maxnreg=cfg.max_registers(), **pdl_options(x2.device))


def _bulk_ok(x2: torch.Tensor) -> bool:
    """Whether the L2 bulk prefetch (PREFETCH 2) can address x2's chunks: 16-byte aligned rows, sm_90+."""
    es = x2.element_size()
    return x2.data_ptr() % 16 == 0 and x2.stride(0) * es % 16 == 0 and hopper_or_newer(x2.device)


def softmax(x2: torch.Tensor, out: torch.Tensor, temperature: float, log: bool) -> None:
    """Row softmax (or log-softmax) of ``x2 / temperature`` into fp32 ``out`` (both 2-d, unit last stride).

    The kernel is ``softmax_path``'s choice: the one-launch paths (grid barrier, or per-row barriers
    in waves) read x once; they need a real GPU.
    """
    B, V = x2.shape
    if V <= ROW_BLOCK_MAX:
        block = triton.next_power_of_2(V)
        _softmax_row_kernel[(B,)](x2, out, x2.stride(0), out.stride(0), V, 1.0 / temperature,
                                  LOG=log, BLOCK=block, num_warps=_warps(block), **pdl_options(x2.device))
        return
    if not _one_launch_enabled(x2):
        softmax_two_launch(x2, out, temperature, log)
        return
    path = softmax_path(B, V, _device_sms(x2), True, wave_config(x2.device), min_chunk(x2.device))
    if path[0] == "grid":
        softmax_one_launch(x2, out, temperature, log, path[1], path[2])
    elif path[0] == "waves":
        softmax_waves(x2, out, temperature, log, *path[1:])
    else:
        softmax_two_launch(x2, out, temperature, log)


def softmax_two_launch(x2: torch.Tensor, out: torch.Tensor, temperature: float, log: bool) -> None:
    """``softmax`` of rows longer than ROW_BLOCK_MAX in two launches (chunk statistics, then normalise;
    x read twice): where no one-launch kernel fits, and the one-launch kernels' reference on the GPU."""
    B, V = x2.shape
    chunk, P, PB = split(V, min_chunk(x2.device))
    m, s, a = _stats(x2, x2, temperature, False, chunk, P)
    _softmax_finish_kernel[(B, P)](x2, out, x2.stride(0), out.stride(0), V, P, m, s, a, 1.0 / temperature, B,
                                   LOG=log, CHUNK=chunk, PB=PB, num_warps=_warps(chunk), **pdl_options(x2.device))


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
