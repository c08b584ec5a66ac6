"""One-row sampler: programs per row (chunk) x warps, H200, graph-timed, [1, 128256] fp32.

``sample`` gives one row ``_split``'s chunks (1024 elements: 126 programs on the grid barrier and,
with top-k, ~50 of them appending candidates on the row's counter); a bigger chunk (a power-of-2
multiple, still publishing the 1024-element piece maxima, so the candidate bound and the list are
the same) means fewer arrivals on both counters and more work per program. This times chunk
1024 / 2048 / 4096 x 4 / 8 warps for the bench's mixes, alternating REPEATS times, and checks the
tokens equal across shapes for the same seed and offset.

    python bench/sample_chunk_probe.py OUT_JSON

Measured (H200, bench/results/h200/sample_chunk_probe.json, same tokens everywhere): k50 + p0.9
7.73 us at 1024 x 4 warps, 8.87 / 9.34 at 2048 x 4 / 8, 10.77 / 10.48 at 4096; k50 alone the same;
temperature alone 6.62, 8.77 / 7.59, 12.40 / 9.42. Fewer, bigger programs lose: the default stays.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from ember.bench import _timing, env_vars
from ember.kernels import sampling as ks

V = 128256
REPEATS = 3
SHAPES = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8)]
MIXES = {"t0.7_k50_p0.9": (0.7, 50, 0.9), "t0.7_k50": (0.7, 50, 1.0), "t0.7": (0.7, 0, 1.0)}


def main(path: str | None = None) -> dict:
    xs = [torch.randn(1, V, device="cuda") * 3 for _ in range(_timing.copies_to_exceed_l2(4 * V))]
    seed = torch.tensor([5], device="cuda")
    res = {"repeats": REPEATS, "mixes": {}}
    for name, (T, k, p) in MIXES.items():
        times = {f"{c}x{w}": [] for c, w in SHAPES}
        tokens = {}
        for _ in range(REPEATS):
            for c, w in SHAPES:
                label = f"{c}x{w}"
                with env_vars({"EMBER_SAMPLE_WARPS": str(w)}):
                    def call(x, c=c):
                        out = torch.empty(1, dtype=torch.int64, device="cuda")
                        ks.sample_one_launch(x, out, T, k, p, 0.0, seed, 7, chunk=c)
                        return out
                    tokens[label] = [int(call(x)) for x in xs[:4]]
                    times[label].append(_timing.graph_time_us([lambda x=x: call(x) for x in xs]))
        ref = tokens["1024x4"]
        res["mixes"][name] = {label: {"median_us": statistics.median(v), "all_us": v,
                                      "tokens_equal": tokens[label] == ref} for label, v in times.items()}
        for label, v in times.items():
            print(f"{name:>14} {label:>8}: {statistics.median(v):6.2f} us {[round(t, 2) for t in v]} "
                  f"same tokens {tokens[label] == ref}", flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(*sys.argv[1:])
