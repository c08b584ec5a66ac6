"""A/B of the one-row sampler against an earlier copy of ember/kernels/sampling.py (H200, graph-timed,
[1, 128256] fp32): the bench's three sampling mixes, the two modules timed alternately REPEATS times
so the run-to-run spread is in the same file as the difference.

    git show 1a33003:ember/kernels/sampling.py > before_sampling.py   # untracked; delete after
    python bench/sampler_ab_probe.py before_sampling.py [out.json]

Why: after the one-launch sampler's row body moved into ``_sample_row`` (for the many-row waves) the
bench's k50 + p0.9 row read 8.79 us against 8.53 in the run before, with no same-run A/B.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from ember.bench import _timing, module_from_source
from ember.kernels import sampling as ks

V = 128256
REPEATS = 5
MIXES = {"t0.7_k50_p0.9": (0.7, 50, 0.9), "t0.7_p0.9": (0.7, 0, 0.9), "t0.7": (0.7, 0, 1.0)}


def main(before_path: str, path: str | None = None) -> dict:
    mods = {"current": ks, "before": module_from_source("ember_sampling_before", Path(before_path).read_text())}
    xs = [torch.randn(1, V, device="cuda") * 3 for _ in range(_timing.copies_to_exceed_l2(4 * V))]
    seed = torch.tensor([5], device="cuda")
    off = torch.zeros(1, dtype=torch.int64, device="cuda")
    res = {"before": before_path, "repeats": REPEATS, "mixes": {}}
    for name, (T, k, p) in MIXES.items():
        times = {label: [] for label in mods}
        for _ in range(REPEATS):
            for label, mod in mods.items():
                def call(x, mod=mod):
                    out = torch.empty(1, dtype=torch.int64, device="cuda")
                    mod.sample(x, out, T, k, p, 0.0, seed, off)
                    return out
                times[label].append(_timing.graph_time_us([lambda x=x: call(x) for x in xs], replays=20))
        res["mixes"][name] = {label: {"median_us": statistics.median(v), "all_us": v} for label, v in times.items()}
        print(name, {label: [round(t, 2) for t in v] for label, v in times.items()}, flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
