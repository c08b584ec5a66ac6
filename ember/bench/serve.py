"""``ember bench serve``: ``ember serve`` (``ember.serve.app`` under uvicorn, in this process, on a
loopback port) driven by a load generator in a subprocess (httpx, streamed completions, one
timestamp per token as the client receives it). Qwen3-30B-A3B with random weights built on the GPU,
bf16, token-id prompts, greedy, no EOS (every request runs to max_tokens). Two engine models share
the one net, each with the cache its rows need (32 slots of 1,288 tokens for c1 / c8 / c32, then 9
of 8,264 for the interference row): one cache of 32 x 8,264 tokens (26 GB) beside the 61 GB of
weights does not fit an 80 GB card.

Rows (issue 33), each with TTFT and per-token latency p50 / p99 (client side) and peak GPU memory:
  * ``serve_c1``: one stream, 1,024-token prompts, 256 new tokens. ``ember``: its decode rate
    ((tokens - 1) / (last - first token)); ``baseline``: the engine's own batch-1 step (a replay of
    the decode graph the scheduler runs, CUDA events) as tok/s in the same run. Target: >= 400 tok/s,
    within 10 % of the engine, and TTFT <= 50 ms.
  * ``serve_c8`` / ``serve_c32``: that many clients, each sending 512-token prompts for 256 tokens
    back to back, the clients' starts staggered; ``ember``: the aggregate rate while all clients are
    active (tokens received between the last client's first token and the first client's last,
    over that time). ``baseline``: the uniform-routing bandwidth bound at that concurrency: per step,
    every layer's attention weights, router, and E * (1 - (1 - k/E)^B) distinct experts (B tokens
    routed uniformly to k of E experts), plus the lm_head, plus the KV cache of B rows at the mean
    context (prompt + half the output), all at the copy bandwidth measured in the run (4.155 TB/s
    on an H200); B tokens per step. Target: >= 70 %.
  * ``serve_interference``: 8 streams decoding (512-token prompts, 512 new tokens) when an
    8,192-token prompt arrives; ``ember``: the 8 streams' per-token latency p99 over its median, over
    the gaps after every stream has its first token. Target: <= 2. The row also records the gaps
    the long prompt's chunks stalled and the longest of them.

``--quick`` (CPU): a tiny random Qwen3-MoE, short prompts, C = 1 / 2 / 4; the bounds are GPU figures,
so quick rows judge nothing.
"""
from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

from ember.bench import BenchContext, Row, _timing
from ember.bench.moe import step_bytes


# ----------------------------------------------------------------------------- the load generator (subprocess)
async def _client(http, url: str, model: str, spec: dict, t0: float, out: list) -> None:
    await asyncio.sleep(spec["start"])
    for r in spec["requests"]:
        body = {"model": model, "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        sent, stamps, usage = time.perf_counter() - t0, [], None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    stamps.append(now)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        out.append({"client": spec["id"], "sent": sent, "tokens": stamps, "usage": usage})


async def _load(plan: dict) -> list[dict]:
    import httpx
    out: list[dict] = []
    limits = httpx.Limits(max_connections=len(plan["clients"]) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(http, plan["url"], plan["model"], c, t0, out) for c in plan["clients"]))
    return out


def drive(url: str, model: str, clients: list[dict]) -> list[dict]:
    """Run ``clients`` (``{"id", "start" s, "requests": [{"prompt", "max_tokens"}]}``) from a subprocess
    (its own interpreter: the client's parsing does not share this process's GIL with the server)."""
    plan = json.dumps({"url": url, "model": model, "clients": clients})
    r = subprocess.run([sys.executable, "-m", "ember.bench.serve"], input=plan, capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"load generator failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout)


# ----------------------------------------------------------------------------- the server (this process)
class _Served:
    """``ember.serve.app(model)`` under uvicorn in a background thread on a free loopback port."""

    def __init__(self, model):
        import uvicorn
        import ember.serve
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.name = f"http://127.0.0.1:{port}", "bench"
        app = ember.serve.app(model, model_name=self.name)
        self.prefill_chunk = app.state.server.scheduler.prefill_chunk
        cfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        t0 = time.perf_counter()
        self.thread.start()
        while not self.server.started:  # warm-up (every decode graph) runs in the app's startup
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            time.sleep(0.05)
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)


# ----------------------------------------------------------------------------- figures
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def latency_stats(results: list[dict]) -> dict:
    ttft = [r["tokens"][0] - r["sent"] for r in results if r["tokens"]]
    gaps = [b - a for r in results for a, b in zip(r["tokens"], r["tokens"][1:])]
    ms = lambda v: None if v is None else v * 1e3  # noqa: E731
    return {"ttft_p50_ms": ms(_pct(ttft, 0.5)), "ttft_p99_ms": ms(_pct(ttft, 0.99)),
            "tpot_p50_ms": ms(_pct(gaps, 0.5)), "tpot_p99_ms": ms(_pct(gaps, 0.99))}


def _prompts(gen, n: int, length: int, vocab: int) -> list[list[int]]:
    return torch.randint(100, min(vocab, 20000), (n, length), generator=gen).tolist()


def _peak_gb(ctx) -> float | None:
    return torch.cuda.max_memory_allocated(ctx.device) / 1e9 if ctx.on_gpu else None


# ----------------------------------------------------------------------------- the suite
def run(ctx: BenchContext) -> list[Row]:
    import gc

    from ember.bench.moe import ember_from_hf, graph_step_ms, make_hf
    quick = ctx.quick or not ctx.on_gpu
    S = dict(c1_prompt=64, c1_new=16, c_prompt=32, c_new=16, conc=(2, 4), long=256, int_new=48, streams=2) if quick \
        else dict(c1_prompt=1024, c1_new=256, c_prompt=512, c_new=256, conc=(8, 32), long=8192, int_new=512, streams=8)
    copy_bw = _timing.copy_bandwidth_gbs(ctx.device) * 1e9
    ctx.progress("building the model")
    hf, cfg = make_hf(quick, ctx.device)
    short_len = max(S["c1_prompt"] + S["c1_new"], S["c_prompt"] + S["c_new"]) + 8
    long_len = max(S["long"] + 64, S["c_prompt"] + S["int_new"]) + 8
    model = ember_from_hf(hf, cfg, max_seq_len=short_len, max_batch_size=max(S["conc"]), table_len=long_len)
    del hf  # the net holds what it needs
    gen = torch.Generator().manual_seed(0)
    V = cfg.vocab_size
    rows = []
    with _Served(model) as srv:
        ctx.progress(f"server up ({srv.startup_s:.1f} s with warm-up); c1")
        drive(srv.url, srv.name, [{"id": 0, "start": 0, "requests": [
            {"prompt": p, "max_tokens": 8} for p in _prompts(gen, 2, S["c1_prompt"], V)]}])  # first-request paths
        rows.append(_watched(ctx, model, _c1_row, ctx, srv, gen, V, S))
        for C in S["conc"]:
            ctx.progress(f"c{C}")
            rows.append(_watched(ctx, model, _concurrency_row, ctx, srv, model, gen, V, S, C, quick, copy_bw))
    if ctx.on_gpu:  # the engine's step, timed after the server stopped (the loop owns the GPU while it runs)
        step = graph_step_ms(model, 1)  # the batch-1 greedy graph the scheduler captured
        r = rows[0]
        r.baseline = 1e3 / step
        r.extra["engine_step_ms"] = step
        r.meets = r.meets is not False and r.ember >= 400 and r.ember >= 0.9 * r.baseline \
            and r.extra["ttft_p50_ms"] <= 50
    net, model, srv = model.net, None, None
    gc.collect()
    if ctx.on_gpu:
        torch.cuda.empty_cache()  # the short cache and its graphs before the long one
    ctx.progress("interference")
    model = ember_from_hf(None, cfg, max_seq_len=long_len, max_batch_size=S["streams"] + 1, net=net)
    with _Served(model) as srv:
        rows.append(_watched(ctx, model, _interference_row, ctx, srv, gen, V, S))
    for r in rows:
        r.extra["copy_bw_gbs"] = copy_bw / 1e9
        print("ROW " + json.dumps(r.as_dict()), flush=True)
    return rows


def _watched(ctx, model, row_fn, *args) -> Row:
    """``row_fn(*args)`` with what the server compiled and captured while it ran recorded in the row:
    after warm-up, no request may wait for a Triton compile or a graph capture (a row that saw one
    does not meet its target)."""
    compiles, remove = _timing.triton_compile_timer() if ctx.on_gpu else ([], lambda: None)
    capture0 = model.capture_s
    try:
        row = row_fn(*args)
    finally:
        remove()
    row.extra["triton_compiles"] = len(compiles)
    row.extra["compiled_kernels"] = sorted({name for name, _ in compiles})[:8]
    row.extra["graph_capture_s"] = model.capture_s - capture0
    if ctx.on_gpu and (compiles or model.capture_s > capture0):
        row.meets = False
    return row


def _c1_row(ctx, srv, gen, V, S) -> Row:
    if ctx.on_gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    res = drive(srv.url, srv.name, [{"id": 0, "start": 0, "requests": [
        {"prompt": p, "max_tokens": S["c1_new"]} for p in _prompts(gen, 3, S["c1_prompt"], V)]}])
    rates = [(len(r["tokens"]) - 1) / (r["tokens"][-1] - r["tokens"][0]) for r in res]
    extra = latency_stats(res) | {"prompt_tokens": S["c1_prompt"], "new_tokens": S["c1_new"],
                                  "per_request_tok_s": rates, "peak_gpu_memory_gb": _peak_gb(ctx)}
    return Row("serve_c1", "tok/s", statistics.median(rates), None,
               "the engine's batch-1 decode step (graph replay), same run", target=">= 400 tok/s, within 10 % of the "
               "engine, TTFT (1,024-token prompt) <= 50 ms", meets=None, extra=extra)


def _concurrency_row(ctx, srv, model, gen, V, S, C: int, quick: bool, copy_bw: float) -> Row:
    if ctx.on_gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    per_client, stagger = 3, 0.02 if not quick else 0.05
    clients = [{"id": j, "start": j * stagger, "requests": [{"prompt": p, "max_tokens": S["c_new"]} for p in
                                                             _prompts(gen, per_client, S["c_prompt"], V)]}
               for j in range(C)]
    res = drive(srv.url, srv.name, clients)
    by_client = {}
    for r in res:
        by_client.setdefault(r["client"], []).extend(r["tokens"])
    start = max(min(ts) for ts in by_client.values())   # every client has its first token
    end = min(max(ts) for ts in by_client.values())     # no client has finished yet
    n = sum(start <= t <= end for ts in by_client.values() for t in ts)
    agg = n / (end - start) if end > start else 0.0
    context = S["c_prompt"] + S["c_new"] / 2
    bound = C * copy_bw / step_bytes(model, C, context)
    extra = latency_stats(res) | {"window_s": end - start, "tokens_in_window": n, "clients": C,
                                  "requests": len(res), "mean_context": context,
                                  "bound_step_ms": step_bytes(model, C, context) / copy_bw * 1e3,
                                  "fraction_of_bound": None if quick else agg / bound,
                                  "peak_gpu_memory_gb": _peak_gb(ctx)}
    return Row(f"serve_c{C}", "tok/s", agg, None if quick else bound,
               f"uniform-routing bandwidth bound at {C} streams (copy bandwidth)", target=">= 70 % of the bound",
               meets=None if quick else agg >= 0.7 * bound, extra=extra)


def _interference_row(ctx, srv, gen, V, S) -> Row:
    if ctx.on_gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    n = S["streams"]
    streams = [{"id": j, "start": 0.01 * j, "requests": [{"prompt": p, "max_tokens": S["int_new"]}]}
               for j, p in enumerate(_prompts(gen, n, S["c_prompt"], V))]
    arrive = 0.05 if ctx.quick or not ctx.on_gpu else 1.0  # the streams are decoding by then
    long = {"id": n, "start": arrive, "requests": [{"prompt": _prompts(gen, 1, S["long"], V)[0], "max_tokens": 4}]}
    res = drive(srv.url, srv.name, streams + [long])
    decoding = [r for r in res if r["client"] < n]
    # "while 8 streams decode": the gaps from the moment the last stream has its first token (the
    # streams' own staggered prefills before that are not the interference measured here)
    all_in = max(r["tokens"][0] for r in decoding)
    gaps = [b - a for r in decoding for a, b in zip(r["tokens"], r["tokens"][1:]) if a >= all_in]
    p50, p99 = _pct(gaps, 0.5), _pct(gaps, 0.99)
    big = next(r for r in res if r["client"] == n)
    # the gaps that end while the long prompt prefills (a gap that spans the whole prefill ends after it)
    during = [b - a for r in decoding for a, b in zip(r["tokens"], r["tokens"][1:])
              if big["sent"] <= b and a <= big["tokens"][0]]
    ratio = p99 / p50 if p50 else 0.0
    extra = latency_stats(decoding) | {"long_prompt_tokens": S["long"], "long_ttft_ms": (big["tokens"][0] - big["sent"]) * 1e3,
                                       "gap_p50_ms": p50 * 1e3 if p50 else None, "gap_p99_ms": p99 * 1e3 if p99 else None,
                                       "gaps": len(gaps), "gaps_during_long_prefill": len(during),
                                       "max_gap_during_long_prefill_ms": max(during) * 1e3 if during else None,
                                       "gap_p50_during_long_prefill_ms": _pct(during, 0.5) * 1e3 if during else None,
                                       "prefill_chunk": srv.prefill_chunk,
                                       "streams": n, "peak_gpu_memory_gb": _peak_gb(ctx)}
    return Row("serve_interference", "x", ratio, None, "", target="p99 / median per-token latency <= 2",
               meets=None if ctx.quick or not ctx.on_gpu else ratio <= 2.0, extra=extra)


if __name__ == "__main__":  # the load generator: a plan on stdin, the per-request timings on stdout
    print(json.dumps(asyncio.run(_load(json.loads(sys.stdin.read())))))
