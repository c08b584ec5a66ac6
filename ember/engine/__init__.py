"""The decode engine: static KV cache, chunked prefill, a decode step captured in CUDA graphs per batch
bucket, sampling, stop handling, text in / text out; ``generate`` and ``stream`` are clients of the
continuous-batching scheduler (``ember.engine.scheduler``), which owns the loop.

One decode step is embedding -> every layer -> final norm -> lm_head -> argmax or ``ember.ops.sample``,
with the sampled token, positions and lengths written back into static device buffers, so a replay of
the captured graph is the whole step and the host only reads the new tokens (one step behind the GPU,
so the GPU never waits for Python). The cache rows are the scheduler's slots: a row whose request is
not decoding (free, or still prefilling) has ``_active`` 0, so the step leaves its position at the
scratch position ``max_seq_len - 1`` and its length at 1 (its writes land in its own row and its
outputs are ignored). Prefill runs eagerly, one chunk of one prompt at a time into that prompt's
cache row, at chunk lengths from a small fixed set that warm-up runs once each (why eager and not
captured: a capture costs 1.3-3.5 s per length on the H200, 15-40 eager prefills; an eager prefill
is host-bound, ~2.2 ms of Python and launches per layer at 2048 tokens). On CPU the same steps run
eagerly through the reference ops.

Example:
    >>> model = ember.load("Qwen3-30B-A3B")
    >>> model.generate(["Hello"], max_new_tokens=32, sampling=ember.SamplingParams(temperature=0))
    >>> for piece in model.stream("Once upon a time", max_new_tokens=64):
    ...     print(piece, end="", flush=True)
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import operator
import os
import random
import threading
import time
import warnings
from collections.abc import Iterator, Sequence

import torch

import ember.ops
from ember.ops.sampling import SEED_STEP, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


# Hopper-class bf16 tensor-core FLOPs per byte of HBM bandwidth (H200: 790 TFLOP/s over 4.155 TB/s)
RIDGE_FLOP_PER_BYTE = 190


def default_prefill_chunk(net, *, least: int = 512, most: int = 4096) -> int:
    """The prefill chunk length for ``net``: the smallest power of two (within [least, most]) at which a
    chunk's matmul time reaches the time to read the decoder's weights once.

    Below that length a chunk costs about one full weight read whatever its size, so shorter chunks
    only add stalls for the streams decoding between them. For a dense model every weight is active
    and the ridge is ~190 tokens (so ``least``); for an MoE it is ~190 x (all weight bytes / the
    bytes a token reads), over the decoder layers: Qwen3-30B-A3B's read 1 / 11 of their weights a
    token -> ~2,090 -> 4,096 (the chunk ``ember bench serve`` reports).

    Example:
        >>> default_prefill_chunk(model.net)
        4096
    """
    total = active = 0
    for layer in net.layers:
        for t in list(layer.parameters()) + list(layer.buffers()):
            n = t.numel() * t.element_size()
            total += n
            active += n
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "w_gate_up") and hasattr(mlp, "top_k"):
            experts = sum(t.numel() * t.element_size() for t in (mlp.w_gate_up, mlp.w_down))
            active -= experts * (1 - mlp.top_k / mlp.w_gate_up.shape[0])
    ridge = RIDGE_FLOP_PER_BYTE * total / max(active, 1)
    chunk = least
    while chunk < ridge and chunk < most:
        chunk *= 2
    return chunk


def _free_host_memory() -> int | None:
    """Bytes of host memory a new allocation can take (MemAvailable, capped by a cgroup limit), or
    None where neither /proc/meminfo nor sysconf says."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # a container's limit (cgroup v2) can be far below the host's free memory
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit != "max":
            used = int(open("/sys/fs/cgroup/memory.current").read())
            free = min(free, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return free


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _is_sequence(p) -> bool:
    return isinstance(p, (list, tuple)) or (isinstance(p, torch.Tensor) and p.dim() >= 1)


def _token_ids(i: int, p) -> list[int]:
    """One prompt's token ids as ints; anything that is not an integer is refused, never truncated."""
    if isinstance(p, torch.Tensor):
        if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool or p.dim() != 1:
            raise TypeError(f"prompts[{i}]: expected a 1-d tensor of integer token ids, got {p.dtype} "
                            f"{tuple(p.shape)}")
        return p.tolist()
    if not isinstance(p, (list, tuple)):
        raise TypeError(f"prompts[{i}]: expected a string or a list of token ids, got {type(p).__name__}")
    ids = []
    for j, t in enumerate(p):
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))  # ints, numpy ints, 0-d integer tensors; not floats
        except TypeError:
            raise TypeError(f"prompts[{i}]: expected integer token ids, got {type(t).__name__} {t!r} "
                            f"at position {j}") from None
    return ids


@dataclasses.dataclass
class Stats:
    """Timing of the last generate/stream call (what ``ember generate`` prints)."""
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0
    warmup_s: float = 0.0

    @property
    def prompt_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first new token comes from prefill; the decode loop made the rest
        return max(self.new_tokens - 1, 0) / self.decode_s if self.decode_s else 0.0


class Model:
    """A loaded model with its static KV cache; built by :func:`ember.load`.

    ``model(input_ids)`` is a cache-free forward ([B, T] -> logits [B, T, V]); ``generate`` and
    ``stream`` decode with the cache (CUDA graphs on GPU) through :attr:`scheduler`.
    """

    def __init__(self, net, config: dict, tokenizer, *, max_seq_len: int, max_batch_size: int,
                 eos_ids: Sequence[int] = (), fp8: bool = False, name: str = "model", prefill_chunk: int | None = None,
                 sampling_seed: int | None = None):
        self.net, self.config, self.tokenizer = net, config, tokenizer
        # Where a request without a seed gets one: the process's global ``random`` by default;
        # its own random.Random(sampling_seed) when given (ember.load passes one value broadcast from
        # rank 0 under tensor parallel, so every rank draws the same seeds and the same tokens).
        self.seed_source = random if sampling_seed is None else random.Random(sampling_seed)
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.fp8, self.name = fp8, name
        # the default scheduler's chunk length (None: derived from the model, default_prefill_chunk)
        self.prefill_chunk = default_prefill_chunk(net) if prefill_chunk is None else prefill_chunk
        self.eos_ids = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.device, self.dtype = net.embed.device, net.embed.dtype
        if self.device.type != "cuda":  # (ember.load checks GPU memory before loading)
            self._check_host_memory(net, max_batch_size, max_seq_len)
        # per layer: (k, v) for attention, the conv / recurrent state for hybrid mixers; batch first
        self.caches = net.allocate_caches(max_batch_size, max_seq_len, self.dtype, self.device)
        # State that a decode step advances in place (not append-only like a KV cache): the warm-up
        # steps before capture must not leave it changed. Mixers say so (``recurrent``); a hybrid's
        # attention layers keep KV caches, which are not cloned with it (GBs at long contexts).
        self._recurrent_state = [t for layer, cache in zip(net.layers, self.caches)
                                 if getattr(layer.attn, "recurrent", False) for t in cache]
        B, dev = max_batch_size, self.device
        # Static decode state: the CUDA graphs read and advance these in place. Rows start free.
        self._tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self._positions = torch.full((B,), max_seq_len - 1, dtype=torch.int64, device=dev)
        self._seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self._active = torch.zeros(B, dtype=torch.int64, device=dev)     # 1: the row's request is decoding
        self._active32 = torch.zeros(B, dtype=torch.int32, device=dev)   # the same, for the int32 lengths
        self._temperature = torch.zeros(B, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(B, dtype=torch.int64, device=dev)
        self._top_p = torch.ones(B, dtype=torch.float32, device=dev)
        self._min_p = torch.zeros(B, dtype=torch.float32, device=dev)
        # Per row, the sampler's seed for the row's next draw: the request's seed, advanced by
        # SEED_STEP after every draw (sample_step); a per-row seed is its row's whole key, so a row's
        # tokens do not depend on its slot or batch.
        self._seed = torch.zeros(B, dtype=torch.int64, device=dev)
        self._one_row = {"temperature": torch.zeros(1, dtype=torch.float32, device=dev),
                         "top_k": torch.zeros(1, dtype=torch.int64, device=dev),
                         "top_p": torch.ones(1, dtype=torch.float32, device=dev),
                         "min_p": torch.zeros(1, dtype=torch.float32, device=dev),
                         "seed": torch.zeros(1, dtype=torch.int64, device=dev)}  # see _first_token
        k = min(TOP_LOGPROBS, net.vocab_size)
        self._lp = torch.zeros(B, dtype=torch.float32, device=dev)                  # chosen token's logprob
        self._top_lp = torch.zeros(B, k, dtype=torch.float32, device=dev)           # top-k logprobs
        self._top_ids = torch.zeros(B, k, dtype=torch.int64, device=dev)
        # (batch, sampling mode, logprobs) -> graph; the mode is what every row of the step samples by
        # (sampling_mode), so the sampler takes its specialised path without reading the rows
        self._graphs: dict[tuple[int, str, bool], torch.cuda.CUDAGraph] = {}
        self._mode, self._logprobs = "greedy", False  # what _step computes (baked into a capture)
        # per row, the SamplingParams its parameter tensors hold (a request's, or a _conform_rows filler)
        self._row_params: list[SamplingParams] = [SamplingParams(temperature=0.0)] * B
        self._row_modes: list[str] = ["greedy"] * B  # sampling_mode of each row's _row_params
        self._argmax_fn = None
        self.use_cuda_graph = dev.type == "cuda"
        self.capture_s = 0.0  # seconds spent capturing decode and prefill graphs so far
        self._compiled: set[tuple[str, int]] = set()  # _compile_ahead's tasks run so far
        # a prompt's first prefill chunk as a CUDA graph per padded length (ember.engine.prefill_graphs)
        self._prefill_graphs: dict = {}  # padded length -> prefill_graphs.PrefillGraph
        self._prefill_pool = None
        self._scheduler = None
        self._scheduler_lock = threading.Lock()
        self.stats = Stats()

    def _check_host_memory(self, net, max_batch_size: int, max_seq_len: int) -> None:
        need = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                   for layer in net.cache_specs(max_batch_size, max_seq_len, self.dtype) for shape, dt in layer)
        free = _free_host_memory()
        if free is not None and need > free:
            raise MemoryError(f"not enough memory on {self.device} for the KV cache and recurrent state: need "
                              f"~{_size(need)} ({max_batch_size} x {max_seq_len} tokens), {_size(free)} free "
                              "(lower max_seq_len / max_batch_size)")

    @property
    def max_position_embeddings(self) -> int | None:
        """The longest sequence the checkpoint was trained for (config.json), when it says."""
        cfg = self.config
        v = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    # ------------------------------------------------------------------ cache-free forward
    @torch.no_grad()
    def __call__(self, input_ids) -> torch.Tensor:
        """Logits [B, T, V] of a full forward without the KV cache (positions 0..T-1)."""
        ids = torch.as_tensor(input_ids, device=self.device)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected integer token ids [batch, seq], got {ids.dtype} {tuple(ids.shape)}")
        self._check_ids(ids)
        return self.net.prefill(ids.long())

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.net.vocab_size):
            raise ValueError(f"input_ids: expected token ids in [0, {self.net.vocab_size}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")

    # ------------------------------------------------------------------ the scheduler
    @property
    def scheduler(self):
        """The continuous-batching scheduler over this model's cache rows (created on first use with
        ``prefill_chunk``; an ``ember.engine.scheduler.Scheduler(model, ...)`` built later replaces it)."""
        with self._scheduler_lock:
            if self._scheduler is None:
                from ember.engine.scheduler import Scheduler
                Scheduler(self, prefill_chunk=self.prefill_chunk)
            return self._scheduler

    # ------------------------------------------------------------------ decode step
    def _next_tokens(self, logits: torch.Tensor, B: int) -> torch.Tensor:
        if self._mode == "greedy":
            # All rows greedy: argmax, no filtering or random numbers (cheaper than sample at T=0).
            return self._argmax(logits)
        return sample_step(logits, self._temperature[:B], self._top_k[:B], self._top_p[:B], self._min_p[:B],
                           self._seed[:B], every_row=every_row_promise(self._mode))

    def _write_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, rows: slice) -> None:
        """log_softmax of the raw logits (before temperature and filters) at the chosen tokens and its top-k."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        self._lp[rows].copy_(lp.gather(1, tokens.view(-1, 1)).view(-1))
        top = lp.topk(self._top_lp.shape[1], dim=-1)
        self._top_lp[rows].copy_(top.values)
        self._top_ids[rows].copy_(top.indices)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self._argmax_fn is None:
            try:
                ember.ops.argmax(logits)
                self._argmax_fn = ember.ops.argmax
            except Exception as e:  # a kernel that does not build here: say so, keep decoding
                import warnings
                warnings.warn(f"ember.ops.argmax failed ({type(e).__name__}: {str(e)[:200]}); using torch.argmax")
                self._argmax_fn = lambda x: torch.argmax(x, dim=-1)
        return self._argmax_fn(logits)

    def _step(self, B: int) -> None:
        """One decode step of rows 0..B-1; rows with ``_active`` 0 keep their position and length."""
        logits = self.net.decode(self._tokens[:B], self._positions[:B], self._seq_lens[:B], self.caches)
        nxt = self._next_tokens(logits, B)
        if self._logprobs:
            self._write_logprobs(logits, nxt, slice(0, B))
        torch.mul(nxt, self._active[:B], out=self._tokens[:B])  # a free row feeds token 0, never garbage
        self._positions[:B].add_(self._active[:B])
        self._seq_lens[:B].add_(self._active32[:B])

    def _capture(self, B: int) -> torch.cuda.CUDAGraph:
        """Warm up (Triton compiles, autotunes) and capture one decode step for batch B.

        The warm-up steps advance the state and write cache entries at the rows' current positions;
        the state is restored afterwards and those entries are rewritten before anything reads them.
        """
        live = [self._tokens, self._positions, self._seq_lens, self._seed, *self._recurrent_state]
        saved = [t.clone() for t in live]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(B)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(B)
        for t, s in zip(live, saved):
            t.copy_(s)
        torch.cuda.synchronize(self.device)
        return graph

    def _graph(self, B: int, mode: str, logprobs: bool) -> torch.cuda.CUDAGraph:
        """The captured step for (B, mode, logprobs), captured now if warm-up did not (timed in capture_s)."""
        key = (B, mode, logprobs)
        graph = self._graphs.get(key)
        if graph is None:
            if mode not in SAMPLING_MODES:
                raise ValueError(f"mode: expected one of {SAMPLING_MODES}, got {mode!r}")
            t0 = time.perf_counter()
            saved = self._mode, self._logprobs
            self._mode, self._logprobs = mode, logprobs
            try:
                self._conform_rows(B, mode)  # the warm-up steps sample every row under the mode's promise
                with torch.no_grad():
                    graph = self._graphs[key] = self._capture(B)
            finally:
                self._mode, self._logprobs = saved
            self.capture_s += time.perf_counter() - t0
        return graph

    def _compile_ahead(self, tasks) -> float:
        """Run ``tasks`` (``compile_tasks``) from a pool of threads: ("step", B) one eager decode step of B
        rows (at the scratch position, tokens 0), (mode, B) the step's draw (``sample_step``, or a greedy
        step's argmax) for B rows in that sampling mode on zero logits, ("prefill", n) an eager prefill of n
        tokens (0) into cache row 0; seconds. Each task runs once a model. On a GPU that compiles every Triton
        variant the decode graphs launch side by side, where the captures would reach them one after another.
        Triton's compile releases the GIL (sm_90, Triton 3.6, two one-launch samplers on a 2-core host: 32.9 s
        on two threads, 58.7 s one after the other), and a warm-up's longest compiles are the one-launch
        sampler's (per batch size that fits one launch: 12-27 s top_k, 22-60 s "any") and the batch-1 gate_up
        GEMV (13-15 s; the rest of the Qwen3-30B-A3B step 5 s; bench/results/cpu/compile_sm90_probe.txt).

        Everything goes to the caller's stream, so the device runs one launch at a time (a
        one-launch sampler needs all its programs resident). The steps write the scratch position's
        cache entries, as the captures' warm-up steps do, the prefills row 0's (rewritten by the next
        request that takes the row), and the recurrent state is put back. Run it while no request is
        in flight. A tensor-parallel net runs only the draws: its steps' and prefills' collectives
        must keep the ranks' order."""
        dev = self.device
        stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
        V = self.net.vocab_size

        def run(what: str, B: int) -> None:
            with torch.no_grad(), contextlib.ExitStack() as ctx:
                if stream is not None:
                    ctx.enter_context(torch.cuda.device(dev))
                    ctx.enter_context(torch.cuda.stream(stream))
                row = lambda v, dt: torch.full((B,), v, dtype=dt, device=dev)  # noqa: E731
                if what == "step":
                    self.net.decode(row(0, torch.int64), row(self.max_seq_len - 1, torch.int64), row(1, torch.int32),
                                    self.caches)
                    return
                if what == "prefill":
                    self._prefill_chunk(0, [0] * B, 0, B)
                    return
                logits = torch.zeros(B, V, dtype=self.dtype, device=dev)
                if what == "greedy":
                    self._argmax(logits)
                    return
                s = _FILLERS[what]
                sample_step(logits, row(s.temperature, torch.float32), row(s.top_k, torch.int64),
                            row(s.top_p, torch.float32), row(s.min_p, torch.float32), row(0, torch.int64),
                            every_row=every_row_promise(what))

        t0 = time.perf_counter()
        tp = _tensor_parallel()
        # the longest compiles first, so that fewer cores than tasks still end together (measured
        # above: "any" draws 22-60 s, top_k 12-27 s, a step's 13-19 s, the rest a few seconds)
        tasks = sorted({t for t in tasks if t not in self._compiled and not (tp and t[0] in ("step", "prefill"))},
                       key=lambda t: (_COMPILE_ORDER.index(t[0]), -t[1]))
        if not tasks:
            return 0.0
        saved = [t.clone() for t in self._recurrent_state]
        workers = max(1, min(len(tasks), os.cpu_count() or 1))
        try:
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="ember-compile") as pool:
                for f in [pool.submit(run, what, B) for what, B in tasks]:
                    f.result()  # the first failure, once every task has ended
        finally:
            for t, v in zip(self._recurrent_state, saved):
                t.copy_(v)
        if stream is not None:
            stream.synchronize()
        self._compiled.update(tasks)
        return time.perf_counter() - t0

    def _compile_for(self, ids: list[list[int]], sampling: list[SamplingParams]) -> None:
        """Before requests of a model that was not warmed up: ``_compile_ahead`` what they will run
        first (their prefill lengths, each first draw at batch 1, the decode bucket's step and draw),
        so a first ``generate`` compiles those side by side rather than one after another. Nothing
        while other requests are in flight (the prefills write row 0)."""
        from ember.engine.scheduler import chunk_plan
        sched = self.scheduler
        modes = [sampling_mode(s, self.net.vocab_size) for s in sampling]
        B = next((b for b in sched.buckets if b >= len(ids)), sched.buckets[-1])
        tasks = compile_tasks([B], (), (batch_mode(modes),))
        tasks += [(mode, 1) for mode in modes]
        tasks += [("prefill", n) for p in ids
                  for _, _, n in chunk_plan(len(p), sched.prefill_chunk, self.max_seq_len)]
        if not set(tasks) <= self._compiled:
            try:
                sched.run_in_loop(lambda: None if sched._busy() else self._compile_ahead(tasks))
            except Exception as e:  # the requests still run, compiling one kernel after another
                warnings.warn(f"{self.name}: compiling ahead failed ({type(e).__name__}: {str(e)[:200]}); the "
                              "requests compile as they go")

    def _decode(self, B: int, mode: str, logprobs: bool) -> None:
        """Run one decode step of rows 0..B-1 (a graph replay on the GPU, eager elsewhere); ``mode``
        (``batch_mode`` of the decoding rows) must hold for every decoding row among them."""
        self._conform_rows(B, mode)
        if self.use_cuda_graph:
            self._graph(B, mode, logprobs).replay()
            return
        self._mode, self._logprobs = mode, logprobs
        self._step(B)

    def _conform_rows(self, B: int, mode: str) -> None:
        """Rows 0..B-1 whose parameters break ``mode``'s promise get a filler that keeps it. Such a row
        is not decoding (the scheduler picks a mode every decoding row takes); its token is discarded,
        and ``_set_row_sampling`` puts its request's parameters back when it joins."""
        if mode not in ("temperature_only", "top_k"):
            return  # argmax reads no parameters; "any" takes every value
        modes = self._row_modes
        for row in range(B):
            if modes[row] != mode:
                self._set_row_sampling(row, _FILLERS[mode])

    # ------------------------------------------------------------------ one cache row (slot)
    def _prefill_chunk(self, row: int, ids: list[int], start: int, padded: int) -> torch.Tensor:
        """Prefill ``ids`` at positions start.. into cache row ``row``, padded with token 0 to ``padded``
        tokens (after the real ones: causal attention keeps the padding out of them, and decoding
        rewrites its cache entries); logits [1, V] at the last real token."""
        graph = self._prefill_graphs.get(padded) if start == 0 else None
        if graph is not None:
            return graph.run(row, ids)
        row_caches = [tuple(t[row:row + 1] for t in layer) for layer in self.caches]
        x = _to_device(torch.tensor([ids + [0] * (padded - len(ids))], dtype=torch.int64), self.device)
        if padded == len(ids):
            return self.net.prefill(x, row_caches, last_only=True, start=start)
        last = _to_device(torch.tensor([len(ids) - 1], dtype=torch.int64), self.device)
        return self.net.prefill(x, row_caches, last_index=last, start=start)

    def _set_row_sampling(self, row: int, s: SamplingParams) -> None:
        """The row's sampling parameters (device fills, no host sync; the seed is set at its first draw);
        nothing to do when the row holds them already."""
        if self._row_params[row] is s:
            return
        self._row_params[row] = s
        self._row_modes[row] = sampling_mode(s, self.net.vocab_size)
        self._temperature[row] = float(s.temperature)
        self._top_k[row] = int(s.top_k)
        self._top_p[row] = float(s.top_p)
        self._min_p[row] = float(s.min_p)

    def _first_token(self, row: int, logits: torch.Tensor, sampling: SamplingParams, seed: int,
                     logprobs: bool) -> torch.Tensor:
        """The first new token [1] from the prefill's logits [1, V], drawn from (seed, 0) as the decode
        step then draws row ``row``'s later tokens (from seed + k * SEED_STEP); logprobs into the row's
        buffers.

        The sampler reads one-element buffers of its own rather than views at ``row``: a view's
        address changes Triton's alignment key, and a row other than 0 would compile a new variant."""
        mode = sampling_mode(sampling, self.net.vocab_size)
        if mode == "greedy":
            tok = self._argmax(logits)
        else:
            one = self._one_row
            one["temperature"].fill_(float(sampling.temperature))
            one["top_k"].fill_(int(sampling.top_k))
            one["top_p"].fill_(float(sampling.top_p))
            one["min_p"].fill_(float(sampling.min_p))
            one["seed"].fill_(seed)
            # the decode step's own call at batch 1 (keyed by the seed alone, advancing it in the
            # one-element buffer, unused), so the first draw reuses that step's Triton variant rather
            # than compiling one of its own (sm_90 compiles of the one-launch sampler, Triton 3.6 on
            # a 2-core host: 11.7 s for top_k, 22.2 s for "any")
            tok = sample_step(logits, one["temperature"], one["top_k"], one["top_p"], one["min_p"], one["seed"],
                              every_row=every_row_promise(mode))
        # the key of the row's second draw, set now: the steps that ran over the row while it
        # prefilled advanced its seed too
        self._seed[row] = _wrap64(seed + SEED_STEP)
        if logprobs:
            self._write_logprobs(logits, tok, slice(row, row + 1))
        return tok

    def _join(self, row: int, token: torch.Tensor, prompt_len: int) -> None:
        """Row ``row`` decodes from the next step on: its first token, position and length."""
        self._tokens[row:row + 1].copy_(token)
        self._positions[row] = prompt_len
        self._seq_lens[row] = prompt_len + 1
        self._active[row] = 1
        self._active32[row] = 1

    def _release(self, row: int) -> None:
        """Row ``row`` is free: the step keeps it at the scratch position with length 1."""
        self._active[row] = 0
        self._active32[row] = 0
        self._positions[row] = self.max_seq_len - 1
        self._seq_lens[row] = 1

    # ------------------------------------------------------------------ for benchmarks and tools
    def decode_graph(self, batch_size: int, mode: str = "greedy") -> torch.cuda.CUDAGraph:
        """The CUDA graph of one decode step at ``batch_size`` rows sampling by ``mode`` (one of
        ``SAMPLING_MODES``, no logprobs), captured by an earlier ``warmup`` / ``generate``: what
        ``ember bench`` replays to time the step the engine runs. A documented internal API (a
        ``KeyError`` naming the missing capture otherwise)."""
        try:
            return self._graphs[(batch_size, mode, False)]
        except KeyError:
            have = sorted(k[:2] for k in self._graphs if not k[2])
            raise KeyError(f"no captured decode step for batch {batch_size}, mode={mode!r}; run "
                           f"model.warmup({batch_size}) or a generate first (captured: {have})") from None

    def prefill_last(self, row: int, prompt: list[int]) -> torch.Tensor:
        """Prefill ``prompt`` into cache row ``row`` exactly as the scheduler does (chunks of the
        scheduler's chunk length, the first from a graph where warm-up captured one); logits [1, V] at
        its last position. A documented internal API for
        benchmarks (run it while no request is in flight)."""
        return self.scheduler.prefill_last(row, prompt)

    def warmup(self, batch_size: int | None = None, mode: str = "greedy") -> float:
        """Get ready to decode without capturing or compiling on a request's critical path; seconds.

        No arguments: everything the scheduler uses (every batch bucket's graphs in every sampling
        mode, with and without logprobs, and each prefill chunk length once). ``warmup(batch_size,
        mode)``: only that decode graph (``mode`` one of ``SAMPLING_MODES``; default "greedy": all
        rows greedy, the argmax step).

        Example:
            >>> model.warmup()            # before serving
            >>> model.warmup(8, mode="top_k")
        """
        if mode not in SAMPLING_MODES:
            raise ValueError(f"mode: expected one of {SAMPLING_MODES}, got {mode!r}")
        if batch_size is None:
            return self.scheduler.warmup()
        if not self.use_cuda_graph or (batch_size, mode, False) in self._graphs:
            return 0.0
        t0 = time.perf_counter()
        self.scheduler.run_in_loop(lambda: self._graph(batch_size, mode, False))
        return time.perf_counter() - t0

    def _prepare(self, prompts, sampling, stop):
        """Normalise inputs -> (is_text, id lists, per-row SamplingParams, per-row stop (ids, strings))."""
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                              and not isinstance(prompts[0], str) and not _is_sequence(prompts[0]))
        if isinstance(prompts, torch.Tensor):
            if prompts.dim() not in (1, 2):
                raise ValueError(f"prompts: expected token ids [seq] or [batch, seq], got shape {tuple(prompts.shape)}")
            prompts = list(prompts) if prompts.dim() == 2 else [prompts]
        elif single:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: expected a string, a list of token ids, or a non-empty list of either")
        is_text = isinstance(prompts[0], str)
        if any(isinstance(p, str) != is_text for p in prompts):
            raise TypeError("prompts: expected all strings or all token-id lists, not a mix")
        if is_text:
            if self.tokenizer is None:
                raise ValueError(f"prompts: text given but {self.name} has no tokenizer files (tokenizer.json); "
                                 "pass token ids or add the tokenizer")
            ids = [self.tokenizer.encode(p) for p in prompts]
        else:
            ids = [_token_ids(i, p) for i, p in enumerate(prompts)]
        B = len(ids)
        if B > self.max_batch_size:
            raise ValueError(f"prompts: batch of {B} is larger than max_batch_size={self.max_batch_size} "
                             "(pass a larger max_batch_size to ember.load)")
        for i, p in enumerate(ids):
            if not p:
                raise ValueError(f"prompts[{i}]: empty prompt")
            bad = [t for t in p if not 0 <= t < self.net.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}]: token id {bad[0]} outside [0, {self.net.vocab_size})")
        if isinstance(sampling, SamplingParams) or sampling is None:
            sampling = [sampling or GREEDY] * B
        if len(sampling) != B or not all(isinstance(s, SamplingParams) for s in sampling):
            raise ValueError(f"sampling: expected a SamplingParams or a list of {B} of them")
        for s in sampling:
            if s.seed is not None and not -2 ** 63 <= s.seed < 2 ** 63:
                raise ValueError(f"sampling: seed {s.seed} is outside int64 [-2^63, 2^63)")
        per_row = isinstance(stop, (list, tuple)) and stop and all(s is None or isinstance(s, (list, tuple, set))
                                                                  for s in stop)
        stops = list(stop) if per_row else [stop] * B
        if len(stops) != B:
            raise ValueError(f"stop: expected one stop list per prompt ({B}), got {len(stops)}")
        parsed = []
        for s in stops:
            items = [] if s is None else ([s] if isinstance(s, (str, int)) else list(s))
            tok_ids = {int(x) for x in items if isinstance(x, int)} | self.eos_ids
            parsed.append((tok_ids, [x for x in items if isinstance(x, str)]))
        return is_text, ids, sampling, parsed

    def _check_new_tokens(self, ids: list[list[int]], max_new_tokens) -> int | None:
        """Validate max_new_tokens against the prompts; the new-token count past which the longest row
        runs beyond max_position_embeddings (None when it never does)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        longest = max(len(p) for p in ids)
        if longest + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompts: prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"max_seq_len={self.max_seq_len} (pass a larger max_seq_len to ember.load)")
        limit = self.max_position_embeddings
        return max(limit - longest + 1, 1) if limit is not None and longest + max_new_tokens > limit else None

    def _submit_all(self, ids, sampling, stops, max_new_tokens) -> list:
        from ember.engine.scheduler import Request
        if self.use_cuda_graph:
            self._compile_for(ids, sampling)
        # submitted together (all or none): the loop admits the whole batch in one iteration, so its
        # steps do not depend on thread timing (tensor-parallel ranks must run the same steps)
        return self.scheduler.submit_many([Request(
            prompt=p, max_tokens=max_new_tokens, sampling=s, stop_ids=frozenset(tok_stop),
            stop_strings=tuple(str_stop) if self.tokenizer is not None else ())
            for p, s, (tok_stop, str_stop) in zip(ids, sampling, stops)])

    def _warn_past_positions(self, longest: int, limit: int) -> None:
        warnings.warn(f"{self.name}: the sequence ({longest} prompt tokens + new ones) now runs past the model's "
                      f"max_position_embeddings={limit}; what follows is beyond the length it was trained for",
                      stacklevel=3)

    # ------------------------------------------------------------------ public generation API
    def generate(self, prompts, max_new_tokens: int = 128, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 stop=None) -> list:
        """Generate continuations for a batch of prompts (<= max_batch_size), through the scheduler.

        ``prompts``: a string, a list of strings, a list of token ids, or a list of such lists.
        ``sampling``: one SamplingParams for all rows or one per row (default greedy).
        ``stop``: token ids and/or strings ending a row (EOS always does), or one such list per row.
        Returns the new text per prompt for text prompts, the new token ids otherwise (the stop
        token / string excluded).

        Example:
            >>> model.generate(["Hi", "Bye"], max_new_tokens=8, sampling=ember.SamplingParams(temperature=0.7, seed=1))
        """
        is_text, ids, sampling, stops = self._prepare(prompts, sampling, stop)
        past = self._check_new_tokens(ids, max_new_tokens)
        capture0 = self.capture_s
        t0 = time.perf_counter()
        handles = self._submit_all(ids, sampling, stops, max_new_tokens)
        try:
            for h in handles:
                h.wait()
        except BaseException:  # KeyboardInterrupt while waiting: free the slots
            for h in handles:
                h.cancel()
            raise
        for h in handles:
            if h.finish_reason == "error":
                raise h.exception or RuntimeError(h.error)
        # prefill: until the last row's first token; decode: the longest row's first to last token
        # (rows join one prefill chunk apart, so the batch's span would overstate the per-row time)
        # (a row whose first draw is a stop id emits no token, so it has no token times)
        timed = [h for h in handles if h.first_token_time is not None]
        first = max((h.first_token_time for h in timed), default=time.perf_counter())
        span = max((h.last_token_time - h.first_token_time for h in timed), default=0.0)
        warm = self.capture_s - capture0
        self.stats = Stats(prompt_tokens=sum(len(p) for p in ids), prefill_s=first - t0,
                           new_tokens=max(h.sampled_tokens for h in handles),
                           decode_s=max(span - warm, 0.0), warmup_s=warm)
        if past is not None and self.stats.new_tokens >= past:
            self._warn_past_positions(max(len(p) for p in ids), self.max_position_embeddings)
        if not is_text:
            return [list(h.tokens) for h in handles]
        results = []
        for b, h in enumerate(handles):
            text = self.tokenizer.decode(h.tokens)
            cut = min([text.index(s) for s in stops[b][1] if s in text], default=len(text))
            results.append(text[:cut])
        return results

    def stream(self, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None, stop=None) -> Iterator:
        """Yield the continuation of one prompt as it is decoded: text pieces for a text prompt
        (whole characters only), token ids for a token-id prompt. Closing the generator early
        cancels the request (its slot is freed within one decode step).

        Example:
            >>> for piece in model.stream("Once upon a time", max_new_tokens=32):
            ...     print(piece, end="")
        """
        if isinstance(prompt, (list, tuple)) and prompt and (isinstance(prompt[0], str) or _is_sequence(prompt[0])):
            raise ValueError("prompt: stream takes one prompt (a string or a list of token ids)")
        is_text, ids, sampling, stops = self._prepare(prompt, sampling, stop)
        past = self._check_new_tokens(ids, max_new_tokens)
        return self._stream(is_text, ids, sampling, stops, max_new_tokens, past)

    def _stream(self, is_text, ids, sampling, stops, max_new_tokens, past) -> Iterator:
        t0 = time.perf_counter()
        (h,) = self._submit_all(ids, sampling, stops, max_new_tokens)
        self.stats = Stats(prompt_tokens=len(ids[0]))
        n = 0
        try:
            for ev in h:
                if ev.finish_reason == "error":
                    raise h.exception or RuntimeError(h.error)
                if ev.token is not None:
                    n += 1
                    if n == past:
                        self._warn_past_positions(len(ids[0]), self.max_position_embeddings)
                if is_text:
                    if ev.text:
                        yield ev.text
                elif ev.token is not None:
                    yield ev.token
        finally:
            h.cancel()  # a generator closed early: free the slot (a no-op once finished)
            h.wait(timeout=10)
            if h.first_token_time is not None:
                st = self.stats
                st.prefill_s = h.first_token_time - t0
                st.new_tokens = h.sampled_tokens
                st.decode_s = (h.last_token_time or h.first_token_time) - h.first_token_time


TOP_LOGPROBS = 20  # the most top logprobs a request may ask for (what the logprobs step computes)


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync (pinned staging; the caching host allocator
    keeps the staging buffer until the copy has run)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def sample_step(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seed: torch.Tensor, every_row: str | None = None) -> torch.Tensor:
    """One engine draw over ``logits [B, V]``: ``ember.ops.sample`` with per-row parameter tensors and
    the batch's ``every_row`` promise (from ``sampling_mode``), each row keyed by its own seed alone
    (no batch counter); every seed is advanced by SEED_STEP for the row's next draw by the sampler's
    kernel itself (``advance_seed``: H100, the separate seed.add_ launch cost +1.5 to +2.5 us a
    draw in a graph). The decode graph runs exactly this; ``ember bench sampling`` times it.

    Example:
        >>> B = 2
        >>> tok = sample_step(torch.randn(B, 100), torch.full((B,), 0.7), torch.full((B,), 50),
        ...                   torch.full((B,), 0.9), torch.zeros(B), torch.tensor([1, 2]), every_row="top_k")
    """
    # SamplingParams validated the values
    return ember.ops.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                            check=False, every_row=every_row, advance_seed=True)


SAMPLING_MODES = ("greedy", "temperature_only", "top_k", "any")
# what a row that is not decoding holds under a mode's promise (its token is discarded); also the
# parameters of _compile_ahead's draws
_FILLERS = {"temperature_only": SamplingParams(temperature=1.0), "top_k": SamplingParams(temperature=1.0, top_k=1),
            "any": SamplingParams(temperature=1.0, top_p=0.9)}


def sampling_mode(s: SamplingParams, vocab: int) -> str:
    """The decode-step class of one request's sampling (``SAMPLING_MODES``): "greedy" (temperature 0),
    "temperature_only" (no filter on), "top_k" (0 < top_k < vocab; top-p / min-p anything) or "any".
    A step whose rows share a class promises it to the sampler (``every_row``), which then takes the
    kernel path scalars would select. H100 [1, 128256] (bench/results/h100/sampling_engine_probe.json):
    the draw with the promise is as fast as with scalars (top-k 50 + top-p 0.9 6.52 vs 6.52 us,
    temperature alone 4.10 vs 4.08); the engine's draw with its seed advance 8.0 vs 10.6 us without
    the promise, 6.6 vs 9.5 us.

    Example:
        >>> sampling_mode(SamplingParams(temperature=0.7, top_k=50, top_p=0.9), 151936)
        'top_k'
    """
    if s.temperature == 0:
        return "greedy"
    if 0 < s.top_k < vocab:
        return "top_k"
    if s.top_p >= 1.0 and s.min_p == 0.0:
        return "temperature_only"
    return "any"


def every_row_promise(mode: str) -> str | None:
    """The ``every_row`` promise a step of sampling ``mode`` gives ``ember.ops.sample`` (None: "any")."""
    return None if mode == "any" else mode


def batch_mode(modes) -> str:
    """The mode of a decode step whose decoding rows have ``modes``: theirs when they agree, else "any".

    Example:
        >>> batch_mode(["top_k", "top_k"]), batch_mode(["greedy", "top_k"])
        ('top_k', 'any')
    """
    modes = set(modes)
    return modes.pop() if len(modes) == 1 else "any"


_COMPILE_ORDER = ("any", "top_k", "step", "temperature_only", "greedy", "prefill")


def compile_tasks(batch_sizes, prefill_lengths, modes=SAMPLING_MODES) -> list[tuple[str, int]]:
    """``Model._compile_ahead``'s tasks: the decode step and each of ``modes``' draws per batch size,
    and an eager prefill per length.

    Example:
        >>> compile_tasks([1, 2], [4], ("greedy",))
        [('step', 1), ('greedy', 1), ('step', 2), ('greedy', 2), ('prefill', 4)]
    """
    return [(what, B) for B in batch_sizes for what in ("step", *modes)] + [("prefill", n) for n in prefill_lengths]


def _tensor_parallel() -> bool:
    """Whether this process is one rank of several (ember.distributed): its decode steps hold collectives."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _wrap64(x: int) -> int:
    """x as a two's-complement int64 (the wrap-around the device's int64 add does)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)
