"""Warm-up to the first token, cold and warm, for the bf16 b1 row of ``ember bench moe``.

Each measurement is a fresh process (``python -m ember.bench._first_token``), so nothing compiled
earlier in the suite's process helps it: the process builds Qwen3-30B-A3B with random weights (not
timed: no checkpoint is read), then times ``model.warmup()`` plus the first request's first token
(``generate`` of one new token) by the wall clock. Two runs share one fresh Triton cache folder
(``triton.knobs.cache.dir``, set before anything compiles):
the first compiles every kernel variant into the empty cache (``cold``), the second finds them there
(``warm``). Each run also reports what its Triton compiles took (the time between Triton's
``jit_cache_hook`` and ``jit_post_compile_hook`` per kernel variant: compiling, or reading the
on-disk cache when it is warm), the slowest variants by name, and the seconds spent capturing CUDA
graphs (``Model.capture_s``), and how many variants Triton loaded from its cache (``cache_hits``) or
compiled (``cache_misses``); the warm run's ``recompiled`` says what it compiled again and whether the
cold run had built the same specialization under another cache key (``_timing.cache_misses_explained``).
Warm-up compiles from a pool of threads (``Model._compile_ahead``), so
``compile_s``, the sum over variants, can exceed the wall clock it overlapped.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import torch

from ember.bench import _timing


def measure(quick: bool, device: torch.device, prompt_len: int, max_seq_len: int,
            triton_cache: str | None = None) -> dict:
    """In this process: build the model, then time warm-up + the first token (see the module doc);
    ``triton_cache``: the Triton cache folder to compile into (before the first compile)."""
    from ember.bench.moe import ember_from_hf, make_hf
    if triton_cache is not None and device.type == "cuda":  # (nothing compiles on the CPU path)
        from triton import knobs
        knobs.cache.dir = triton_cache
    hf, cfg = make_hf(quick, device)
    model = ember_from_hf(hf, cfg, max_seq_len=max_seq_len)
    del hf
    cuda = device.type == "cuda"
    compiles, remove = _timing.triton_compile_timer() if cuda else ([], lambda: None)
    cache_log, remove_log = _timing.triton_cache_log() if cuda else ([], lambda: None)
    try:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        warm = model.warmup()
        out = model.generate([list(range(100, 100 + prompt_len))], max_new_tokens=1)
        if cuda:
            torch.cuda.synchronize(device)
        first_token_s = time.perf_counter() - t0
    finally:
        remove()
        remove_log()
    per_kernel: dict[str, float] = {}
    for name, s in compiles:
        per_kernel[name] = per_kernel.get(name, 0.0) + s
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:8]
    return {"first_token_s": first_token_s, "warmup_s": warm, "capture_s": model.capture_s,
            "compile_s": sum(s for _, s in compiles), "compiles": len(compiles),
            "slowest_kernels_s": {k: round(v, 3) for k, v in top}, "tokens": len(out[0]),
            "cache_hits": sum(e["hit"] for e in cache_log), "cache_misses": sum(not e["hit"] for e in cache_log),
            "cache_log": cache_log}


def cold_and_warm(quick: bool, device: torch.device, prompt_len: int, max_seq_len: int,
                  timeout: float = 420) -> dict:
    """Two fresh processes over one new Triton cache: {"cold": {...}, "warm": {...}} (``measure``'s
    figures), or {"error": ...} if a run failed."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="ember-triton-cache-") as cache:
        spec = json.dumps({"quick": quick, "device": str(device), "prompt_len": prompt_len,
                           "max_seq_len": max_seq_len, "triton_cache": cache})
        for name in ("cold", "warm"):
            try:
                r = subprocess.run([sys.executable, "-m", "ember.bench._first_token"], input=spec,
                                   capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return {"error": f"{name} run passed its {timeout:.0f} s limit"}
            if r.returncode != 0:
                return {"error": f"{name} run failed: {r.stderr[-1500:]}"}
            out[name] = json.loads(r.stdout.strip().splitlines()[-1])
            # a failed compile-ahead only warns: keep what the run warned about
            out[name]["warnings"] = [line[:300] for line in r.stderr.splitlines() if "Warning" in line][:10]
    # the warm run should load every variant the cold one built: say what it compiled again and why
    out["warm"]["recompiled"] = _timing.cache_misses_explained(out["cold"].pop("cache_log"),
                                                               out["warm"].pop("cache_log"))
    return out


if __name__ == "__main__":  # one measurement: the spec on stdin, the figures as the last stdout line
    s = json.loads(sys.stdin.read())
    print(json.dumps(measure(s["quick"], torch.device(s["device"]), s["prompt_len"], s["max_seq_len"],
                             s["triton_cache"])))
