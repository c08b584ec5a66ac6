"""``ember bench sampling``: softmax, argmax and fused sampling against torch, in the same run.

Floors (H200: 4.15 TB/s copy bandwidth, ~2-3 us per dependent kernel launch inside a graph):
  * [1, 128256] fp32 is 513 KB: 0.12 us of HBM time, so one row is pure latency. softmax (one launch
    with a grid barrier for few rows) reads it once and writes it once; argmax (one launch, the last
    program of the row combines the chunks' slots) reads it once. Both launch with PDL. Measured
    (bench/results/h200/sampling_latency_probe.json): softmax 3.2 us, argmax 2.4-2.6 us, against 1.0 us
    for an empty 126-program kernel and 1.4 us for a 126-program load-and-reduce.
  * [256, 128256] fp32 softmax moves 131 MB in + 131 MB out = 263 MB -> 63 us at copy bandwidth.
    The two-launch kernel re-reads the input (394 MB; the second read hits L2 only for the rows read
    last): 107.6 us measured. The persistent one-launch kernel (per-row barriers, x read once):
    78.7-79.6 us, ~80% of copy bandwidth (``wave_sweep`` times its shapes; ember/kernels/sampling/
    softmax_kernels.py ``_softmax_waves_kernel`` has the table).
  * sample [1, 128256]: one launch (grid barrier) over 513 KB plus a sort of the candidates (a 64 or
    128 block when they fit, else 512) in one program; temperature alone races without the barrier.
    Top-p alone adds a barrier per round of the nucleus search (bench/results/h200/nucleus_probe.json
    has peaked to flat rows).
  * sample [8, 128256]: one launch as well (16 programs of 8192 a row); more rows with top-p alone
    walk them in waves in one persistent launch (many_rows_sample_probe.json).
"""
from __future__ import annotations

import torch

import ember
from ember import tuning
from ember.bench import BenchContext, Row, _timing

VOCAB = 128256


def hf_sample(logits, temperature=0.7, top_k=50, top_p=0.9):
    """What transformers' logits warpers + multinomial do: temperature, top-k (0: off), sort, cumsum,
    scatter."""
    scores = logits / temperature
    if top_k > 0:
        kth = torch.topk(scores, top_k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    sorted_logits, sorted_idx = torch.sort(scores, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)
    remove_sorted[..., -1:] = 0
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    scores = scores.masked_fill(remove, -float("inf"))
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)


def _time(ctx, calls) -> tuple[float, str]:
    """Graph-timed when the calls capture; event-timed otherwise (said in the row)."""
    if not ctx.on_gpu:
        return ctx.time_us(calls), "host"
    try:
        return ctx.time_us(calls), "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return _timing.event_time_us(calls), "events"


def _sets(ctx, shape):
    n = 1
    for s in shape:
        n *= s
    count = _timing.copies_to_exceed_l2(4 * n) if ctx.on_gpu else 2
    return [torch.randn(shape, device=ctx.device) * 3 for _ in range(count)]


def _sample_rows(ctx, data, seed, offset) -> list[Row]:
    """Informational rows: T 0.7 with top-k 50 + top-p 0.9, and with top-p 0.9 alone, over ``data``'s
    [B, V] sets, against the HF-style pipeline."""
    B, V = data[0].shape
    rows = []
    for name, kw in ((f"sample_t0.7_k50_p0.9_{B}x{V}", dict(top_k=50, top_p=0.9)),
                     (f"sample_t0.7_p0.9_{B}x{V}", dict(top_k=0, top_p=0.9))):
        e, _ = _time(ctx, [lambda x=x: ember.ops.sample(x, temperature=0.7, **kw, seed=seed, offset=offset, check=False)
                           for x in data])
        b, how = _time(ctx, [lambda x=x: hf_sample(x, **kw) for x in data])
        rows.append(Row(name, "us", e, b, f"HF-style torch pipeline ({how}-timed)", target="informational"))
    return rows


def _engine_rows(ctx, data) -> list[Row]:
    """The draw the decode graph runs (``engine.sample_step``: per-row tensors, per-row seeds that the
    sampler's kernel advances after the draw, the batch's ``every_row`` mode from ``sampling_mode``
    as the engine derives it) at one row, against the scalar call the rows above time."""
    from ember.engine import SamplingParams, every_row_promise, sample_step, sampling_mode
    dev, rows = ctx.device, []
    V = data[0].shape[1]
    for name, k, p, target in (("sample_engine_t0.7_k50_p0.9", 50, 0.9, 6.6), ("sample_engine_t0.7", 0, 1.0, 4.6)):
        every_row = every_row_promise(sampling_mode(SamplingParams(temperature=0.7, top_k=k, top_p=p), V))
        params = (torch.full((1,), 0.7, device=dev), torch.full((1,), k, dtype=torch.int64, device=dev),
                  torch.full((1,), p, device=dev), torch.zeros(1, device=dev))
        seed = torch.tensor([1234], device=dev)
        e, how = _time(ctx, [lambda x=x: sample_step(x, *params, seed, every_row=every_row) for x in data])
        scalar, _ = _time(ctx, [lambda x=x: ember.ops.sample(x, temperature=0.7, top_k=k, top_p=p, seed=seed,
                                                              check=False) for x in data])
        rows.append(Row(f"{name}_1x{V}", "us", e, scalar, f"ember.ops.sample with Python scalars ({how}-timed)",
                        target=f"<= {target} us", meets=e <= target if ctx.on_gpu else None,
                        extra={"every_row": every_row}))
    return rows


def run(ctx: BenchContext) -> list[Row]:
    V = VOCAB if not ctx.quick else 4096
    big = 256 if not ctx.quick else 8
    rows = []

    ctx.progress("softmax 1 row")
    data = _sets(ctx, (1, V))
    e, _ = _time(ctx, [lambda x=x: ember.ops.softmax(x) for x in data])
    b, _ = _time(ctx, [lambda x=x: torch.softmax(x, -1) for x in data])
    rows.append(Row(f"softmax_1x{V}_fp32", "us", e, b, "torch.softmax", target="<= 4 us and >= 8x torch.softmax",
                    meets=e <= 4.0 and b / e >= 8.0))
    e, _ = _time(ctx, [lambda x=x: ember.ops.log_softmax(x) for x in data])
    b, _ = _time(ctx, [lambda x=x: torch.log_softmax(x, -1) for x in data])
    rows.append(Row(f"log_softmax_1x{V}_fp32", "us", e, b, "torch.log_softmax", target="informational"))

    ctx.progress("argmax 1 row")
    e, _ = _time(ctx, [lambda x=x: ember.ops.argmax(x) for x in data])
    b, _ = _time(ctx, [lambda x=x: torch.argmax(x, -1) for x in data])
    rows.append(Row(f"argmax_1x{V}_fp32", "us", e, b, "torch.argmax", target="<= 4 us", meets=e <= 4.0))

    ctx.progress("sample 1 row")
    seed = torch.tensor([1234], device=ctx.device)
    offset = torch.zeros(1, dtype=torch.int64, device=ctx.device)
    kw = dict(temperature=0.7, top_k=50, top_p=0.9)
    e, _ = _time(ctx, [lambda x=x: ember.ops.sample(x, **kw, seed=seed, offset=offset, check=False) for x in data])
    b, how = _time(ctx, [lambda x=x: hf_sample(x) for x in data])
    rows.append(Row(f"sample_t0.7_k50_p0.9_1x{V}", "us", e, b, f"HF-style torch pipeline ({how}-timed)",
                    target="<= 15 us and >= 50x the HF-style pipeline", meets=e <= 15.0 and b / e >= 50.0))
    e, _ = _time(ctx, [lambda x=x: ember.ops.sample(x, temperature=0.7, top_p=0.9, seed=seed, offset=offset,
                                                    check=False) for x in data])
    b, how = _time(ctx, [lambda x=x: hf_sample(x, top_k=0) for x in data])
    rows.append(Row(f"sample_t0.7_p0.9_1x{V}", "us", e, b, f"HF-style torch pipeline, top-p alone ({how}-timed)",
                    target="informational"))
    e, _ = _time(ctx, [lambda x=x: ember.ops.sample(x, temperature=0.7, seed=seed, offset=offset, check=False)
                       for x in data])
    b, how = _time(ctx, [lambda x=x: torch.multinomial(torch.softmax(x / 0.7, -1), 1) for x in data])
    rows.append(Row(f"sample_t0.7_1x{V}", "us", e, b, f"torch softmax + multinomial ({how}-timed)",
                    target="informational"))
    rows += _engine_rows(ctx, data)
    del data

    ctx.progress("sample 8 rows")
    eight = 8 if not ctx.quick else 2
    data = _sets(ctx, (eight, V))
    rows += _sample_rows(ctx, data, seed, offset)
    del data

    ctx.progress("batch rows")
    data = _sets(ctx, (big, V))
    e, _ = _time(ctx, [lambda x=x: ember.ops.softmax(x) for x in data])
    b, _ = _time(ctx, [lambda x=x: torch.softmax(x, -1) for x in data])
    nbytes = 2 * 4 * big * V
    ge, gb = nbytes / e / 1e3, nbytes / b / 1e3
    copy = _timing.copy_bandwidth_gbs(ctx.device)  # this GPU's, measured now (an H100's is ~2,980)
    rows.append(Row(f"softmax_{big}x{V}_fp32", "GB/s", ge, gb, "torch.softmax",
                    target=">= 80% of the copy bandwidth measured in the run", meets=ge >= 0.8 * copy,
                    extra={"ember_us": e, "baseline_us": b, "fraction_of_copy_bw": ge / copy, "copy_bw_gbs": copy}))
    e, _ = _time(ctx, [lambda x=x: ember.ops.argmax(x) for x in data])
    b, _ = _time(ctx, [lambda x=x: torch.argmax(x, -1) for x in data])
    rows.append(Row(f"argmax_{big}x{V}_fp32", "us", e, b, "torch.argmax", target="informational"))
    bs = 64 if not ctx.quick else 4
    small = [x[:bs] for x in data]
    rows += _sample_rows(ctx, small, seed, offset)  # top-p alone: the persistent waves
    return rows


def sweep(path: str | None = None) -> dict:
    """Graph-timed [1, 128256] fp32 softmax / argmax / sample per split chunk floor (tuning key
    ``split``; on the GPU)."""
    import json
    dev = torch.device("cuda")
    xs = [torch.randn(1, 128256, device=dev) * 3 for _ in range(8)]
    ops = {"softmax": lambda x: ember.ops.softmax(x), "argmax": lambda x: ember.ops.argmax(x),
           "sample_k50_p0.9": lambda x: ember.ops.sample(x, temperature=0.7, top_k=50, top_p=0.9, seed=1, check=False)}
    results = {}
    for chunk in (1024, 2048, 4096, 8192):
        with tuning.override("sampling", {"split": {"min_chunk": chunk}}):
            results[chunk] = {name: _timing.graph_time_us([lambda x=x, f=f: f(x) for x in xs]) for name, f in ops.items()}
        print(chunk, {k: round(v, 2) for k, v in results[chunk].items()}, flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results


# "CHUNK,WARPS,PER_SM,PREFETCH" of the many-row softmax (tuning key ``softmax_waves``), the rule's
# first. Measured before (kernel docstring): 16384,16,1,0/1 and 8192,16,1,1 lose (one program per
# SM); 24 rows in flight per wave (8192,8,3,1, 4096,4,6,1: an 80-register cap) and 8 small programs
# per SM (2048,4,8,1, 64 registers) spill and lose (sampling_waves_lag_sweep.json).
WAVE_CONFIGS = ("16384,16,1,2", "8192,8,2,2", "8192,8,2,1", "8192,8,2,3", "4096,4,4,2", "4096,4,4,1", "8192,8,2,0",
                "8192,8,3,1", "4096,4,6,1", "2048,4,8,1")


def wave_entry(text: str) -> dict:
    """A ``softmax_waves`` tuning entry from "CHUNK,WARPS,PER_SM,PREFETCH"."""
    chunk, warps, per_sm, prefetch = (int(v) for v in text.split(","))
    return {"chunk": chunk, "warps": warps, "per_sm": per_sm, "prefetch": prefetch}


def wave_sweep(path: str | None = None, configs=WAVE_CONFIGS, shape=(256, VOCAB)) -> dict:
    """Graph-timed fp32 softmax of ``shape`` per ``softmax_waves`` entry ("CHUNK,WARPS,PER_SM,PREFETCH"),
    with the two-launch path and torch.softmax timed in the same run (on the GPU)."""
    import json

    from ember import _dispatch
    _dispatch.prepare_triton()
    from ember.kernels import sampling as k
    dev = torch.device("cuda")
    xs = [torch.randn(shape, device=dev) * 3 for _ in range(_timing.copies_to_exceed_l2(4 * shape[0] * shape[1]))]
    nbytes = 2 * 4 * shape[0] * shape[1]
    copy = _timing.copy_bandwidth_gbs(dev)
    ref = torch.softmax(xs[0].double(), -1)

    def line(name, us, extra=""):
        gbps = nbytes / us / 1e3
        print(f"{name:>16}: {us:8.2f} us  {gbps:7.0f} GB/s  {gbps / copy:5.1%} of copy{extra}", flush=True)
        return {"us": us, "GBps": gbps}

    def two_launch(x):
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        k.softmax_two_launch(x, out, 1.0, False)
        return out

    results = {}
    results["two_launch"] = line("two launches", _timing.graph_time_us([lambda x=x: two_launch(x) for x in xs]))
    results["torch"] = line("torch.softmax", _timing.graph_time_us([lambda x=x: torch.softmax(x, -1) for x in xs]))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for text in configs:
        give_ups = k.barrier_give_ups(dev)
        try:
            with tuning.override("sampling", {"softmax_waves": wave_entry(text)}):
                cfg = k.wave_config(dev)
                P, _, R = k.wave_plan(shape[0], shape[1], sms, cfg)
                out = torch.empty(shape, device=dev)
                compiled = k.softmax_waves(xs[0], out, 1.0, False, cfg, P, R)
                err = (out.double() - ref).abs().max().item()
                us = _timing.graph_time_us([lambda x=x: ember.ops.softmax(x) for x in xs])
            regs, spills = getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None)
            give_ups = k.barrier_give_ups(dev) - give_ups
            results[text] = line(text, us, f"  P={P} R={R} programs={R * P} regs={regs} spills={spills} "
                                           f"max|err|={err:.1e} give-ups={give_ups}")
            results[text].update(P=P, R=R, regs=regs, spills=spills, max_abs_err=err, give_ups=give_ups)
        except Exception as e:  # a config that fails to compile or run is reported, the sweep goes on
            print(f"{text:>16}: FAILED {type(e).__name__}: {e}", flush=True)
            results[text] = {"error": f"{type(e).__name__}: {e}"}
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results
