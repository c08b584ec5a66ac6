"""Top-k sampler, tagged words vs the acq_rel path (H200, graph-timed, fp32 rows of 128256).

``_topk_tagged_row`` (scalar t > 0 and 0 < k < V, one launch) publishes the piece maxima and the
candidates as tagged int64 words behind relaxed atomics; ``EMBER_SAMPLE_TAGGED=0`` keeps
``_topk_sample`` (stores, acq_rel arrival, a reservation atomic before the candidates' stores and
an acq_rel arrival after them). This times both, alternating REPEATS times, and checks that they
draw the same tokens for the same seed and offset. With an offset tensor (what ``ember.ops.sample``
passes) the row's finisher reads it and advances it (one row; ``EMBER_SAMPLE_OFFSET_BY_FINISHER=0``:
every program reads it with ``ld.acquire`` and program (0, 0) advances it), and the finisher picks
the winner with one packed max (``EMBER_SAMPLE_PACKED_RACE=0``: an argmax, a max and a gather); the
variants below set both switches explicitly. bench/results/h200/sample_tagged_probe.json holds the
int-offset runs (and since-removed variants: raw/README.md), sample_tagged_probe_offset.json the
offset-tensor run that made both switches the defaults.

    python bench/sample_tagged_probe.py OUT_JSON [VARIANT,VARIANT,... [MIX,MIX,...]]
    (each kernel variant compiles once, ~20 s: a subset keeps one call short; the first named
    variant is the one the others' tokens are compared with)
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
MIXES = {"1x_t0.7_k50_p0.9": (1, 0.7, 50, 0.9, 0.0), "1x_t1.0_k1": (1, 1.0, 1, 1.0, 0.0),
         "4x_t0.7_k50_p0.9": (4, 0.7, 50, 0.9, 0.0)}   # (earlier runs also: k50 alone, k50 + p0.9 + min-p 0.05)
# label -> (environment, offset as an int or as a one-element tensor, as ember.ops.sample and the
# engine pass it); tokens compared with the first
VARIANTS = {"tagged": ({}, "int"), "acq_rel": ({"EMBER_SAMPLE_TAGGED": "0"}, "int"),
            "tagged_offset_tensor": ({"EMBER_SAMPLE_OFFSET_BY_FINISHER": "0", "EMBER_SAMPLE_PACKED_RACE": "0"},
                                     "tensor"),
            "tagged_offset_by_finisher": ({"EMBER_SAMPLE_OFFSET_BY_FINISHER": "1", "EMBER_SAMPLE_PACKED_RACE": "0"},
                                          "tensor"),
            "tagged_offset_by_finisher_packed_race": ({"EMBER_SAMPLE_OFFSET_BY_FINISHER": "1",
                                                       "EMBER_SAMPLE_PACKED_RACE": "1"}, "tensor"),  # the default
            "acq_rel_offset_tensor": ({"EMBER_SAMPLE_TAGGED": "0"}, "tensor")}


def _at_7(call, x, offset) -> list[int]:
    """The tokens of a call from offset tensor 7 (every variant draws from offset 7)."""
    offset.fill_(7)
    tok = call(x).tolist()
    assert int(offset) == 8, "the offset tensor must advance once per call"
    return tok


def main(path: str | None = None, variants: list[str] | None = None, mixes: list[str] | None = None) -> dict:
    variants = {v: VARIANTS[v] for v in variants or VARIANTS}
    first = next(iter(variants))
    seed = torch.tensor([5], device="cuda")
    offset = torch.zeros(1, dtype=torch.int64, device="cuda")
    res = {"repeats": REPEATS, "mixes": {}}
    for name, (B, T, k, p, minp) in ((m, MIXES[m]) for m in mixes or MIXES):
        xs = [torch.randn(B, V, device="cuda") * 3 for _ in range(_timing.copies_to_exceed_l2(4 * B * V))]
        times = {label: [] for label in variants}
        tokens = {}
        for _ in range(REPEATS):
            for label, (env, kind) in variants.items():
                with env_vars(env):
                    def call(x, kind=kind):
                        out = torch.empty(B, dtype=torch.int64, device="cuda")
                        ks.sample(x, out, T, k, p, minp, seed, offset if kind == "tensor" else 7)
                        return out
                    tokens[label] = [call(x).tolist() if kind == "int" else _at_7(call, x, offset) for x in xs[:6]]
                    times[label].append(_timing.graph_time_us([lambda x=x: call(x) for x in xs]))
        same = all(t == tokens[first] for t in tokens.values())
        res["mixes"][name] = {label: {"median_us": statistics.median(v), "all_us": v} for label, v in times.items()}
        res["mixes"][name]["tokens_equal"] = same
        for label, v in times.items():
            print(f"{name:>26} {label:>8}: {statistics.median(v):6.2f} us {[round(t, 2) for t in v]}", flush=True)
        print(f"{name:>26} same tokens: {same}", flush=True)
    res["give_ups"] = ks.barrier_give_ups(torch.device("cuda"))
    print("barrier give-ups:", res["give_ups"])
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2].split(",") if len(sys.argv) > 2 else None,
         sys.argv[3].split(",") if len(sys.argv) > 3 else None)
