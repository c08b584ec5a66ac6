"""Where the Qwen3-30B-A3B decode step's time goes, kernel by kernel, inside the CUDA graph.

``ember.bench._timeline`` profiles a few replays of the captured decode step and gives, per kernel
name, calls, mean duration and what the kernel adds to the chain (``incr_us``; its docstring says why
that, not the duration, sums to the step). This tool adds the HBM floor of the bytes each kernel reads
(bf16 / fp8 weights of the Qwen3-30B-A3B shapes at 4.15 TB/s), so the overhead per kernel is
increment - floor.

    python bench/step_timeline.py OUT_JSON [--fp8] [--cache 400] [--batch 1]

``--batch B`` profiles the step of B rows (B prompts of 128 tokens; at B > 1 the floors of the
expert GEMVs are those of batch 1, so compare increments between runs, not against them).
"""
import argparse
import json

import torch

from ember.bench import _timeline
from ember.bench import moe as moe_bench

BW = 4.15e12
H, QKV, O, E, TOPK, I, V = 2048, 5120, 4096, 128, 8, 768, 151936


def floors_us(fp8: bool) -> dict:
    w = 1 if fp8 else 2
    mb = {"qkv": H * QKV * w, "o_proj": O * H * w, "router": E * H * 2, "gate_up": TOPK * 2 * I * H * w,
          "down": TOPK * H * I * w, "lm_head": V * H * 2}
    return {k: v / BW * 1e6 for k, v in mb.items()}


def summarise(kernels: list[dict], fp8: bool) -> dict:
    """``_timeline.summarise`` with the per-kernel floors of the Qwen3-30B-A3B shapes."""
    return _timeline.summarise(kernels) | {"floors_us": {k: round(v, 2) for k, v in floors_us(fp8).items()}}


def main(path: str, fp8_too: bool, cache: int, batch: int) -> None:
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    res = {}
    for fp8 in ([False, True] if fp8_too else [False]):
        em = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=cache, max_batch_size=batch)
        moe_bench.ember_decode(em, [list(range(100 + r, 228 + r)) for r in range(batch)], 32)
        key = "fp8" if fp8 else "bf16"
        res[key] = summarise(_timeline.step_kernels(moe_bench.step_graph(em, batch)), fp8)
        res[key]["graph_step_ms"] = moe_bench.graph_step_ms(em, batch)
        print(key, json.dumps(res[key], indent=1)[:3000], flush=True)
        em = None
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(res | {"cache": cache, "batch": batch}, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file the timeline summary is written to")
    ap.add_argument("--fp8", action="store_true", help="also profile the FP8-weight step")
    ap.add_argument("--cache", type=int, default=400, help="max_seq_len of the profiled model")
    ap.add_argument("--batch", type=int, default=1, help="rows decoded per step")
    a = ap.parse_args()
    main(a.out, a.fp8, a.cache, a.batch)
