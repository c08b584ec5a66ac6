"""Where the Qwen3-30B-A3B decode step's time goes, kernel by kernel, inside the CUDA graph.

With programmatic dependent launch a kernel starts while the one before it finishes, so a kernel's
own duration overlaps its neighbours'. What each kernel adds to the chain is the step from the
previous kernel's end to its own end (``incr_us``); summed over a replay it is the step time. The
probe profiles a few replays of the captured decode step (torch.profiler/CUPTI reports each kernel
node of a graph), takes the last one, groups its kernels by name and gives, per name, calls, mean
duration, mean increment, and the HBM floor of the bytes that kernel reads (bf16 / fp8 weights of
the Qwen3-30B-A3B shapes at 4.15 TB/s), so the overhead per kernel is increment - floor.

    python bench/step_timeline.py OUT_JSON [--fp8] [--cache 400] [--batch 1]

``--batch B`` profiles the step of B rows (B prompts of 128 tokens; at B > 1 the floors of the
expert GEMVs are those of batch 1, so compare increments between runs, not against them).
"""
import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ember.bench import moe as moe_bench

BW = 4.15e12
H, QKV, O, E, TOPK, I, V = 2048, 5120, 4096, 128, 8, 768, 151936


def floors_us(fp8: bool) -> dict:
    w = 1 if fp8 else 2
    mb = {"qkv": H * QKV * w, "o_proj": O * H * w, "router": E * H * 2, "gate_up": TOPK * 2 * I * H * w,
          "down": TOPK * H * I * w, "lm_head": V * H * 2}
    return {k: v / BW * 1e6 for k, v in mb.items()}


def step_kernels(model, replays: int = 5, batch: int = 1) -> list[dict]:
    g = moe_bench.step_graph(model, batch)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    # replays are separated by host syncs: split where the gap exceeds 20 us
    groups, cur = [], []
    for e in evs:
        if cur and e.time_range.start - max(c.time_range.end for c in cur) > 20:
            groups.append(cur)
            cur = []
        cur.append(e)
    groups.append(cur)
    last = groups[-1]
    out, prev_end = [], last[0].time_range.start
    for e in last:
        end = e.time_range.end
        out.append({"name": e.name[:60], "start": e.time_range.start, "dur_us": e.time_range.elapsed_us(),
                    "incr_us": end - prev_end})
        prev_end = max(prev_end, end)
    return out


def summarise(kernels: list[dict], fp8: bool) -> dict:
    by = defaultdict(lambda: {"calls": 0, "dur_us": 0.0, "incr_us": 0.0})
    for k in kernels:
        b = by[k["name"]]
        b["calls"] += 1
        b["dur_us"] += k["dur_us"]
        b["incr_us"] += k["incr_us"]
    total = sum(k["incr_us"] for k in kernels)
    rows = {n: {"calls": b["calls"], "mean_dur_us": round(b["dur_us"] / b["calls"], 2),
                "mean_incr_us": round(b["incr_us"] / b["calls"], 2), "share": round(b["incr_us"] / total, 3)}
            for n, b in sorted(by.items(), key=lambda kv: -kv[1]["incr_us"])}
    span = kernels[-1]["start"] + kernels[-1]["dur_us"] - kernels[0]["start"]
    return {"step_us_sum_of_increments": round(total, 1), "step_span_us": round(span, 1), "kernels": len(kernels),
            "by_name": rows, "floors_us": {k: round(v, 2) for k, v in floors_us(fp8).items()},
            "first_layer_sequence": [(k["name"][:40], round(k["dur_us"], 2), round(k["incr_us"], 2))
                                     for k in kernels[:16]]}


def main(path: str, fp8_too: bool, cache: int, batch: int) -> None:
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    res = {}
    for fp8 in ([False, True] if fp8_too else [False]):
        em = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=cache, max_batch_size=batch)
        moe_bench.ember_decode(em, [list(range(100 + r, 228 + r)) for r in range(batch)], 32)
        key = "fp8" if fp8 else "bf16"
        res[key] = summarise(step_kernels(em, batch=batch), fp8)
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
