"""Where the microseconds of a [1, 128256] fp32 softmax / argmax go (H200, graph-timed).

Times, each on the inputs the bench rotates through (more than 2x L2):
  * floors: an empty kernel (1 and 126 programs) and a 126-program load-and-reduce, PDL off / on;
  * the one-launch softmax (grid barrier) per chunk size, warps, PDL, and barrier poll
    (``atomic_add(0)`` or an ``ld.acquire`` spin: the kernel's LD_POLL);
  * the one-launch argmax per chunk size, warps and PDL;
  * the public ops as they launch (softmax, argmax, sample), and with EMBER_SOFTMAX_ONE_LAUNCH=0.
sampling_latency_probe_run1.json is the first run, on the kernels before this probe (argmax then
folded every chunk into one slot with atomic_max; the ld.acquire poll was a copy of the kernel).
Every variant's output is checked against torch before it is timed.

    python bench/sampling_latency_probe.py [out.json]
"""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

import ember
from ember.bench import _timing, env_vars
from ember.kernels import sampling as ks
from ember.kernels._common import pdl_start

V = 128256


@triton.jit
def _empty_kernel(out_ptr, PDL: tl.constexpr):
    pdl_start(PDL)
    tl.store(out_ptr + tl.program_id(0), 1.0)


@triton.jit
def _load_sum_kernel(x_ptr, out_ptr, V, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    c = tl.program_id(0)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + cols, mask=cols < V, other=0.0)
    tl.store(out_ptr + c, tl.sum(x, axis=0))


def _inputs():
    n = _timing.copies_to_exceed_l2(4 * V)
    return [torch.randn(1, V, device="cuda") * 3 for _ in range(n)]


def main(path: str | None = None) -> dict:
    xs = _inputs()
    want_sm = torch.softmax(xs[0], -1)
    want_am = torch.argmax(xs[0], -1)
    res: dict = {"floors": {}, "softmax": {}, "argmax": {}}
    sink = torch.empty(256, device="cuda")
    for pdl in (False, True):
        for grid in (1, 126):
            res["floors"][f"empty_grid{grid}_pdl{int(pdl)}"] = _timing.graph_time_us(
                [lambda: _empty_kernel[(grid,)](sink, PDL=pdl, launch_pdl=pdl)])
        res["floors"][f"load_sum_126x1024_pdl{int(pdl)}"] = _timing.graph_time_us(
            [lambda x=x: _load_sum_kernel[(126,)](x, sink, V, CHUNK=1024, PDL=pdl, launch_pdl=pdl, num_warps=2)
             for x in xs])
    print("floors", {k: round(v, 2) for k, v in res["floors"].items()}, flush=True)

    barrier, count, _ = ks._workspace(torch.device("cuda"), 1)
    out = torch.empty(1, V, device="cuda")
    for chunk in (1024, 2048, 4096):
        P = triton.cdiv(V, chunk)
        PB = max(2, triton.next_power_of_2(P))
        part = torch.empty((2, 1, P), device="cuda")
        for warps in (2, 4, 8):
            for pdl in (False, True):
                for poll in ("atomic", "ld_acquire"):
                    def call(x, chunk=chunk, P=P, PB=PB, warps=warps, pdl=pdl, part=part, poll=poll):
                        ks._softmax_one_launch_kernel[(1, P)](
                            x, out, x.stride(0), out.stride(0), V, P, P, part[0], part[1], barrier, 1.0,
                            ks.SPIN_CAP, LOG=False, CHUNK=chunk, PB=PB, LD_POLL=poll == "ld_acquire", PDL=pdl,
                            launch_pdl=pdl, num_warps=warps)
                    key = f"chunk{chunk}_w{warps}_pdl{int(pdl)}_{poll}"
                    try:
                        call(xs[0])
                        err = (out - want_sm).abs().max().item()
                        t = _timing.graph_time_us([lambda x=x: call(x) for x in xs])
                        res["softmax"][key] = {"us": t, "max_err": err}
                        print("softmax", key, round(t, 3), f"{err:.1e}", flush=True)
                    except Exception as e:  # report and go on
                        res["softmax"][key] = {"error": repr(e)[:300]}
                        print("softmax", key, "ERROR", repr(e)[:300], flush=True)
    idx = torch.empty(1, dtype=torch.int64, device="cuda")
    for chunk in (1024, 2048, 4096, 8192):
        P = triton.cdiv(V, chunk)
        PB = max(2, triton.next_power_of_2(P))
        part = torch.empty((1, P), dtype=torch.int64, device="cuda")
        for warps in (2, 4, 8, 16):
            for pdl in (False, True):
                def call(x, chunk=chunk, P=P, PB=PB, warps=warps, pdl=pdl, part=part):
                    ks._argmax_split_kernel[(1, P)](x, idx, x.stride(0), V, P, part, count, CHUNK=chunk, PB=PB,
                                                    num_warps=warps, PDL=pdl, launch_pdl=pdl)
                key = f"chunk{chunk}_w{warps}_pdl{int(pdl)}"
                try:
                    call(xs[0])
                    ok = bool(idx.item() == want_am.item())
                    t = _timing.graph_time_us([lambda x=x: call(x) for x in xs])
                    res["argmax"][key] = {"us": t, "correct": ok}
                    print("argmax", key, round(t, 3), ok, flush=True)
                except Exception as e:
                    res["argmax"][key] = {"error": repr(e)[:300]}
                    print("argmax", key, "ERROR", repr(e)[:300], flush=True)
    kw = dict(temperature=0.7, top_k=50, top_p=0.9, seed=1, check=False)
    res["ops"] = {"softmax": _timing.graph_time_us([lambda x=x: ember.ops.softmax(x) for x in xs]),
                  "argmax": _timing.graph_time_us([lambda x=x: ember.ops.argmax(x) for x in xs]),
                  "sample_t0.7_k50_p0.9": _timing.graph_time_us([lambda x=x: ember.ops.sample(x, **kw) for x in xs]),
                  "sample_t0.7": _timing.graph_time_us([lambda x=x: ember.ops.sample(x, temperature=0.7, seed=1,
                                                                                      check=False) for x in xs])}
    with env_vars({"EMBER_SOFTMAX_ONE_LAUNCH": "0"}):  # the two-launch paths, for A/B
        res["ops_two_launch"] = {
            "softmax": _timing.graph_time_us([lambda x=x: ember.ops.softmax(x) for x in xs]),
            "sample_t0.7_k50_p0.9": _timing.graph_time_us([lambda x=x: ember.ops.sample(x, **kw) for x in xs]),
            "sample_t0.7": _timing.graph_time_us([lambda x=x: ember.ops.sample(x, temperature=0.7, seed=1,
                                                                                check=False) for x in xs])}
    print("ember.ops", {k: round(v, 2) for k, v in res["ops"].items()}, flush=True)
    print("two launches", {k: round(v, 2) for k, v in res["ops_two_launch"].items()}, flush=True)
    res["torch"] = {"softmax": _timing.graph_time_us([lambda x=x: torch.softmax(x, -1) for x in xs]),
                    "argmax": _timing.graph_time_us([lambda x=x: torch.argmax(x, -1) for x in xs])}
    print("torch", res["torch"], flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
