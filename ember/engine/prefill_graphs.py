"""CUDA graphs of a prompt's first prefill chunk, one per padded chunk length, shared by every cache row.

Eager prefill is bound by the host's kernel launches (~1 ms a layer on the H200's host whatever the
length: Qwen3-30B-A3B's 48 layers take ~45 ms to issue, while 1,024 tokens take ~18 ms on the GPU),
so a short prompt's time to first token is launch overhead. A graph is captured per length, not per
(row, length): the chunk runs into a one-row staging cache of its own, and the graph ends by copying
the chunk's k / v into the request's row, chosen by a device index (one copy a cache tensor, ~100 MB
for 1,024 tokens of Qwen3-30B-A3B, ~25 us). Later chunks of a long prompt (after a cached prefix)
stay eager: their attention reads a prefix whose length varies.

Hybrid models are captured too: their conv / recurrent states run in the staging caches (zeroed by
the chunk, as a fresh prompt starts) and stop at the last real token (the mixers' ``last_index``), and
the graph copies them into the row whole. Not under tensor parallelism (collectives stay out of graphs).
"""
from __future__ import annotations

import time
import warnings

import torch


class PrefillGraph:
    """One captured first chunk of ``length`` tokens: ``run(row, ids)`` -> logits [1, V] at the last
    real token (a static buffer, overwritten by the next run of this graph)."""

    def __init__(self, model, length: int, staging, pool):
        dev = model.device
        self.length = length
        self._staging = staging  # held: the graph writes these addresses
        self._ids = torch.zeros(1, length, dtype=torch.int64, device=dev)
        self._last = torch.full((1,), length - 1, dtype=torch.int64, device=dev)
        self._row = torch.zeros(1, dtype=torch.int64, device=dev)
        current = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # a warm run first (allocations, any compile), as decode captures do
            staged_prefill(model, staging, self._ids, self._last, self._row, length)
        current.wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=pool):
            self._logits = staged_prefill(model, staging, self._ids, self._last, self._row, length)

    def run(self, row: int, ids: list[int]) -> torch.Tensor:
        n = len(ids)
        if not 0 < n <= self.length:
            raise ValueError(f"ids: expected 1..{self.length} tokens for this graph, got {n}")
        self._ids.copy_(torch.tensor([ids + [0] * (self.length - n)], dtype=torch.int64), non_blocking=True)
        self._last.fill_(n - 1)
        self._row.fill_(row)
        self._graph.replay()
        return self._logits


def staged_prefill(model, staging, ids: torch.Tensor, last: torch.Tensor, row: torch.Tensor,
                   length: int) -> torch.Tensor:
    """Prefill ``ids`` [1, length] (positions 0..length-1) into ``staging`` (one-row caches), copy the
    k / v of those positions into cache row ``row`` (int64 [1] on the device) and return logits [1, V]
    at index ``last``: what a prefill graph runs, and the same as ``Model._prefill_chunk(row, ids, 0,
    length)`` writes and returns."""
    logits = model.net.prefill(ids, staging, last_index=last)
    for block, layer, staged in zip(model.net.layers, model.caches, staging):
        recurrent = getattr(block.attn, "recurrent", False)
        for cache, s in zip(layer, staged):
            if recurrent:  # a conv / recurrent state: the whole of it
                cache.index_copy_(0, row, s)
            else:  # [B, KVH, S, D] <- [1, KVH, >= length, D]
                cache[:, :, :length].index_copy_(0, row, s[:, :, :length])
    return logits


def can_capture(model) -> bool:
    """Whether ``model``'s first prefill chunks can run as graphs (see the module doc)."""
    from ember.engine import _tensor_parallel
    return model.use_cuda_graph and not _tensor_parallel()


def capture(model, lengths) -> float:
    """Capture a :class:`PrefillGraph` for each chunk length not yet captured (longest first, one
    memory pool for all: they never run at once); seconds. Run while no request is in flight."""
    if not can_capture(model):
        return 0.0
    todo = sorted({n for n in lengths if n <= model.max_seq_len and n not in model._prefill_graphs}, reverse=True)
    if not todo:
        return 0.0
    t0 = time.perf_counter()
    if model._prefill_pool is None:
        model._prefill_pool = torch.cuda.graph_pool_handle()
    # one staging cache for this batch of lengths, sized by the longest (graphs keep theirs alive)
    staging = model.net.allocate_caches(1, todo[0], model.dtype, model.device)
    try:
        with torch.no_grad():
            for n in todo:
                model._prefill_graphs[n] = PrefillGraph(model, n, staging, model._prefill_pool)
        torch.cuda.synchronize(model.device)
    except Exception as e:  # a capture this stack refuses: prefill stays eager (slower, same results)
        model._prefill_graphs.clear()
        warnings.warn(f"prefill CUDA graphs not captured ({type(e).__name__}: {str(e)[:200]}); prefill runs eager")
    seconds = time.perf_counter() - t0
    model.capture_s += seconds
    return seconds
