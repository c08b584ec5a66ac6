"""Triton kernels for softmax, log-softmax, argmax and sorting-free sampling.

Two shapes of work:
  * rows up to ``ROW_BLOCK_MAX`` elements: one row per program, the row held in registers (1 launch);
  * longer rows: split over ``P <= 128`` programs per row. Launch 1 (``_chunk_stats_kernel``) writes
    each chunk's max, sum of exp and first argmax; launch 2 combines the P statistics of its row and
    finishes (normalise, pick the argmax, or sample).

Sampling (``sample``; the semantics are ember/ops/sampling.py's float64 reference) is the same two
launches. Launch 2 draws with an exponential race (Gumbel-max): token ``argmax(z - log(-log u))``
over the surviving tokens, ``u`` from Philox keyed on (seed, token, row, offset), so no sort and no
cumulative sum over the row. The survivors are ``{z >= tau}`` for one threshold tau:
  * no top-k / top-p: tau comes from the row max alone (min-p), every program races its chunk and
    the winners meet in a packed int64 ``atomic_max``; the last program of the row writes the token;
  * top-k / top-p: a lower bound L on tau comes from the chunk maxima (the k-th largest chunk max is
    <= the k-th largest value). Each program appends its values >= L to a small candidate list; the
    last program of the row sorts those (<= CAP values, not the row), reads tau_k and tau_p off the
    sorted prefix sums, and races the candidates;
  * when the list overflows CAP or cannot decide top-p (a flat row whose nucleus reaches below L),
    the last program falls back to an exact bisection on the order-preserving integer key of z with
    passes over the row: slower, same distribution.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BLOCK_MAX = 16384     # one-row-per-program in registers up to here
MAX_PROGRAMS_PER_ROW = 128
CAP = 512                 # candidate list per row (top-k / top-p path)
TOPP_CANDIDATE_CHUNKS = 32  # top-p only: L = this-th largest chunk max
INT64_MIN = tl.constexpr(-9223372036854775807 - 1)  # triton 3.6 reads only tl.constexpr(...) globals


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _ordered_key(z):
    """int32 whose order is the float order of z (z + 0.0 folds -0.0 into +0.0)."""
    b = (z + 0.0).to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


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
def _row_param(ptr, scalar, row, dtype: tl.constexpr, PER_ROW: tl.constexpr):
    if PER_ROW:
        return tl.load(ptr + row).to(dtype)
    else:
        return tl.cast(scalar, dtype)  # tl.cast takes a Python number (interpreter) or a scalar tensor


@triton.jit
def _combine_stats(m_ptr, s_ptr, a_ptr, row, P, PB: tl.constexpr):
    """Row max, sum of exp(z - max), first argmax, and the chunk maxima (padded with -inf)."""
    c = tl.arange(0, PB)
    cm = c < P
    m = tl.load(m_ptr + row * P + c, mask=cm, other=-float("inf"))
    s = tl.load(s_ptr + row * P + c, mask=cm, other=0.0)
    M = tl.max(m, axis=0)
    Z = tl.sum(tl.where(m > -float("inf"), s * tl.exp(m - M), 0.0), axis=0)
    first = tl.argmax(m, axis=0)
    a = tl.load(a_ptr + row * P + first)
    return M, Z, a, m


# ----------------------------------------------------------------------------- one row per program
@triton.jit
def _softmax_row_kernel(x_ptr, out_ptr, stride_x, stride_out, V, inv_t,
                        LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < V
    z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
    M = tl.max(z, axis=0)
    e = tl.exp(z - M)
    Z = tl.sum(tl.where(mask, e, 0.0), axis=0)
    if LOG:
        y = z - M - tl.log(Z)
    else:
        y = e / Z
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


@triton.jit
def _argmax_row_kernel(x_ptr, out_ptr, stride_x, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    tl.store(out_ptr + row, tl.argmax(x, axis=0).to(tl.int64))


# ----------------------------------------------------------------------------- split rows, launch 1
# Scalar args listed in do_not_specialize stay tensors even when an int equals 1 (Triton would
# otherwise turn it into a constexpr with no .to()).
@triton.jit(do_not_specialize=["t_scalar", "offset_scalar"])
def _chunk_stats_kernel(x_ptr, stride_x, V, P, m_ptr, s_ptr, a_ptr,
                        t_ptr, t_scalar,
                        cnt_ptr, best_ptr, offset_ptr, offset_scalar, off_out_ptr,
                        T_PER_ROW: tl.constexpr, SAMPLE: tl.constexpr, OFFSET_TENSOR: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Per (row, chunk): max of z = x / T, sum of exp(z - max), first index of the max.

    T == 0 (greedy sampling rows) uses z = x. With SAMPLE, chunk 0 of each row also zeroes the
    row's counters for launch 2, and program (0, 0) reads the RNG offset and advances the tensor.
    """
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = _row_param(t_ptr, t_scalar, row, tl.float32, T_PER_ROW)
    t = tl.where(t == 0.0, 1.0, t)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32) / t
    m = tl.max(z, axis=0)
    e = tl.where(z > -float("inf"), tl.exp(z - m), 0.0)
    s = tl.sum(e, axis=0)
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
                           LOG: tl.constexpr, CHUNK: tl.constexpr, PB: tl.constexpr):
    # Rows in reverse order of launch 1: the rows it read last are still in L2.
    row = (n_rows - 1 - tl.program_id(0)).to(tl.int64)
    c = tl.program_id(1)
    M, Z, _, _ = _combine_stats(m_ptr, s_ptr, a_ptr, row, P, PB)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    z = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
    if LOG:
        y = z - M - tl.log(Z)
    else:
        y = tl.exp(z - M) / Z
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


@triton.jit
def _argmax_finish_kernel(out_ptr, P, m_ptr, s_ptr, a_ptr, PB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _, _, a, _ = _combine_stats(m_ptr, s_ptr, a_ptr, row, P, PB)
    tl.store(out_ptr + row, a.to(tl.int64))


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
    # top-p: the smallest key t_p with mass(key > t_p) < p * mass_k among the top-k survivors
    lo = tk
    hi = zero + 2147483647
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


@triton.jit(do_not_specialize=["t_scalar", "k_scalar", "p_scalar", "mp_scalar", "seed_scalar"])
def _sample_kernel(x_ptr, stride_x, V, P, m_ptr, s_ptr, a_ptr, out_ptr,
                   t_ptr, t_scalar, k_ptr, k_scalar, p_ptr, p_scalar, mp_ptr, mp_scalar,
                   seed_ptr, seed_scalar, off_ptr, cnt_ptr, best_ptr, cand_z_ptr, cand_i_ptr,
                   T_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr,
                   MP_PER_ROW: tl.constexpr, SEED_MODE: tl.constexpr,
                   CHUNK: tl.constexpr, PB: tl.constexpr, CAP: tl.constexpr, KC: tl.constexpr,
                   FALLBACK_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = _row_param(t_ptr, t_scalar, row, tl.float32, T_PER_ROW)
    M, Z, first_max, chunk_max = _combine_stats(m_ptr, s_ptr, a_ptr, row, P, PB)
    if t == 0.0:  # greedy row: the first index of the max logit
        if c == 0:
            tl.store(out_ptr + row, first_max.to(tl.int64))
    else:
        k = _row_param(k_ptr, k_scalar, row, tl.int32, K_PER_ROW)
        p = _row_param(p_ptr, p_scalar, row, tl.float32, P_PER_ROW)
        minp = _row_param(mp_ptr, mp_scalar, row, tl.float32, MP_PER_ROW)
        if SEED_MODE == 0:
            seed = tl.cast(seed_scalar, tl.int64)
        elif SEED_MODE == 1:
            seed = tl.load(seed_ptr).to(tl.int64)
        else:
            seed = tl.load(seed_ptr + row).to(tl.int64)
        off = tl.load(off_ptr)
        k = tl.where(k >= V, 0, k)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        inb = cols < V
        z = tl.load(x_ptr + row * stride_x + cols, mask=inb, other=-float("inf")).to(tl.float32) / t
        done_ptr = cnt_ptr + row * 2
        if (k == 0) & (p >= 1.0):
            # only min-p (or nothing): the threshold is known from the row max; race this chunk
            keep = inb & (tl.exp(z - M) >= minp) & (z > -float("inf"))
            key = tl.where(keep, _race_key(z, cols, seed, row, off), -float("inf"))
            j = tl.argmax(key, axis=0)
            tl.atomic_max(best_ptr + row, _pack(tl.max(key, axis=0), c * CHUNK + j))
            if tl.atomic_add(done_ptr, 1) == P - 1:
                packed = tl.atomic_max(best_ptr + row, INT64_MIN)
                tl.store(out_ptr + row, 0x7FFFFFFF - (packed & 0xFFFFFFFF))
        else:
            # lower bound L on the final threshold from the chunk maxima (module docstring):
            # the k-th largest chunk max for top-k; the KC-th largest for top-p alone
            rank = tl.where(k > 0, tl.minimum(k, PB), tl.minimum(P, KC))
            L = _kth_largest(chunk_max, rank, PB)
            L = tl.where((k > 0) & (k > P), float("inf"), L)  # no cheap bound: fallback
            L = tl.where(V <= CAP, -float("inf"), L)           # short row: all of it
            is_cand = inb & (z >= L) & (z > -float("inf"))
            n_local = tl.sum(is_cand.to(tl.int32), axis=0)
            base = tl.atomic_add(done_ptr + 1, n_local)
            slot = base + tl.cumsum(is_cand.to(tl.int32), axis=0) - 1
            ok = is_cand & (slot < CAP)
            tl.store(cand_z_ptr + row * CAP + slot, z, mask=ok)
            tl.store(cand_i_ptr + row * CAP + slot, cols, mask=ok)
            if tl.atomic_add(done_ptr, 1) == P - 1:
                n = tl.atomic_add(done_ptr + 1, 0)
                i = tl.arange(0, CAP)
                cz = tl.load(cand_z_ptr + row * CAP + i, mask=i < n, other=-float("inf"), cache_modifier=".cg")
                ci = tl.load(cand_i_ptr + row * CAP + i, mask=i < n, other=0, cache_modifier=".cg")
                srt = tl.sort(cz, descending=True)
                e = tl.exp(srt - M)
                tau_k = tl.max(tl.where(i == k - 1, srt, -float("inf")), axis=0)   # -inf when k == 0
                ek = tl.where(srt >= tau_k, e, 0.0)
                mass_k = tl.where(k > 0, tl.sum(ek, axis=0), Z)
                # top-k: the candidates hold every value >= L <= tau_k. top-p alone: they hold all
                # the mass above L, so the nucleus is decided iff that mass reaches p
                complete = tl.where(k > 0, L < float("inf"), (tl.sum(e, axis=0) >= p * Z) | (V <= CAP))
                complete = complete & (n <= CAP)
                # mass strictly before each sorted position; the nucleus ends at the last one < p
                before = tl.cumsum(ek, axis=0) - ek
                in_p = (before < p * mass_k) & (srt >= tau_k)
                tau_p = tl.min(tl.where(in_p, srt, float("inf")), axis=0)
                tau = tl.where(p < 1.0, tau_p, tau_k)
                keep = (cz >= tau) & (tl.exp(cz - M) >= minp) & (cz > -float("inf"))
                key = tl.where(keep, _race_key(cz, ci, seed, row, off), -float("inf"))
                w = tl.argmax(key, axis=0)
                tok = tl.sum(tl.where(i == w, ci, 0), axis=0)
                if complete == 0:
                    tok = _fallback_select_and_race(x_ptr, stride_x, V, row, t, k, p, minp, M, seed, off,
                                                    FALLBACK_BLOCK)
                tl.store(out_ptr + row, tok.to(tl.int64))


# ----------------------------------------------------------------------------- launch helpers
def _split(V: int) -> tuple[int, int, int]:
    """(CHUNK, P, PB): chunks of >= 1024 elements, at most 128 per row."""
    chunk = max(1024, triton.next_power_of_2(triton.cdiv(V, MAX_PROGRAMS_PER_ROW)))
    P = triton.cdiv(V, chunk)
    return chunk, P, max(2, triton.next_power_of_2(P))


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


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
                                CHUNK=chunk, num_warps=_warps(chunk))
    return m, s, a


def softmax(x2: torch.Tensor, out: torch.Tensor, temperature: float, log: bool) -> None:
    """Row softmax (or log-softmax) of ``x2 / temperature`` into fp32 ``out`` (both 2-d, unit last stride)."""
    B, V = x2.shape
    if V <= ROW_BLOCK_MAX:
        block = triton.next_power_of_2(V)
        _softmax_row_kernel[(B,)](x2, out, x2.stride(0), out.stride(0), V, 1.0 / temperature,
                                  LOG=log, BLOCK=block, num_warps=_warps(block))
        return
    chunk, P, PB = _split(V)
    m, s, a = _stats(x2, x2, temperature, False, chunk, P)
    _softmax_finish_kernel[(B, P)](x2, out, x2.stride(0), out.stride(0), V, P, m, s, a, 1.0 / temperature, B,
                                   LOG=log, CHUNK=chunk, PB=PB, num_warps=_warps(chunk))


def argmax(x2: torch.Tensor, out: torch.Tensor) -> None:
    """First index of the row max into int64 ``out [rows]``."""
    B, V = x2.shape
    if V <= ROW_BLOCK_MAX:
        block = triton.next_power_of_2(V)
        _argmax_row_kernel[(B,)](x2, out, x2.stride(0), V, BLOCK=block, num_warps=_warps(block))
        return
    chunk, P, PB = _split(V)
    m, s, a = _stats(x2, x2, 1.0, False, chunk, P)
    _argmax_finish_kernel[(B,)](out, P, m, s, a, PB=PB, num_warps=1)


def _param(v, dtype_scalar):
    """(pointer-or-dummy, scalar, per_row) for a per-row tensor or a Python scalar."""
    if isinstance(v, torch.Tensor):
        return v, dtype_scalar(0), True
    return None, dtype_scalar(v), False


def sample(x2: torch.Tensor, out: torch.Tensor, temperature, top_k, top_p, min_p, seed, offset) -> None:
    """One token per row into int64 ``out``; parameters are Python scalars or per-row tensors (validated).

    ``seed`` is an int or an int64 tensor of 1 or ``rows`` elements; ``offset`` an int, None, or a
    one-element int64 tensor that launch 1 advances by one.
    """
    B, V = x2.shape
    chunk, P, PB = _split(V)
    cap = min(CAP, max(16, triton.next_power_of_2(V)))  # a short row sorts only itself
    dev = x2.device
    # launch 1 zeroes these for launch 2 (no memset launch): per row [done programs, candidates],
    # the best packed race key per row, and the RNG offset this call uses
    cnt = torch.empty((B, 2), dtype=torch.int32, device=dev)
    state = torch.empty(B + 1, dtype=torch.int64, device=dev)
    best, off_out = state[:B], state[B:]
    cand_z = torch.empty((B, cap), dtype=torch.float32, device=dev)
    cand_i = torch.empty((B, cap), dtype=torch.int32, device=dev)
    has_off = isinstance(offset, torch.Tensor)
    t_ptr, t_s, t_row = _param(temperature, float)
    k_ptr, k_s, k_row = _param(top_k, int)
    p_ptr, p_s, p_row = _param(top_p, float)
    mp_ptr, mp_s, mp_row = _param(min_p, float)
    dummy = state
    m, s, a = _stats(x2, t_ptr if t_row else dummy, t_s, t_row, chunk, P,
                     sample_state=(cnt, best, offset.view(-1) if has_off else dummy, 0 if has_off else int(offset or 0),
                                   off_out, has_off))
    if isinstance(seed, torch.Tensor):
        seed_mode, seed_ptr, seed_s = (1 if seed.numel() == 1 else 2), seed.view(-1), 0
    else:
        seed_mode, seed_ptr, seed_s = 0, dummy, int(seed)
    _sample_kernel[(B, P)](
        x2, x2.stride(0), V, P, m, s, a, out,
        t_ptr if t_row else dummy, t_s, k_ptr if k_row else dummy, k_s,
        p_ptr if p_row else dummy, p_s, mp_ptr if mp_row else dummy, mp_s,
        seed_ptr, seed_s, off_out, cnt, best, cand_z, cand_i,
        T_PER_ROW=t_row, K_PER_ROW=k_row, P_PER_ROW=p_row, MP_PER_ROW=mp_row, SEED_MODE=seed_mode,
        CHUNK=chunk, PB=PB, CAP=cap, KC=TOPP_CANDIDATE_CHUNKS, FALLBACK_BLOCK=1024, num_warps=_warps(chunk) * 2)
