"""Timing as GUIDE section 4 prescribes: CUDA events around CUDA-graph replays, median of >= 20
replays after warm-up, inputs rotated so data larger than L2 (60 MB on the H200) is not cached."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

L2_BYTES = 60 * 1024 * 1024
H200_COPY_GBS = 4155.0  # GUIDE section 6; the figure bandwidth rows are judged by off the GPU
_copy_gbs: dict[str, float] = {}


def copies_to_exceed_l2(bytes_per_set: int, minimum: int = 1) -> int:
    """How many input sets to rotate through so a pass over them is > 2x the L2 cache."""
    return max(minimum, -(-2 * L2_BYTES // max(1, bytes_per_set)))


def copy_bandwidth_gbs(device: torch.device) -> float:
    """The device's copy bandwidth measured now (GB/s read + written by ``dst.copy_(src)`` of 1 GiB,
    median of 20 CUDA-event timings), so a "fraction of copy bandwidth" row is judged by the GPU it
    ran on; the H200's figure off the GPU (where such rows judge nothing).

    Example:
        >>> copy_bandwidth_gbs(torch.device("cuda"))  # ~4,150 on an H200
    """
    if device.type != "cuda":
        return H200_COPY_GBS
    key = str(torch.cuda.get_device_name(device))
    if key not in _copy_gbs:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        us = event_time_us([lambda: dst.copy_(src)], iters=20, warmup=3)
        _copy_gbs[key] = 2 * src.numel() / us / 1e3
        del src, dst
    return _copy_gbs[key]


def graph_time_us(calls: Sequence[Callable[[], object]], *, replays: int = 25, calls_per_graph: int | None = None) -> float:
    """Median time of one call, from CUDA events around replays of a graph of many calls.

    ``calls`` are closures over distinct input sets; the graph cycles through them so successive
    calls never hit data the previous one left in L2.
    """
    n = calls_per_graph or max(len(calls), 20)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles kernels, autotunes) outside capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / n)
    del graph
    return statistics.median(times)


def event_time_us(calls: Sequence[Callable[[], object]], *, iters: int = 200, warmup: int = 20) -> float:
    """Median per-call time from CUDA events around single eager calls (launch overhead included)."""
    for i in range(warmup):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def host_time_us(calls: Sequence[Callable[[], object]], *, iters: int = 20, warmup: int = 2) -> float:
    """Median wall time per call on the host (CPU quick mode; syncs CUDA if present)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(warmup):
        calls[i % len(calls)]()
    times = []
    for i in range(iters):
        sync()
        t0 = time.perf_counter()
        calls[i % len(calls)]()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def timed_with_peak(fn, device) -> tuple[object, float, float, float]:
    """One call of ``fn`` under no_grad, wall clock around a synchronised call: (result, seconds, peak GB
    allocated, peak GB reserved by the caching allocator), both above what was allocated before the
    call (NaN off CUDA). Reserved also counts what the allocator holds unused, such as a CUDA graph's
    pool between replays."""
    import time
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if not cuda:
        return out, seconds, float("nan"), float("nan")
    return (out, seconds, (torch.cuda.max_memory_allocated() - base) / 1e9,
            (torch.cuda.max_memory_reserved() - base) / 1e9)


def triton_compile_timer():
    """Install Triton hooks that time each kernel variant's compile (between Triton's cache and
    post-compile hooks: compiling, or reading its on-disk cache); returns the list they fill with
    (kernel name, seconds) and a function that removes them.

    Example:
        >>> compiles, remove = triton_compile_timer()
        >>> try:
        ...     run_something()
        ... finally:
        ...     remove()
    """
    import threading
    from triton import knobs
    done, started = [], {}

    # keyed by thread as well: warm-up compiles from a pool of threads, a thread compiles one variant
    # at a time, and ``repr`` names the argument types only, so two variants of one kernel that differ
    # in their constexprs share it (keyed by repr alone, one overwrote the other's start and was lost)
    def pre(*, repr, **_):
        started[threading.get_ident(), repr] = time.perf_counter()
        return False  # never skip the compile

    def post(*, repr, **_):
        t0 = started.pop((threading.get_ident(), repr), None)
        if t0 is not None:
            done.append((repr.split("[", 1)[0], time.perf_counter() - t0))

    old = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = pre, post

    def remove():
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = old
    return done, remove


def triton_cache_log():
    """Install a Triton compilation listener that records, for every kernel variant this process
    builds, whether Triton's on-disk cache had it; returns the list it fills and a function that
    removes it (and puts back any listener before it). Each entry: ``kernel``, ``hit``, ``hash`` (the
    cache key), ``fn_key`` (the kernel source's own key), ``spec`` (signature, constexprs and
    specialization attributes as text): a second process over the same cache that misses a variant
    the first one built with the same ``spec`` has a cache key that differs between processes.

    Example:
        >>> log, remove = triton_cache_log()
        >>> try:
        ...     run_something()
        ... finally:
        ...     remove()
        >>> [e["kernel"] for e in log if not e["hit"]]   # what was compiled, not loaded
    """
    import threading
    from triton import knobs
    log, lock = [], threading.Lock()
    before = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        fn = getattr(src, "fn", None)
        spec = (f"{sorted(getattr(src, 'signature', {}).items())} {sorted(getattr(src, 'constants', {}).items())} "
                f"{getattr(src, 'attrs', '')}")
        with lock:
            log.append({"kernel": getattr(src, "name", "?"), "hit": bool(cache_hit), "hash": metadata.get("hash"),
                        "fn_key": getattr(fn, "cache_key", None), "spec": spec})

    knobs.compilation.listener = listener

    def remove():
        knobs.compilation.listener = before
    return log, remove


def cache_misses_explained(first: list[dict], second: list[dict]) -> dict:
    """What a second process over the cache the first one filled (``triton_cache_log`` entries of each)
    compiled again: ``misses`` (count), ``new_variants`` (kernels whose specialization the first
    process never built: a different warm-up), ``same_spec_other_key`` (built by the first with the
    same signature, constexprs and attributes under another cache key: the key is not stable across
    processes; with whether the kernel source's own key differed)."""
    built = {}
    for e in first:
        built.setdefault((e["kernel"], e["spec"]), e)
    new, unstable = [], []
    for e in second:
        if e["hit"]:
            continue
        seen = built.get((e["kernel"], e["spec"]))
        if seen is None:
            new.append(e["kernel"])
        else:
            unstable.append({"kernel": e["kernel"], "source_key_differs": seen["fn_key"] != e["fn_key"],
                             "spec": e["spec"][:600]})
    return {"misses": sum(not e["hit"] for e in second), "new_variants": sorted(new),
            "same_spec_other_key": unstable[:20]}
