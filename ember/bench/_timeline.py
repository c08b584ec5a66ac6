"""What each kernel of a captured decode step adds to the step (torch.profiler over graph replays).

With programmatic dependent launch a kernel starts while the one before it finishes, so a kernel's own
duration overlaps its neighbours'. What a kernel adds to the chain is the time from the previous
kernel's end to its own end (``incr_us``); summed over a replay it is the step time. The bench rows
that miss their bandwidth target carry this summary (``step_timeline``), so the row itself says which
kernels stand between it and its floor; ``bench/step_timeline.py`` adds the Qwen3-30B-A3B per-kernel
floors.

Example (on a CUDA machine, after the model decoded once at batch 1):
    >>> summary = summarise(step_kernels(model.decode_graph(1)))
    >>> summary["by_name"]["_decode_attention_split_kernel"]["mean_incr_us"]   # ~7 us on the H200
"""
from __future__ import annotations

from collections import defaultdict

import torch


def step_kernels(graph, replays: int = 5) -> list[dict]:
    """The kernels of the last of ``replays`` profiled replays of ``graph`` (a captured CUDA graph),
    in start order: name, start (us), own duration and what each adds to the chain (``incr_us``)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    return increments([(e.name, e.time_range.start, e.time_range.end) for e in evs], replays)


def increments(spans: list[tuple[str, float, float]], replays: int) -> list[dict]:
    """The last replay's kernels of ``spans`` ((name, start us, end us) of ``replays`` replays of one
    graph, in start order) with each kernel's duration and increment over the latest end before it.
    Every replay launches the graph's kernels, so a replay is len(spans) / replays of them (a gap
    between replays can be shorter than a kernel: on an H100 a sync and a replay of two tiny kernels
    took under 20 us); a count that does not divide is a ValueError."""
    if not spans or len(spans) % replays:
        raise ValueError(f"step timeline: {len(spans)} kernels over {replays} replays of one graph")
    last = spans[-(len(spans) // replays):]
    out, prev_end = [], last[0][1]
    for name, start, end in last:
        out.append({"name": name[:60], "start": start, "dur_us": end - start, "incr_us": max(0.0, end - prev_end)})
        prev_end = max(prev_end, end)
    return out


def summarise(kernels: list[dict]) -> dict:
    """Per kernel name: calls, mean duration, mean increment and its share of the step; the step as
    the sum of increments and as the span from first start to last end."""
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
    span = max(k["start"] + k["dur_us"] for k in kernels) - kernels[0]["start"] if kernels else 0.0
    return {"step_us_sum_of_increments": round(total, 1), "step_span_us": round(span, 1), "kernels": len(kernels),
            "by_name": rows,
            "first_layer_sequence": [(k["name"][:40], round(k["dur_us"], 2), round(k["incr_us"], 2))
                                     for k in kernels[:16]]}


def row_timeline(graph) -> dict:
    """``summarise(step_kernels(graph))`` for a bench row's extra, or the error that stopped it (a
    profiler failure must not cost the row its figure)."""
    try:
        return summarise(step_kernels(graph))
    except Exception as e:
        return {"error": repr(e)[:300]}
