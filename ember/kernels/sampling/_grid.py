"""Shared pieces of the sampling kernels: constants, the jit helpers every kernel uses (order keys,
chunk statistics, packed race words, the generation-counter barrier), the split-row launch 1
(``_chunk_stats_kernel``), and the persistent per-device workspace and tagged-word slots that the
one-launch kernels leave in their initial state after every launch.
"""
from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start
from ember.ops.sampling import SEED_STEP as _SEED_STEP

ROW_BLOCK_MAX = 16384     # one-row-per-program in registers up to here
MAX_PROGRAMS_PER_ROW = 128
CAP = 512                 # candidate list per row (top-k / top-p path)
TOPP_CANDIDATE_CHUNKS = 32  # top-p only: L = this-th largest chunk max
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
SEED_STEP = tl.constexpr(_SEED_STEP)  # SEED_MODE 3 (advance_seed): what each row's finisher adds to its seed
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
def _race_key(z, idx, seed, off):
    """z + Gumbel noise from Philox(seed; token, 0, offset lo, offset hi); ``seed`` is the row's key
    (``_row_sampling_params`` mixes the row index into a batch-wide seed)."""
    c0 = idx.to(tl.uint32)
    c1 = tl.zeros_like(c0)
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


@triton.jit
def _store_token(out_ptr, row, tok, seed_ptr, SEED_MODE: tl.constexpr):
    """The row's token; with SEED_MODE 3 also the row's next seed (its seed + SEED_STEP). Only a row's
    finisher calls this: every program of the row that keys a race with the seed has read it before
    its arrival (acq_rel, or the tagged path, where the finisher alone keys the race), and a greedy
    row's programs do not use it. H100 [1, 128256]: the engine's separate seed.add_ launch cost
    +1.5 to +2.5 us a draw in a graph (sampling_engine_probe.json)."""
    tl.store(out_ptr + row, tok.to(tl.int64))
    if SEED_MODE == 3:
        tl.store(seed_ptr + row, tl.load(seed_ptr + row) + SEED_STEP)


@triton.jit
def _slot_then_best_token(packed, row, c, P, slot_ptr, cnt_ptr, out_ptr, PB: tl.constexpr, seed_ptr=None,
                          SEED_MODE: tl.constexpr = 0):
    """Publish this chunk's packed (key, token) (``_pack``) in its slot; the row's last program to
    arrive writes the largest slot's token (``_store_token``) and puts the row's counter back to 0
    (argmax, and the sampler's races)."""
    tl.store(slot_ptr + row * P + c, packed)
    tl.debug_barrier()  # the slot store precedes the release below
    if tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu") == P - 1:
        tl.debug_barrier()
        i = tl.arange(0, PB)
        best = tl.max(tl.load(slot_ptr + row * P + i, mask=i < P, other=INT64_MIN, cache_modifier=".cg"), axis=0)
        tl.store(cnt_ptr + row, 0)
        _store_token(out_ptr, row, _token(best), seed_ptr, SEED_MODE)



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
# (``_softmax_waves_kernel``), int64 [rows, ROW_SLOT_WORDS] (a layout that does not depend on
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
    """One-launch (barrier) kernels need a real GPU: the interpreter runs programs one at a time (and
    runs CPU tensors only), so a barrier would never fill there."""
    return x2.device.type == "cuda"


def _device_sms(x2: torch.Tensor) -> int:
    return _sm_count(x2.device.index if x2.device.index is not None else torch.cuda.current_device())


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
