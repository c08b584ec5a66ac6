"""Top-p alone at [1, 128256] (H200, graph-timed): the one-launch nucleus search against the kernel
module before it (its single-program bisection fallback), the two launches, and torch's sort-based
top-p pipeline, all in one run, on several logit shapes; and the search's pivots per round.

The "before" module is a copy of ember/kernels/sampling.py before the search (a file path, default:
``git show HEAD:ember/kernels/sampling.py``), loaded under another name with its own workspace. Every ember token is checked against the float64
reference's support before it is timed.

    python bench/nucleus_probe.py [out.json] [before.py]
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import ember
from ember.bench import _timing, module_from_source
from ember.kernels import sampling as ks
from ember.ops import sampling as S

V = 128256


def _before_module(before: str | None):
    if before is None:
        src = subprocess.run(["git", "show", "HEAD:ember/kernels/sampling.py"], capture_output=True, text=True,
                             check=True).stdout
    else:
        src = Path(before).read_text()
    return module_from_source("ember_sampling_before", src)


def torch_top_p(logits, temperature, top_p):
    """transformers' top-p warper + multinomial: sort, cumsum, scatter."""
    scores = logits / temperature
    sorted_logits, sorted_idx = torch.sort(scores, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)
    remove_sorted[..., -1:] = 0
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return torch.multinomial(scores.masked_fill(remove, -float("inf")).softmax(dim=-1), 1)


def _rows(kind: str, n: int) -> list[torch.Tensor]:
    out = []
    for _ in range(n):
        if kind == "llm_like":
            x = torch.randn(1, V, device="cuda") * 2
            x[0, torch.randint(0, V, (5,), device="cuda")] += 12.0
        elif kind == "randn3":
            x = torch.randn(1, V, device="cuda") * 3
        elif kind == "flat":
            x = torch.rand(1, V, device="cuda")
        else:
            raise ValueError(kind)
        out.append(x)
    return out


CASES = [("randn3", 0.7, 0.9), ("randn3", 1.0, 0.95), ("llm_like", 0.7, 0.9), ("llm_like", 1.0, 0.5),
         ("flat", 1.0, 0.9)]


def main(path: str | None = None, before_path: str | None = None) -> dict:
    before = _before_module(before_path)
    n_sets = _timing.copies_to_exceed_l2(4 * V)
    seed = torch.tensor([5], device="cuda")
    off = torch.zeros(1, dtype=torch.int64, device="cuda")
    res = {"before": before_path or "HEAD", "pivots": ks.NUCLEUS_PIVOTS, "rounds": ks.NUCLEUS_ROUNDS,
           "cases": {}}
    for kind, T, p in CASES:
        data = _rows(kind, n_sets)
        name = f"{kind}_t{T}_p{p}"
        probs = S.sampling_probs_reference(data[0], temperature=T, top_p=p)[0]
        row = {"support": int((probs > 0).sum())}

        def ours(x, mod=ks):
            out = torch.empty(1, dtype=torch.int64, device="cuda")
            mod.sample_one_launch(x, out, T, 0, p, 0.0, seed, off)
            return out

        for label, fn in (("ember", ours), ("before", lambda x: ours(x, before))):
            tok = fn(data[0])
            assert probs[int(tok)] > 0, (name, label, int(tok))
            row[f"{label}_us"] = _timing.graph_time_us([lambda x=x: fn(x) for x in data], replays=5)
        for nb in (8, 16):
            ks.NUCLEUS_PIVOTS = nb
            assert probs[int(ours(data[0]))] > 0
            row[f"ember_pivots{nb}_us"] = _timing.graph_time_us([lambda x=x: ours(x) for x in data], replays=5)
        ks.NUCLEUS_PIVOTS = res["pivots"]
        row["torch_us"] = _timing.graph_time_us([lambda x=x: torch_top_p(x, T, p) for x in data], replays=5)
        row["speedup_vs_before"] = row["before_us"] / row["ember_us"]
        row["speedup_vs_torch"] = row["torch_us"] / row["ember_us"]
        res["cases"][name] = row
        print(name, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2] if len(sys.argv) > 2 else None)
