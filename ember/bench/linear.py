"""``ember bench linear``: batch-1 (M=1) bf16 projections, ember's Triton GEMV against F.linear (cuBLAS).

Floors on the H200 (4.15 TB/s copy bandwidth): an M=1 linear reads each weight byte once and
nothing else of size, so floor = 2 * N * K bytes / 4.15 TB/s (the 2 FLOPs per weight element are
nothing at 790 TFLOP/s):

=============================  ========================  ========  ==========================
row (Qwen3-30B-A3B role)       weight bytes (bf16)       floor     F.linear measured before
=============================  ========================  ========  ==========================
N=5120 K=2048 (qkv_proj)       21.0 MB                   5.05 us
N=2048 K=4096 (o_proj)         16.8 MB                   4.04 us
N=8192 K=8192                  134.2 MB                  32.3 us   33.7 us (graph-timed)
N=151936 K=2048 (lm_head)      622.3 MB                  149.8 us
=============================  ========================  ========  ==========================

Small weights (<= ~2 MB) are launch-latency bound (~2-3 us per kernel in a graph). cuBLAS measured
at M=1 before this suite: N=1536 K=2048 8.27 us (760 GB/s), N=2048 K=768 4.34 us, 4096^2 13.4 us.
The ember GEMV reached 83% of the floor at 8192^2 in fp8 (19.5 us); bf16 runs the same rule in bytes,
so ~80% is the expectation, e.g. qkv ~6.3 us and o_proj ~5 us.

Each row times both in the same run (graph replays, weights rotated past L2); ``sweep`` times GEMV
tuning candidates on the GPU.
"""
from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

import ember
from ember import _dispatch
from ember.bench import BenchContext, Row, _timing

COPY_BW_GBPS = 4155.0  # measured on the H200 (GUIDE section 6)
SHAPES = [(5120, 2048), (2048, 4096), (8192, 8192), (151936, 2048)]
QUICK_SHAPES = [(512, 256), (256, 512)]
TARGET = 1.2  # informational: >= 1.2x F.linear


def _sets(N, K, ctx):
    return _timing.copies_to_exceed_l2(2 * N * K) if ctx.on_gpu else 1


def _operands(N, K, sets, device):
    ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * K ** -0.5 for _ in range(sets)]
    xs = [torch.randn(1, K, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    return ws, xs


def run(ctx: BenchContext) -> list[Row]:
    rows = []
    for N, K in (QUICK_SHAPES if ctx.quick else SHAPES):
        ctx.progress(f"linear bf16 M=1 N={N} K={K}")
        ws, xs = _operands(N, K, _sets(N, K, ctx), ctx.device)
        t_ember = ctx.time_us([lambda w=w, x=x: ember.ops.linear(x, w) for w, x in zip(ws, xs)])
        t_torch = ctx.time_us([lambda w=w, x=x: F.linear(x, w) for w, x in zip(ws, xs)])
        del ws, xs
        floor = 2 * N * K / COPY_BW_GBPS / 1e3
        extra = {"floor_us": floor, "fraction_of_floor": floor / t_ember,
                 "baseline_fraction_of_floor": floor / t_torch, "achieved_GBps": 2 * N * K / t_ember / 1e3}
        if ctx.on_gpu:
            extra["config"] = str(_dispatch.kernels("gemv").one_row_config(N, K, torch.bfloat16, ctx.device))
        else:
            extra["mode"] = "CPU quick run: both sides are F.linear (the GEMV runs on CUDA only)"
        rows.append(Row(f"linear_bf16_M1_N{N}_K{K}", "us", t_ember, t_torch, "bf16 F.linear (cuBLAS, M=1)",
                        target=f">= {TARGET}x F.linear (informational)",
                        meets=t_torch / t_ember >= TARGET if ctx.on_gpu else None, extra=extra))
    return rows


# ----------------------------------------------------------------------------- tuning sweep
def sweep(path: str | None = None, budget_s: float = 110.0, dtype: torch.dtype = torch.bfloat16,
          shapes: list[tuple[int, int]] | None = None) -> dict:
    """Time the GEMV's tuning candidates (``gemv.candidates``) on the suite's shapes (run on the GPU);
    prints and returns the best entries per shape with F.linear for comparison."""
    k = _dispatch.kernels("gemv")
    dev = torch.device("cuda")
    t0 = time.time()
    results = {}
    for N, K in shapes or SHAPES + [(1536, 2048), (2048, 768), (4096, 4096), (128, 2048)]:
        sets = _timing.copies_to_exceed_l2(N * K * torch.empty((), dtype=dtype).element_size())
        ws = [torch.randn(N, K, device=dev).to(dtype) for _ in range(sets)]
        xs = [torch.randn(1, K, device=dev).to(dtype) for _ in range(sets)]
        table = [(_timing.graph_time_us([lambda w=w, x=x: F.linear(x, w) for w, x in zip(ws, xs)], replays=10),
                  "F.linear")]
        elsize = ws[0].element_size()
        for entry in k.candidates(N, K, elsize):
            if time.time() - t0 > budget_s:
                break
            conf = k.entry_config(entry, elsize)
            calls = [lambda w_=w_, x=x, conf=conf: k.linear(x, w_, None, config=conf) for w_, x in zip(ws, xs)]
            try:
                table.append((_timing.graph_time_us(calls, replays=10), entry))
            except Exception as e:  # a config that does not compile is skipped
                table.append((float("inf"), dict(entry, error=type(e).__name__)))
        table.sort(key=lambda r: r[0])
        key = k.key(dtype, N, K)
        results[key] = table[:8]
        print(key, "floor_us", round(N * K * elsize / COPY_BW_GBPS / 1e3, 2),
              "default", k.tile(N, K, dtype, dev), "best", table[:5], flush=True)
        del ws, xs
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results
