"""Cache hints in the many-row softmax (``_softmax_waves_kernel``), H200, graph-timed, [256, 128256] fp32.

The kernel bulk-prefetches the chunk PREFETCH rows ahead into L2; from 3 rows ahead it got slower
(sampling_waves_l2_sweep.json), as if the prefetched rows were evicted before use. The output rows
(8 MB a wave) and the already-consumed input pass through L2 with the default (evict_normal)
priority. This probe builds variants of the kernel module whose output stores and/or register loads
carry an eviction hint, and times each at PREFETCH 2, 3 and 4, alternating REPEATS times, at
WAVES_DEFAULT's shape (8192,8,2 when softmax_evict_probe.json was measured; 16384,16,1 since).
``time_variants`` is also bench/softmax_barrier_probe.py's loop.

    python bench/softmax_evict_probe.py OUT_JSON
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from ember.bench import _timing, module_from_source
from ember.bench.sampling import COPY_BW_GBPS
from ember.kernels import sampling as ks

SHAPE = (256, 128256)
REPEATS = 3
PREFETCHES = (2, 3, 4)
STORE = "tl.store(out_ptr + row * stride_out + cols, y, mask=mask)"  # the output store
LOAD_HINT = ',\n                         eviction_policy="evict_first")'  # the kernel's register loads
# Relative to the kernel as it is now (register loads evict_first, adopted from this probe's first
# run, softmax_evict_probe.json, whose "base" had no hints and "load_evict_first" was then the kernel).
VARIANTS = {
    "current": [],
    "load_no_hint": [(LOAD_HINT, ")")],
    "store_evict_first": [(STORE, STORE[:-1] + ', eviction_policy="evict_first")')],
    "store_cs": [(STORE, STORE[:-1] + ', cache_modifier=".cs")')],
}


def _variant(name: str, edits):
    """The sampling kernel module with ``edits`` applied (every occurrence) inside ``_softmax_waves_kernel`` only."""
    src = Path(ks.__file__).read_text()
    start = src.index("def _softmax_waves_kernel(")
    end = src.index("@triton.jit", start)
    body = src[start:end]
    for old, new in edits:
        if not body.count(old):
            raise SystemExit(f"{name}: no {old!r} in _softmax_waves_kernel")
        body = body.replace(old, new)
    return module_from_source(f"ember_sampling_{name}", src[:start] + body + src[end:])


def time_variants(variants: dict, prefetches, path: str | None = None) -> dict:
    """Graph-time ``softmax_waves`` of each variant, name -> (kernel module, softmax_waves keywords), at
    WAVES_DEFAULT with each L2-prefetch depth, the variants alternated REPEATS times; max |error| vs
    float64 and barrier give-ups recorded per variant."""
    dev = torch.device("cuda")
    xs = [torch.randn(SHAPE, device=dev) * 3 for _ in range(_timing.copies_to_exceed_l2(4 * SHAPE[0] * SHAPE[1]))]
    ref = torch.softmax(xs[0].double(), -1)
    nbytes = 2 * 4 * SHAPE[0] * SHAPE[1]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    outs = [torch.empty(SHAPE, device=dev) for _ in xs]
    res = {"shape": SHAPE, "repeats": REPEATS, "copy_bw_GBps": COPY_BW_GBPS, "variants": {}}
    for pf in prefetches:
        cfg = ks.WAVES_DEFAULT._replace(prefetch=pf)
        P, _, R = ks.wave_plan(SHAPE[0], SHAPE[1], sms, cfg)
        times = {name: [] for name in variants}
        errs, give_ups = {}, {}
        for _ in range(REPEATS):
            for name, (mod, kw) in variants.items():
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


def main(path: str | None = None) -> dict:
    return time_variants({name: (_variant(name, edits), {}) for name, edits in VARIANTS.items()}, PREFETCHES, path)


if __name__ == "__main__":
    main(*sys.argv[1:])
