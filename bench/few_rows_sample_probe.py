"""Sampling 2-16 rows of 128256 (H200, graph-timed): one launch with bigger chunks (the default) against
the two launches (EMBER_SOFTMAX_ONE_LAUNCH=0), same run, T 0.7 with top-k 50 + top-p 0.9 and with
top-p 0.9 alone.

    python bench/few_rows_sample_probe.py [out.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import ember
from ember.bench import _timing, env_vars

V = 128256


def main(path: str | None = None) -> dict:
    seed = torch.tensor([5], device="cuda")
    off = torch.zeros(1, dtype=torch.int64, device="cuda")
    res = {}
    for B in (2, 8, 16):
        data = [torch.randn(B, V, device="cuda") * 3 for _ in range(_timing.copies_to_exceed_l2(4 * B * V))]
        for name, kw in (("k50_p0.9", dict(top_k=50, top_p=0.9)), ("p0.9", dict(top_p=0.9))):
            row = {}
            for label, switch in (("one_launch", None), ("two_launches", "0")):
                with env_vars({"EMBER_SOFTMAX_ONE_LAUNCH": switch}):
                    calls = [lambda x=x: ember.ops.sample(x, temperature=0.7, **kw, seed=seed, offset=off, check=False)
                             for x in data]
                    row[f"{label}_us"] = _timing.graph_time_us(calls, replays=5)
            res[f"{B}x{V}_{name}"] = row
            print(B, name, {k: round(v, 2) for k, v in row.items()}, flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
