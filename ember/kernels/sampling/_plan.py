"""Host-side choices of the sampling kernels: the tiles they read from ``ember.tuning`` (family
``sampling``; keys in the package docstring) and the pure plans built from them (how a row is split,
which softmax kernel runs, whether sampling takes the persistent waves, how many warps). The plans
take their tiles as arguments, so they are tested on CPU for any GPU's SM count.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ember import tuning
from ember.kernels.sampling._grid import CAP, MAX_PROGRAMS_PER_ROW, ROW_BLOCK_MAX, WAVE_ROWS, _warps

FAMILY = "sampling"

# The kernels' own rules (what a GPU without a tuning entry runs, and CPU). They are the values
# measured best on the H200 (its entries in ember/tuning/data/sm_90-nvidia-h200/sampling.json) and
# fit any sm_80+ GPU: nothing in them depends on more than the SM count, which the plans read.
MIN_CHUNK = 1024          # split rows: at least this many elements per program
SMALL_SORT = 128          # up to this many candidates: a sort of this block, not of CAP


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _bad_entry(key: str, entry, expected: str) -> ValueError:
    return ValueError(f"tuning entry {FAMILY}/{key}: expected {expected}, got {entry!r}")


# ----------------------------------------------------------------------------- tiles
def _pow2_entry(device, key: str, field: str, lo: int, hi: int, default: int) -> int:
    """``{field: n}`` of tuning entry ``key``, n a power of 2 in [lo, hi]; ``default`` without an entry."""
    entry = tuning.lookup(FAMILY, key, device)
    if entry is None:
        return default
    v = entry.get(field) if isinstance(entry, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or not _pow2(v) or not lo <= v <= hi:
        raise _bad_entry(key, entry, f'{{"{field}": a power of 2 in [{lo}, {hi}]}}')
    return v


def min_chunk(device) -> int:
    """Elements per program of a split row at least (key ``split``: ``{"min_chunk": n}``, a power of 2
    in [1024, ROW_BLOCK_MAX]). Fewer, longer chunks mean fewer atomics on a row's slot; the H200 is
    fastest at 1024 (bench/results/h200/sampling_chunk_sweep.json)."""
    return _pow2_entry(device, "split", "min_chunk", 1024, ROW_BLOCK_MAX, MIN_CHUNK)


def small_sort(device) -> int:
    """Candidates the sampler's finisher sorts as a small block instead of CAP (key ``small_sort``:
    ``{"block": n}``, a power of 2 in [16, CAP]; CAP always sorts CAP). H200 [1, 128256] k 50 + p 0.9:
    the last program's selection 2.0 us with 128, 3.8 with the 512 sort (sampling_stages_probe.json)."""
    return _pow2_entry(device, "small_sort", "block", 16, CAP, SMALL_SORT)


class WaveConfig(NamedTuple):
    """Shape of the persistent many-row softmax (``_softmax_waves_kernel``; key ``softmax_waves``:
    ``{"chunk", "warps", "per_sm", "prefetch"}``).

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

    def max_registers(self) -> int:
        """Per-thread register cap (ptxas .maxnreg) so ``per_sm`` programs fit in an SM's 64K registers."""
        return min(255, 65536 // (self.per_sm * self.warps * 32) // 8 * 8)


# The rule: one program of 16 warps per SM, 8 per row of 128256, the chunk two rows ahead
# bulk-prefetched into L2. H200 [256, 128256] fp32: 78.7-78.9 us = 80.2-80.4% of copy bandwidth, the
# best of the shapes timed (8192,8,2,2 80.4-81.0 us; prefetch 1 / 3 81.1 / 81.3;
# sampling_waves_hinted_sweep*.json).
WAVES_DEFAULT = WaveConfig(16384, 16, 1, 2)


def wave_config(device) -> WaveConfig:
    """The many-row softmax's shape on ``device``: its tuning entry, else WAVES_DEFAULT."""
    entry = tuning.lookup(FAMILY, "softmax_waves", device)
    if entry is None:
        return WAVES_DEFAULT
    try:
        cfg = WaveConfig(**entry)
    except TypeError:
        cfg = None
    if (cfg is None or not all(isinstance(v, int) for v in cfg) or not _pow2(cfg.chunk)
            or not 1024 <= cfg.chunk <= ROW_BLOCK_MAX or not _pow2(cfg.warps) or cfg.warps > 32 or cfg.per_sm < 1
            or cfg.per_sm * cfg.warps > 64 or not 0 <= cfg.prefetch <= 8):
        raise _bad_entry("softmax_waves", entry,
                         f'{{"chunk": a power of 2 in [1024, {ROW_BLOCK_MAX}], "warps": a power of 2 <= 32, '
                         '"per_sm": >= 1 with per_sm * warps <= 64 (2048 threads per SM), "prefetch": 0..8}')
    return cfg


def sample_warps(device, base: int, sub: int, topk_on: bool) -> int:
    """Warps of a one-launch sampler program (key ``sample_warps:<base chunk>``: ``{"topk": n,
    "other": n}``; "topk" at the base chunk (``sub == 1``) when top-k may be on: a per-row tensor, or
    a scalar 0 < k < V). The rule: 8, except 2 warps per 512 elements of the base chunk for top-k.
    H200 [1, 128256], same tokens at every count: k 50 + p 0.9 7.73 us with 4 warps, 8.43 with 8;
    top-p alone 16.53 vs 14.90; temperature alone 6.63 vs 6.15; 16 warps slower for all
    (sample_warps_probe.json). Top-k's path after the barrier is a chain of small sorts and loads
    that more warps only slow; the nucleus search and the plain race are throughput over the chunk."""
    key = f"sample_warps:{base}"
    entry = tuning.lookup(FAMILY, key, device)
    topk = sub == 1 and topk_on
    if entry is None:
        return _warps(base) * 2 if topk else 8
    ok = isinstance(entry, dict) and set(entry) == {"topk", "other"} and all(
        isinstance(v, int) and v in (1, 2, 4, 8, 16, 32) for v in entry.values())
    if not ok:
        raise _bad_entry(key, entry, '{"topk": warps, "other": warps} with warps 1, 2, 4, 8, 16 or 32')
    return entry["topk" if topk else "other"]


# ----------------------------------------------------------------------------- plans (pure)
def split(V: int, min_chunk: int = MIN_CHUNK) -> tuple[int, int, int]:
    """(CHUNK, P, PB): chunks of >= min_chunk elements, at most MAX_PROGRAMS_PER_ROW per row."""
    chunk = max(min_chunk, _pow2_ceil(_cdiv(V, MAX_PROGRAMS_PER_ROW)))
    P = _cdiv(V, chunk)
    return chunk, P, max(2, _pow2_ceil(P))


def fit_split(B: int, V: int, sms: int, min_chunk: int = MIN_CHUNK) -> tuple[int, int, int] | None:
    """``split``'s chunks, doubled (up to ROW_BLOCK_MAX) until B * P <= sms; None if they never fit."""
    chunk, P, _ = split(V, min_chunk)
    while B * P > sms and chunk < ROW_BLOCK_MAX:
        chunk *= 2
        P = _cdiv(V, chunk)
    if B * P > sms:
        return None
    return chunk, P, max(2, _pow2_ceil(P))


def wave_plan(B: int, V: int, sms: int, cfg: WaveConfig) -> tuple[int, int, int] | None:
    """(P, PB, R) for the persistent many-row softmax: P programs per row, R rows per wave.

    At most ``sms * per_sm`` programs (all resident). The waves are balanced: R = ceil(B / waves) with
    as few waves as the slots allow, e.g. 256 rows of 128256 on 132 SMs x 1 program of 16384: P = 8,
    16 waves of 16 rows (128 programs). None when one row needs more programs than there are slots.
    """
    P = _cdiv(V, cfg.chunk)
    slots = sms * cfg.per_sm
    if P > slots or B < 1:
        return None
    waves = _cdiv(B, slots // P)
    R = _cdiv(B, waves)
    return P, max(2, _pow2_ceil(P)), R


def softmax_path(B: int, V: int, sms: int, one_launch: bool, cfg: WaveConfig = WAVES_DEFAULT,
                 min_chunk: int = MIN_CHUNK) -> tuple:
    """Which softmax kernel runs for B rows of V on ``sms`` SMs:

    ("row",) V <= ROW_BLOCK_MAX, one row per program; ("grid", CHUNK, P) few long rows, one launch
    with a grid barrier; ("waves", cfg, P, R) many long rows, one persistent launch with per-row
    barriers; ("two",) two launches (x read twice): without ``one_launch`` (no GPU), or when a row
    needs more programs than the GPU holds at once.
    """
    if V <= ROW_BLOCK_MAX:
        return ("row",)
    if one_launch:
        fit = fit_split(B, V, sms, min_chunk)
        if fit is not None:
            return ("grid", fit[0], fit[1])
        plan = wave_plan(B, V, sms, cfg)
        if plan is not None:
            return ("waves", cfg, plan[0], plan[2])
    return ("two",)


def wave_rows_plan(B: int, V: int, sms: int, min_chunk: int = MIN_CHUNK) -> tuple[int, int] | None:
    """(chunk, rows per wave) for sampling more rows than ``fit_split`` fits at once: the chunks of a
    WAVE_ROWS-row one-launch (fewer rows if V is too long for that), as many rows a wave as fit."""
    for rows in (WAVE_ROWS, 4, 2, 1):
        fit = fit_split(rows, V, sms, min_chunk)
        if fit is not None:
            return fit[0], min(B, sms // fit[1])
    return None


def _scalar(v) -> bool:
    return not isinstance(v, torch.Tensor)


def waves_pay(temperature, top_k, top_p, V: int, every_row: str | None = None) -> bool:
    """Whether rows beyond what one launch fits take the persistent waves: unless the scalar
    parameters (or the caller's ``every_row`` promise, which rules out top-p alone either way) rule
    out top-p alone (top_k >= V is off). H200, [32, 128256]
    (many_rows_sample_probe.json): top-p alone 175 vs 1761 us for the two launches (whose row's
    last program bisects a wide nucleus alone), but k50 + p0.9 59 vs 51 us and greedy 23 vs 14:
    per-row tensors (unknown to the host) take the waves, the cheaper miss."""
    if every_row is not None:
        return False
    return not ((_scalar(temperature) and temperature == 0.0) or (_scalar(top_k) and 0 < top_k < V)
                or (_scalar(top_p) and top_p >= 1.0))


def topk_tagged(temperature, top_k, V: int, every_row: str | None = None) -> bool:
    """Whether every row of a one-launch (not waves) sample takes top-k, known from the scalars (t > 0
    and 0 < k < V; top-p and min-p may be anything, per-row too) or promised by the caller
    (``every_row="top_k"``, as the engine derives it from its requests' SamplingParams). Such a
    launch takes the tagged-word path (``_topk_tagged_row``): H200 [1, 128256] k 50 + p 0.9 6.66 us,
    7.80 with ``_topk_sample``'s acq_rel atomics (sample_tagged_probe.json)."""
    if every_row == "top_k":
        return True
    if not (_scalar(temperature) and _scalar(top_k)):
        return False
    return temperature > 0.0 and 0 < top_k < V


def temperature_alone(temperature, top_k, top_p, min_p, V: int, every_row: str | None = None) -> bool:
    """Whether every row samples by temperature alone (scalars: t > 0, top-k off (0 or >= V), top-p 1,
    min-p 0; or the caller's ``every_row="temperature_only"`` promise): the one-launch sampler then
    races without its barrier (``_free_race_row``; H200 [1, 128256]: 4.41 vs 6.19 us with the
    barrier, sample_free_race.json)."""
    if every_row == "temperature_only":
        return True
    if not all(_scalar(v) for v in (temperature, top_k, top_p, min_p)):
        return False
    return temperature > 0.0 and (top_k == 0 or top_k >= V) and top_p >= 1.0 and min_p == 0.0
