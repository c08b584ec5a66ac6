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

import json
import statistics
import sys
from pathlib import Path

import torch

from softmax_evict_probe import _variant  # noqa: E402 (bench/ is on sys.path when run as a script)
from ember.bench import _timing
from ember.bench.sampling import COPY_BW_GBPS
from ember.kernels import sampling as ks

SHAPE = (256, 128256)
REPEATS = 3
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
STORE = "tl.store(out_ptr + row * stride_out + cols, y, mask=mask)"


def main(path: str | None = None) -> dict:
    dev = torch.device("cuda")
    xs = [torch.randn(SHAPE, device=dev) * 3 for _ in range(_timing.copies_to_exceed_l2(4 * SHAPE[0] * SHAPE[1]))]
    ref = torch.softmax(xs[0].double(), -1)
    nbytes = 2 * 4 * SHAPE[0] * SHAPE[1]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    relaxed = _variant("relaxed_arrival", [(ARRIVAL, ARRIVAL.replace("acq_rel", "relaxed"))])
    variants = {"counter": (ks, False), "hinted": (ks, True), "counter_relaxed_arrival": (relaxed, False),
                "hinted_volatile_poll": (_variant("volatile_poll", [(WAIT, VOLATILE_WAIT)]), True),
                "hinted_store_evict_first": (_variant("store_ef", [(STORE, STORE[:-1] + ', eviction_policy="evict_first")')]),
                                             True),
                "hinted_store_cs": (_variant("store_cs", [(STORE, STORE[:-1] + ', cache_modifier=".cs")')]), True)}
    outs = [torch.empty(SHAPE, device=dev) for _ in xs]
    res = {"shape": SHAPE, "repeats": REPEATS, "copy_bw_GBps": COPY_BW_GBPS, "variants": {}}
    for pf in PREFETCHES:
        cfg = ks.WAVES_DEFAULT._replace(prefetch=pf)
        P, _, R = ks.wave_plan(SHAPE[0], SHAPE[1], sms, cfg)
        times = {name: [] for name in variants}
        errs, give_ups = {}, {}
        for _ in range(REPEATS):
            for name, (mod, hinted) in variants.items():
                kw = dict(hinted=hinted)
                before = mod.barrier_give_ups(dev)
                mod.softmax_waves(xs[0], outs[0], 1.0, False, cfg, P, R, **kw)
                errs[name] = (outs[0].double() - ref).abs().max().item()
                calls = [lambda x=x, o=o, mod=mod, kw=kw: mod.softmax_waves(x, o, 1.0, False, cfg, P, R, **kw)
                         for x, o in zip(xs, outs)]
                times[name].append(_timing.graph_time_us(calls))
                give_ups[name] = mod.barrier_give_ups(dev) - before
        for name, v in times.items():
            med = statistics.median(v)
            frac = nbytes / med / 1e3 / COPY_BW_GBPS
            res["variants"][f"{name}_prefetch{pf}"] = {"median_us": med, "all_us": v, "fraction_of_copy": frac,
                                                       "max_abs_err": errs[name], "give_ups": give_ups[name]}
            print(f"prefetch {pf} {name:>24}: {med:7.2f} us {frac:6.1%}  {[round(t, 1) for t in v]} "
                  f"err {errs[name]:.1e} give-ups {give_ups[name]}", flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(*sys.argv[1:])
