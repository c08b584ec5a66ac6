"""Sampling 32 to 256 rows of 128256 (H200, graph-timed): the persistent one-launch sampler walking the
rows in waves (EMBER_SAMPLE_WAVES=1) against the two launches (EMBER_SAMPLE_WAVES=0), whose
row's last program searches the thresholds alone when its candidate list cannot decide them (top-p
alone over a wide nucleus, top-k above the chunk count: ~1-2 ms), and torch's sort-based top-p
pipeline, same run. Each path's first tokens are checked against the float64 reference's support.

    python bench/many_rows_sample_probe.py [out.json]

A multi-pivot key search in the two-launch fallback (NB pivots a pass instead of one) was tried in an
earlier version of this harness and not kept: raw/many_rows_sample_probe_multipivot_2026-12-01.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import ember
from ember.bench import _timing, env_vars
from ember.ops import sampling as S

sys.path.insert(0, str(Path(__file__).parent))
from nucleus_probe import torch_top_p  # noqa: E402

V = 128256
PATHS = {"waves": "1", "two_launches": "0"}


def main(path: str | None = None) -> dict:
    seed = torch.tensor([5], device="cuda")
    off = torch.zeros(1, dtype=torch.int64, device="cuda")
    res = {"cases": {}}
    for B in (32, 64, 256):
        data = {"randn3": [torch.randn(B, V, device="cuda") * 3 for _ in range(_timing.copies_to_exceed_l2(4 * B * V))],
                "flat": [torch.rand(B, V, device="cuda") for _ in range(2)]}
        for kind, T, k, p in (("randn3", 0.7, 0, 0.9), ("flat", 1.0, 0, 0.9), ("randn3", 0.7, 50, 0.9),
                              ("randn3", 0.0, 0, 1.0)):
            xs = data[kind]
            name = f"{B}x{V}_{kind}_t{T}_k{k}_p{p}"
            probs = S.sampling_probs_reference(xs[0][:4], temperature=T, top_k=k, top_p=p)
            row = {"support_row0": int((probs[0] > 0).sum())}
            for label, switch in PATHS.items():
                with env_vars({"EMBER_SAMPLE_WAVES": switch}):
                    call = lambda x: ember.ops.sample(x, temperature=T, top_k=k, top_p=p, seed=seed,  # noqa: E731
                                                      offset=off, check=False)
                    tok = call(xs[0])[:4].cpu()
                    assert bool((probs[torch.arange(4), tok] > 0).all()), (name, label, tok)
                    row[f"{label}_us"] = _timing.graph_time_us([lambda x=x: call(x) for x in xs], replays=3)
            if T > 0:
                row["torch_us"] = _timing.graph_time_us([lambda x=x: torch_top_p(x, T, p) for x in xs], replays=3)
            row["speedup_vs_two_launches"] = row["two_launches_us"] / row["waves_us"]
            res["cases"][name] = row
            print(name, {kk: round(v, 2) if isinstance(v, float) else v for kk, v in row.items()}, flush=True)
        del data
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
