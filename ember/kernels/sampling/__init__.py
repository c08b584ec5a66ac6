"""Triton kernels for softmax, log-softmax, argmax and sorting-free sampling.

Files: ``_grid`` (shared jit helpers, the generation-counter barrier, the persistent workspace),
``_plan`` (tiles from ``ember.tuning`` and the pure plans built from them), ``softmax_kernels``,
``argmax_kernels``, ``_race`` (the sampler's draw), ``sampler`` (``sample``, two launches, the
one-launch host side) and ``one_launch_sampler`` (its kernel).

Tuning data (``ember.tuning.lookup("sampling", key, device)``; the H200's in
ember/tuning/data/sm_90-nvidia-h200/sampling.json; without an entry, and on CPU, the rule in ``_plan``):
  * ``split``: ``{"min_chunk": n}`` the fewest elements a program of a split row takes (1024);
  * ``small_sort``: ``{"block": n}`` candidates the sampler's finisher sorts as a small block (128);
  * ``softmax_waves``: ``{"chunk", "warps", "per_sm", "prefetch"}`` the many-row softmax (16384, 16, 1, 2);
  * ``sample_warps:<base chunk>``: ``{"topk": n, "other": n}`` warps of the one-launch sampler (at
    base chunk 1024: 4 with top-k, else 8).

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
over the surviving tokens, ``u`` from Philox keyed on the row's seed (a per-row seed as given, a
batch-wide one mixed with the row index) at counter (token, offset), so no sort and no
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
bench/results/h200/sampling_stages_probe.json, stage by stage): chunk statistics
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

from ember.kernels.sampling._grid import CAP, NUCLEUS_ROUNDS, ROW_BLOCK_MAX, SPIN_CAP, barrier_give_ups
from ember.kernels.sampling._plan import (WAVES_DEFAULT, WaveConfig, fit_split, min_chunk, sample_warps, small_sort,
                                          softmax_path, split, temperature_alone, topk_tagged, wave_config, wave_plan,
                                          wave_rows_plan, waves_pay)
from ember.kernels.sampling.argmax_kernels import argmax
from ember.kernels.sampling.sampler import sample, sample_one_launch, sample_two_launch
from ember.kernels.sampling.softmax_kernels import softmax, softmax_one_launch, softmax_two_launch, softmax_waves

__all__ = ["CAP", "NUCLEUS_ROUNDS", "ROW_BLOCK_MAX", "SPIN_CAP", "WAVES_DEFAULT", "WaveConfig", "argmax",
           "barrier_give_ups", "fit_split", "min_chunk", "sample", "sample_one_launch", "sample_two_launch",
           "sample_warps", "small_sort", "softmax", "softmax_one_launch", "softmax_path", "softmax_two_launch",
           "softmax_waves", "split", "temperature_alone", "topk_tagged", "wave_config", "wave_plan", "wave_rows_plan",
           "waves_pay"]
