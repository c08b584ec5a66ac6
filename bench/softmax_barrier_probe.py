"""How the many-row softmax's row partials meet, H200, graph-timed, [256, 128256] fp32.

``_softmax_waves_kernel`` publishes each chunk's (max, sum of exp), then waits for its row's P
programs. Variants at the default shape (WAVES_DEFAULT, L2 prefetch 2), alternated REPEATS times:

* "counter" (HINTED off): float partials, CTA barrier, an acq_rel ``atomic_add`` on the row's
  counter, ``ld.acquire`` polls, then a load of the P partials. The release makes the program wait
  until its earlier stores are performed, the previous row's output chunk among them;
* "hinted" (the kernel's default): the partials are int64 words tagged with the row counter's
  generation + 1, stored relaxed; the arrival is relaxed, and once the counter completes the P
  pairs are read (re-read while a tag is old);
* "counter_relaxed_arrival": a diagnostic, not a valid kernel (the partial stores are unordered with
  the arrival): the counter barrier without the release, to see what the drain costs;
* "hinted_volatile_poll": the counter polled with volatile loads instead of ``ld.acquire``;
* "hinted_store_evict_first" / "hinted_store_cs": cache hints on the output stores.

Measured: bench/results/h200/softmax_barrier_probe.json; earlier runs at 8192,8,2,2 while the kernel
changed (tagged polling without a counter, exp kept from the statistics pass, the freshness check
folded into the sum, generation tags) and the run with the wait's target taken from the generation:
raw/softmax_barrier_probe_*.json.

    python bench/softmax_barrier_probe.py OUT_JSON
"""
from __future__ import annotations

import sys

# bench/ is on sys.path when run as a script
from softmax_evict_probe import STORE, _variant, time_variants  # noqa: E402
from ember.kernels import sampling as ks

PREFETCHES = (2,)
ARRIVAL = 'v = tl.atomic_add(row_bar_ptr + row, add, sem="acq_rel", scope="gpu")'
WAIT = "gave_up = _barrier_wait(row_bar_ptr + row, v, add, spin_cap, LD_POLL)"
VOLATILE_WAIT = """target = (v // BARRIER_GEN + 1) * BARRIER_GEN
        cur = v + add
        polls = 0
        while (cur < target) & (polls < spin_cap):
            cur = tl.load(row_bar_ptr + row, volatile=True)
            polls += 1
        gave_up = cur < target"""


def main(path: str | None = None) -> dict:
    hinted, counter = dict(hinted=True), dict(hinted=False)
    variants = {
        "counter": (ks, counter), "hinted": (ks, hinted),
        "counter_relaxed_arrival": (_variant("relaxed_arrival", [(ARRIVAL, ARRIVAL.replace("acq_rel", "relaxed"))]),
                                    counter),
        "hinted_volatile_poll": (_variant("volatile_poll", [(WAIT, VOLATILE_WAIT)]), hinted),
        "hinted_store_evict_first": (_variant("store_ef", [(STORE, STORE[:-1] + ', eviction_policy="evict_first")')]),
                                     hinted),
        "hinted_store_cs": (_variant("store_cs", [(STORE, STORE[:-1] + ', cache_modifier=".cs")')]), hinted)}
    return time_variants(variants, PREFETCHES, path)


if __name__ == "__main__":
    main(*sys.argv[1:])
