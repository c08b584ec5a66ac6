"""The one-launch sampler's warps per program (EMBER_SAMPLE_WARPS), H200, graph-timed, [1, 128256] fp32:
the bench's sampling mixes at each warp count, alternating REPEATS times, and whether every count drew
the same token (the candidates, thresholds and race keys do not depend on the warps).

    python bench/sample_warps_probe.py OUT_JSON [warps,...]
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
MIXES = {"t0.7_k50_p0.9": (0.7, 50, 0.9), "t0.7_p0.9": (0.7, 0, 0.9), "t0.7": (0.7, 0, 1.0)}


def main(path: str | None = None, warps=("4", "2", "8")) -> dict:
    xs = [torch.randn(1, V, device="cuda") * 3 for _ in range(_timing.copies_to_exceed_l2(4 * V))]
    seed = torch.tensor([5], device="cuda")
    res = {"repeats": REPEATS, "mixes": {}}
    for name, (T, k, p) in MIXES.items():
        times = {w: [] for w in warps}
        tokens = {}
        for _ in range(REPEATS):
            for w in warps:
                with env_vars({"EMBER_SAMPLE_WARPS": w}):
                    off = torch.zeros(1, dtype=torch.int64, device="cuda")
                    out = torch.empty(1, dtype=torch.int64, device="cuda")
                    ks.sample(xs[0], out, T, k, p, 0.0, seed, off)
                    tokens[w] = int(out)

                    def call(x):
                        o = torch.empty(1, dtype=torch.int64, device="cuda")
                        ks.sample(x, o, T, k, p, 0.0, seed, off)
                        return o
                    times[w].append(_timing.graph_time_us([lambda x=x: call(x) for x in xs], replays=20))
        res["mixes"][name] = {w: {"median_us": statistics.median(v), "all_us": v} for w, v in times.items()}
        res["mixes"][name]["same_token"] = len(set(tokens.values())) == 1
        print(name, {w: [round(t, 2) for t in v] for w, v in times.items()}, "same token:",
              res["mixes"][name]["same_token"], flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None,
         tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("4", "2", "8"))
