"""The decode engine: static KV cache, prefill, a decode step captured once in a CUDA graph, sampling,
stop handling, text in / text out.

One decode step is embedding -> every layer -> final norm -> lm_head -> ``ember.ops.sample``, with the
sampled token, positions and lengths written back into static device buffers, so a replay of the
captured graph is the whole step and the host only reads the new tokens (one step behind the GPU,
so the GPU never waits for Python). Prefill runs one prompt at a time into that prompt's cache row.
On the GPU it is captured too, per (cache row, length bucket) from the second prompt of that
bucket on (the first runs eagerly: a capture costs more than a dozen eager prefills, so only
lengths that recur are captured): prompts are padded with token 0 to a multiple of
``prefill_bucket`` tokens (the padding comes after the prompt, so causal attention keeps it out of
the real positions; its cache entries lie past the sequence length and are overwritten by
decoding) and the logits are read at the last real position. Why: an eager prefill
is host-bound (H200, Qwen3-30B-A3B shapes, 2048 tokens: ~1.1 ms of GPU work per layer, ~2.2 ms of
Python and launch time per layer). Models with recurrent state (LFM2, Qwen3.5) prefill eagerly:
padding would run through their state. On CPU the same steps run eagerly through the reference ops.

Example:
    >>> model = ember.load("Qwen3-30B-A3B")
    >>> model.generate(["Hello"], max_new_tokens=32, sampling=ember.SamplingParams(temperature=0))
    >>> for piece in model.stream("Once upon a time", max_new_tokens=64):
    ...     print(piece, end="", flush=True)
"""
from __future__ import annotations

import dataclasses
import math
import operator
import os
import random
import time
import warnings
from collections.abc import Iterator, Sequence

import torch

import ember.ops
from ember.ops.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


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
    ``stream`` decode with the cache (CUDA graph on GPU).
    """

    def __init__(self, net, config: dict, tokenizer, *, max_seq_len: int, max_batch_size: int,
                 eos_ids: Sequence[int] = (), fp8: bool = False, name: str = "model", prefill_bucket: int = 256):
        self.net, self.config, self.tokenizer = net, config, tokenizer
        self.max_seq_len, self.max_batch_size = max_seq_len, max_batch_size
        self.fp8, self.name = fp8, name
        self.eos_ids = set(eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.device, self.dtype = net.embed.device, net.embed.dtype
        if self.device.type != "cuda":  # (ember.load checks GPU memory before loading)
            self._check_host_memory(net, max_batch_size, max_seq_len)
        # per layer: (k, v) for attention, the conv / recurrent state for hybrid mixers; batch first
        self.caches = net.allocate_caches(max_batch_size, max_seq_len, self.dtype, self.device)
        # State that a decode step advances in place (not append-only like a KV cache): the warm-up
        # steps before capture must not leave it changed.
        self._recurrent_state = [t for layer, cache in zip(net.layers, self.caches)
                                 if hasattr(layer.attn, "cache_spec") for t in cache]
        B, dev = max_batch_size, self.device
        # Static decode state: the CUDA graph reads and advances these in place.
        self._tokens = torch.zeros(B, dtype=torch.int64, device=dev)
        self._positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self._seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self._temperature = torch.zeros(B, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(B, dtype=torch.int64, device=dev)
        self._top_p = torch.ones(B, dtype=torch.float32, device=dev)
        self._min_p = torch.zeros(B, dtype=torch.float32, device=dev)
        self._seed = torch.zeros(B, dtype=torch.int64, device=dev)
        self._offset = torch.zeros(1, dtype=torch.int64, device=dev)
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch, all greedy) -> graph
        self._greedy = True
        self._argmax_fn = None
        self.use_cuda_graph = dev.type == "cuda"
        # (cache row, padded length) -> (ids, last index, logits, graph); 0 or recurrent state: eager
        self.prefill_bucket = 0 if self._recurrent_state else prefill_bucket
        self._prefill_graphs: dict[tuple[int, int], tuple] = {}
        self._prefill_seen: set[tuple[int, int]] = set()  # (row, bucket) prefilled once, eagerly
        self._prefill_pool = None
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

    # ------------------------------------------------------------------ decode step
    def _next_tokens(self, logits: torch.Tensor, B: int) -> torch.Tensor:
        if self._greedy:
            # All rows greedy: argmax, no filtering or random numbers (cheaper than sample at T=0).
            return self._argmax(logits)
        return ember.ops.sample(logits, temperature=self._temperature[:B], top_k=self._top_k[:B],
                                top_p=self._top_p[:B], min_p=self._min_p[:B], seed=self._seed[:B],
                                offset=self._offset, check=False)  # SamplingParams validated the values

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
        logits = self.net.decode(self._tokens[:B], self._positions[:B], self._seq_lens[:B], self.caches)
        nxt = self._next_tokens(logits, B)
        self._tokens[:B].copy_(nxt)
        self._positions[:B].add_(1)
        self._seq_lens[:B].add_(1)

    def _capture(self, B: int) -> torch.cuda.CUDAGraph:
        """Warm up (Triton compiles, autotunes) and capture one decode step for batch B.

        The warm-up steps advance the state and write cache entries past the live length; the
        state is restored afterwards and those entries are overwritten before anything reads them.
        """
        live = [self._tokens, self._positions, self._seq_lens, self._offset, *self._recurrent_state]
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

    # ------------------------------------------------------------------ for benchmarks and tools
    def decode_graph(self, batch_size: int, greedy: bool = True) -> torch.cuda.CUDAGraph:
        """The CUDA graph of one decode step at ``batch_size`` rows (all greedy or not), captured by an
        earlier ``warmup`` / ``generate``: what ``ember bench`` replays to time the step the engine runs.
        A documented internal API (a ``KeyError`` naming the missing capture otherwise)."""
        try:
            return self._graphs[(batch_size, greedy)]
        except KeyError:
            raise KeyError(f"no captured decode step for batch {batch_size}, greedy={greedy}; run "
                           f"model.warmup({batch_size}) or a generate first (captured: {sorted(self._graphs)})") from None

    def prefill_last(self, row: int, prompt: list[int]) -> torch.Tensor:
        """Prefill ``prompt`` into cache row ``row`` exactly as ``generate`` does (eager on a length's
        first prompt, then a captured graph per rounded length); logits [1, V] at its last position.
        A documented internal API for benchmarks."""
        return self._prefill_last(row, prompt)

    # ------------------------------------------------------------------ prefill
    def _prefill_last(self, b: int, prompt: list[int]) -> torch.Tensor:
        """Prefill ``prompt`` into cache row ``b``; logits [1, V] at its last position."""
        row_caches = [tuple(t[b:b + 1] for t in layer) for layer in self.caches]
        T = len(prompt)
        padded = min(-(-T // max(self.prefill_bucket, 1)) * self.prefill_bucket, self.max_seq_len)
        key = (b, padded)
        if not (self.use_cuda_graph and self.prefill_bucket) or (key not in self._prefill_graphs
                                                                 and key not in self._prefill_seen):
            # First prompt of this (row, bucket): eager. A capture costs ~1.3-3.5 s at 2048 tokens
            # (H200), ~15-40 eager prefills, so only lengths that come back are captured.
            self._prefill_seen.add(key)
            return self.net.prefill(torch.tensor([prompt], device=self.device), row_caches, last_only=True)
        entry = self._prefill_graphs.get(key)
        if entry is None:
            t0 = time.perf_counter()
            entry = self._prefill_graphs[key] = self._capture_prefill(row_caches, padded)
            self.stats.warmup_s += time.perf_counter() - t0
        ids, last, logits, graph = entry
        ids.zero_()
        ids[0, :T].copy_(torch.tensor(prompt))
        last.fill_(T - 1)
        graph.replay()
        return logits.clone()  # the static buffer is rewritten by the next replay

    def _capture_prefill(self, row_caches, padded: int) -> tuple:
        """Warm up and capture a prefill of ``padded`` tokens into ``row_caches`` (all prefill graphs
        share one memory pool: they never run at the same time)."""
        ids = torch.zeros((1, padded), dtype=torch.int64, device=self.device)
        last = torch.zeros(1, dtype=torch.int64, device=self.device)
        run = lambda: self.net.prefill(ids, row_caches, last_index=last)  # noqa: E731
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()  # Triton compiles; the cache entries it writes are rewritten by every replay
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._prefill_pool is None:
            self._prefill_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._prefill_pool):
            logits = run()
        return ids, last, logits, graph

    def warmup(self, batch_size: int = 1, greedy: bool | None = None) -> float:
        """Capture the decode graph for ``batch_size`` now (else the first generate does it); seconds.
        ``greedy`` picks the all-greedy (argmax) or the sampling graph (default: the current one)."""
        key = (batch_size, self._greedy if greedy is None else greedy)
        if not self.use_cuda_graph or key in self._graphs:
            return 0.0
        t0 = time.perf_counter()
        saved, self._greedy = self._greedy, key[1]
        try:
            with torch.no_grad():
                self._graphs[key] = self._capture(batch_size)
        finally:
            self._greedy = saved
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ generation core
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

    def _set_sampling(self, sampling: list[SamplingParams]) -> None:
        B = len(sampling)
        seeds = [s.seed if s.seed is not None else random.getrandbits(62) for s in sampling]
        vals = {"temperature": [float(s.temperature) for s in sampling], "top_k": [int(s.top_k) for s in sampling],
                "top_p": [float(s.top_p) for s in sampling], "min_p": [float(s.min_p) for s in sampling]}
        self._temperature[:B].copy_(torch.tensor(vals["temperature"]))
        self._top_k[:B].copy_(torch.tensor(vals["top_k"]))
        self._top_p[:B].copy_(torch.tensor(vals["top_p"]))
        self._min_p[:B].copy_(torch.tensor(vals["min_p"]))
        self._seed[:B].copy_(torch.tensor(seeds))
        self._offset.zero_()
        self._greedy = all(s.temperature == 0 for s in sampling)

    def _decode_rows(self, ids: list[list[int]], sampling: list[SamplingParams], max_new_tokens: int) -> Iterator[list[int]]:
        """Yield the new token of every row, step by step (the caller stops iterating when done)."""
        B = len(ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        longest = max(len(p) for p in ids)
        if longest + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompts: prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds "
                             f"max_seq_len={self.max_seq_len} (pass a larger max_seq_len to ember.load)")
        limit = self.max_position_embeddings
        # new tokens after which a row sits past the trained length: warned about once, when it happens
        past = max(limit - longest + 1, 1) if limit is not None and longest + max_new_tokens > limit else None
        st = self.stats = Stats(prompt_tokens=sum(len(p) for p in ids))
        self._set_sampling(sampling)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *a: None)
        with torch.no_grad():
            sync()
            t0 = time.perf_counter()
            last = []
            for b, p in enumerate(ids):  # each prompt into its own cache row
                last.append(self._prefill_last(b, p))
            logits = torch.cat(last)                                                   # [B, V]
            first = self._next_tokens(logits, B)
            self._tokens[:B].copy_(first)
            lens = torch.tensor([len(p) for p in ids], device=self.device)
            self._positions[:B].copy_(lens)
            self._seq_lens[:B].copy_(lens + 1)
            first_host = first.tolist()
            st.prefill_s = time.perf_counter() - t0 - st.warmup_s  # prefill graph captures are warm-up
            st.new_tokens = 1
            if past == 1:
                self._warn_past_positions(longest, limit)
            yield first_host
            if max_new_tokens == 1:
                return
            graph = None
            if self.use_cuda_graph:
                st.warmup_s += self.warmup(B)
                graph = self._graphs[(B, self._greedy)]
            t1 = time.perf_counter()
            # The host reads step k's tokens while the GPU runs step k + 1.
            host = [torch.empty(B, dtype=torch.int64, pin_memory=self.device.type == "cuda") for _ in range(2)]
            events = [torch.cuda.Event() if graph is not None else None for _ in range(2)]
            pending = None
            for k in range(max_new_tokens - 1):
                if graph is not None:
                    graph.replay()
                    host[k % 2].copy_(self._tokens[:B], non_blocking=True)
                    events[k % 2].record()
                else:
                    self._step(B)
                    host[k % 2].copy_(self._tokens[:B])
                if pending is not None:
                    if events[pending] is not None:
                        events[pending].synchronize()
                    st.new_tokens += 1
                    st.decode_s = time.perf_counter() - t1
                    if st.new_tokens == past:
                        self._warn_past_positions(longest, limit)
                    yield host[pending].tolist()
                pending = k % 2
            if events[pending] is not None:
                events[pending].synchronize()
            st.new_tokens += 1
            st.decode_s = time.perf_counter() - t1
            if st.new_tokens == past:
                self._warn_past_positions(longest, limit)
            yield host[pending].tolist()

    def _warn_past_positions(self, longest: int, limit: int) -> None:
        warnings.warn(f"{self.name}: the sequence ({longest} prompt tokens + new ones) now runs past the model's "
                      f"max_position_embeddings={limit}; what follows is beyond the length it was trained for",
                      stacklevel=3)

    # ------------------------------------------------------------------ public generation API
    def generate(self, prompts, max_new_tokens: int = 128, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 stop=None) -> list:
        """Generate continuations for a batch of prompts (<= max_batch_size).

        ``prompts``: a string, a list of strings, a list of token ids, or a list of such lists.
        ``sampling``: one SamplingParams for all rows or one per row (default greedy).
        ``stop``: token ids and/or strings ending a row (EOS always does), or one such list per row.
        Returns the new text per prompt for text prompts, the new token ids otherwise (the stop
        token / string excluded).

        Example:
            >>> model.generate(["Hi", "Bye"], max_new_tokens=8, sampling=ember.SamplingParams(temperature=0.7, seed=1))
        """
        is_text, ids, sampling, stops = self._prepare(prompts, sampling, stop)
        B = len(ids)
        out: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        texts = [""] * B
        for toks in self._decode_rows(ids, sampling, max_new_tokens):
            for b, t in enumerate(toks):
                if done[b]:
                    continue
                if t in stops[b][0]:
                    done[b] = True
                    continue
                out[b].append(t)
                if stops[b][1] and self.tokenizer is not None:
                    texts[b] = self.tokenizer.decode(out[b])
                    if any(s in texts[b] for s in stops[b][1]):
                        done[b] = True
            if all(done):
                break
        if not is_text:
            return out
        results = []
        for b in range(B):
            text = self.tokenizer.decode(out[b])
            cut = min([text.index(s) for s in stops[b][1] if s in text], default=len(text))
            results.append(text[:cut])
        return results

    def stream(self, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None, stop=None) -> Iterator:
        """Yield the continuation of one prompt as it is decoded: text pieces for a text prompt
        (whole characters only), token ids for a token-id prompt.

        Example:
            >>> for piece in model.stream("Once upon a time", max_new_tokens=32):
            ...     print(piece, end="")
        """
        if isinstance(prompt, (list, tuple)) and prompt and (isinstance(prompt[0], str) or _is_sequence(prompt[0])):
            raise ValueError("prompt: stream takes one prompt (a string or a list of token ids)")
        is_text, ids, sampling, stops = self._prepare(prompt, sampling, stop)
        tok_stop, str_stop = stops[0]
        out: list[int] = []
        emitted = ""
        for (t,) in self._decode_rows(ids, sampling, max_new_tokens):
            if t in tok_stop:
                return
            out.append(t)
            if not is_text:
                yield t
                continue
            text = self.tokenizer.decode(out)
            hit = min([text.index(s) for s in str_stop if s in text], default=None)
            if hit is not None:
                if hit > len(emitted):
                    yield text[len(emitted):hit]
                return
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
                continue
            if len(text) > len(emitted):
                yield text[len(emitted):]
                emitted = text
