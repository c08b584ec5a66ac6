"""Continuous batching over the model's static cache rows: requests join at any decode step and
leave when done (a stop id or string, ``max_tokens``, cancellation), prompts are prefilled in chunks
between decode steps, and every decode step runs the active rows through a CUDA graph captured for
the smallest batch bucket (1, 2, 4, ... max_batch_size) that covers the highest active row.

One background thread runs the loop and owns the GPU; :meth:`Scheduler.submit` and
:meth:`Handle.cancel` may be called from any thread, and a :class:`Handle` is iterated from a
thread (``for event in handle``) or from asyncio (``async for event in handle``). One loop
iteration: take cancellations and admit waiting requests into free rows (lowest first, so the
bucket stays small); prefill one chunk of the oldest prefilling request; replay one decode step of
the decoding rows; then handle the previous step's tokens (the host reads step k while the GPU runs
step k + 1). A request therefore costs its neighbours one chunk of prefill per step, not a whole
prompt.

Per-request sampling: each row has its own temperature / top-k / top-p / min-p / seed, and its own
sampler counter (tokens drawn so far), so a seeded request draws the same tokens in any row and
batch. Decode graphs are keyed by the step's sampling mode (``ember.engine.sampling_mode``): all rows
greedy takes the argmax graph; all temperature-only, or all top-k, the graph whose sampler is told so
(``every_row``) and takes the kernel path made for it; a mix the general one. A step whose requests
ask for logprobs takes the graph variant that also computes them (greedy or general; the others pay
nothing).

Tensor parallel (SPMD: every rank runs its own scheduler on the same submissions): what a loop
iteration does depends only on the requests and the tokens drawn (the same on every rank, seedless
requests included: ``Model.seed_source``), not on thread timing, as long as each call's requests
arrive together (:meth:`Scheduler.submit_many`, what ``generate`` / ``stream`` use). Two inputs
remain timing-dependent and so must not differ by rank there: cancellations (``Handle.cancel``,
closing a stream early) and submissions from several threads at once; a server must decide those on
rank 0 and hand them to the other ranks' loops (not done yet: ``ember serve`` has no ``--tp``).

Example:
    >>> sched = Scheduler(model)
    >>> sched.warmup(); sched.start()
    >>> h = sched.submit(Request(prompt=[1, 2, 3], max_tokens=16, sampling=ember.SamplingParams(temperature=0)))
    >>> [e.token for e in h]
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import random
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator

import torch

from ember.engine import SAMPLING_MODES, batch_mode, compile_tasks, prefill_graphs, sampling_mode
from ember.ops.sampling import SamplingParams

__all__ = ["Scheduler", "Request", "Handle", "Event", "QueueFull", "chunk_plan"]

MAX_LOGPROBS = 20
# one request of each sampling mode: warm-up runs the first-token sampler of each
_MODE_EXAMPLES = (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
                  SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.0, top_p=0.9))
_ids = itertools.count()
_live: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every loop thread before the interpreter finalises: a daemon thread still inside a torch
    call at exit aborts the process ("terminate called without an active exception")."""
    for s in list(_live):
        s.shutdown()


class QueueFull(RuntimeError):
    """``submit`` while the waiting queue already holds ``max_queue`` requests."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request; ``Scheduler.submit`` validates it (a ValueError naming the field)."""
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    logprobs: int | None = None


@dataclasses.dataclass
class Event:
    """One new token of a request (or, with ``token`` None, a final event that carries no token)."""
    token: int | None
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None


class Handle:
    """A submitted request: iterate it for its events; ``cancel()`` frees its slot within one step."""

    def __init__(self, request: Request, scheduler: "Scheduler"):
        self.id = f"req-{next(_ids)}"
        self.request = request
        self.prompt_tokens = len(request.prompt)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.ttft_s: float | None = None
        self.error: str | None = None            # the message when finish_reason == "error"
        self.exception: BaseException | None = None
        self.tokens: list[int] = []              # emitted token ids (stop ids excluded)
        self.sampled_tokens = 0                  # tokens drawn, a stop id included
        self.submit_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self._scheduler = scheduler
        self._events: list[Event] = []
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.cancel_requested = False

    # ------------------------------------------------------------------ producer side (the loop)
    def _push(self, ev: Event) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return
            now = time.perf_counter()
            if ev.token is not None:
                if self.first_token_time is None:
                    self.first_token_time = now
                    self.ttft_s = now - self.submit_time
                self.last_token_time = now
            if ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
            self._events.append(ev)
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, flag in waiters:
            try:
                loop.call_soon_threadsafe(flag.set)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _fail(self, exc: BaseException) -> None:
        self.exception = exc
        self.error = f"{type(exc).__name__}: {exc}"
        self._push(Event(None, "", finish_reason="error"))

    # ------------------------------------------------------------------ consumer side
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has finished (True) or ``timeout`` seconds passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.finish_reason is not None, timeout)

    def cancel(self) -> None:
        """Stop the request: its slot is freed within one decode step and its last event has
        finish_reason "cancelled" (nothing happens once it has finished)."""
        if self.finish_reason is None:
            self.cancel_requested = True
            self._scheduler._wake()

    def __iter__(self) -> Iterator[Event]:
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._events) > i)
                batch = self._events[i:]
            i += len(batch)
            for ev in batch:
                yield ev
                if ev.finish_reason is not None:
                    return

    async def _aiter(self) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            with self._cond:
                batch = self._events[i:]
                if not batch:
                    flag = asyncio.Event()
                    self._async_waiters.append((loop, flag))
            if not batch:
                await flag.wait()
                continue
            i += len(batch)
            for ev in batch:
                yield ev
                if ev.finish_reason is not None:
                    return

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()


def chunk_sizes(chunk: int) -> list[int]:
    """The prefill lengths the scheduler runs, longest first: ``chunk`` and every power of two below it."""
    return sorted({chunk} | {1 << i for i in range(chunk.bit_length()) if 1 << i < chunk}, reverse=True)


def chunk_plan(length: int, chunk: int, max_seq_len: int) -> list[tuple[int, int, int]]:
    """(start, tokens, padded length) of each prefill chunk of a ``length``-token prompt.

    Whole ``chunk``-token chunks, then the rest as one chunk padded up to the next length of
    :func:`chunk_sizes` (padding after the prompt is invisible to causal attention, and conv /
    recurrent mixers stop their state at the last real token); where the padding would pass
    ``max_seq_len``, the rest split into those lengths (binary), each exact. Why a fixed set of
    lengths: kernels specialise on the length (Triton's divisibility keys, token-count thresholds),
    warm-up runs each length once, and a first chunk replays a CUDA graph of its length.

    Example:
        >>> chunk_plan(1100, 512, 4096)
        [(0, 512, 512), (512, 512, 512), (1024, 76, 128)]
    """
    sizes = chunk_sizes(chunk)
    plan, start = [], 0
    while length - start >= chunk:
        plan.append((start, chunk, chunk))
        start += chunk
    rest = length - start
    if rest:
        fit = min(s for s in sizes if s >= rest)
        if start + fit <= max_seq_len:
            return plan + [(start, rest, fit)]
    for s in sizes:
        while length - start >= s:
            plan.append((start, s, s))
            start += s
    return plan


class _TextState:
    """Incremental detokenisation of one request: whole characters only, text that may begin a stop
    string held back until it cannot, the stop string itself never emitted."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]):
        self.tok, self.stops = tokenizer, stop_strings
        self.ids: list[int] = []
        self.prefix = self.read = 0   # ids[prefix:read] decoded already (context for the next piece)
        self.pending = ""             # decoded, not yet emitted

    def _piece(self, final: bool = False) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""  # nothing new, or an incomplete multi-byte character: wait for the rest
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def push(self, token: int) -> tuple[str, bool]:
        """(text to emit now, whether a stop string was hit)."""
        self.ids.append(token)
        if self.tok is None:
            return "", False
        self.pending += self._piece()
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        keep = 0  # the longest tail of pending that a stop string starts with
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        if self.tok is None:
            return ""
        out, self.pending = self.pending + self._piece(final=True), ""
        return out


class _Job:
    """The loop's state of one admitted request."""

    def __init__(self, handle: Handle, stop_ids: frozenset[int], tokenizer, plan, seeds=random):
        r = handle.request
        self.handle, self.req = handle, r
        self.stop_ids = stop_ids
        self.mode: str | None = None       # sampling_mode of the request, set on admission
        # seeds: the model's seed source (the same sequence on every tensor-parallel rank)
        self.seed = r.sampling.seed if r.sampling.seed is not None else seeds.getrandbits(62)
        self.text = _TextState(tokenizer, r.stop_strings)
        self.slot: int | None = None
        self.plan = plan                   # prefill chunks still to run
        self.stash: list[torch.Tensor] | None = None
        self.decoding = False
        self.finished = False


class Scheduler:
    """Continuous batching over ``model``'s cache rows (``model.max_batch_size`` slots).

    ``max_queue``: requests waiting for a slot before ``submit`` raises :class:`QueueFull`;
    ``prefill_chunk``: the longest prefill a loop iteration runs between two decode steps (default
    ``model.prefill_chunk``).

    Example:
        >>> sched = Scheduler(model, max_queue=64, prefill_chunk=512)
        >>> sched.warmup(); sched.start()
        >>> h = sched.submit(Request([1, 2, 3], 8, ember.SamplingParams(temperature=0.7, seed=1)))
        >>> for ev in h: print(ev.token, ev.text, ev.finish_reason)
    """

    def __init__(self, model, *, max_queue: int = 256, prefill_chunk: int | None = None):
        if prefill_chunk is None:  # the model's (ember.engine.default_prefill_chunk unless it was given one)
            prefill_chunk = model.prefill_chunk
        for name, v, lo in (("max_queue", max_queue, 1), ("prefill_chunk", prefill_chunk, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
        old = model._scheduler
        if old is not None and old is not self:
            if old._busy():
                raise RuntimeError(f"{model.name} already has a scheduler with requests in flight; shut it down first")
            old.shutdown()
        self.model = model
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        B = model.max_batch_size
        self.slots = B
        self.buckets = sorted({min(1 << i, B) for i in range(B.bit_length() + 1)})
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[_Job] = deque()
        self._rows: list[_Job | None] = [None] * B
        self._prefilling: deque[_Job] = deque()
        self._records: deque = deque()
        self._tasks: deque = deque()
        self._thread: threading.Thread | None = None
        self._persistent = False
        self._stopping = False
        self._counts = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "decode_steps": 0,
                        "prefill_chunks": 0}
        model._scheduler = self
        _live.add(self)

    # ------------------------------------------------------------------ public API
    def submit(self, request: Request) -> Handle:
        """Queue ``request``; a :class:`Handle` to its events. ValueError / TypeError for a bad request
        (naming the field), :class:`QueueFull` when ``max_queue`` requests already wait."""
        return self.submit_many([request])[0]

    def submit_many(self, requests) -> list[Handle]:
        """Queue ``requests`` together (all or none): the loop sees them in one iteration, so the
        admissions, prefill chunks and decode steps that follow depend on the requests alone, not on
        thread timing; what keeps tensor-parallel ranks' collectives in step (SPMD ``generate``).
        Errors as :meth:`submit` (QueueFull when they do not all fit).

        Example:
            >>> hs = sched.submit_many([Request([1, 2], 8, greedy), Request([3], 8, greedy)])
        """
        jobs = []
        for request in requests:
            stop_ids = self._validate(request)
            plan = chunk_plan(len(request.prompt), self.prefill_chunk, self.model.max_seq_len)
            jobs.append(_Job(Handle(request, self), stop_ids, self.model.tokenizer, plan, self.model.seed_source))
        with self._lock:
            if self._stopping:
                raise RuntimeError("the scheduler is shut down")
            if len(self._queue) + len(jobs) > self.max_queue:
                raise QueueFull(f"the queue holds max_queue={self.max_queue} waiting requests")
            self._queue.extend(jobs)
            self._counts["requests"] += len(jobs)
            self._counts["prompt_tokens"] += sum(len(j.req.prompt) for j in jobs)
            self._ensure_thread()
            self._cond.notify_all()
        return [j.handle for j in jobs]

    def start(self) -> None:
        """Run the loop in a background thread until :meth:`shutdown` (idempotent). Without it the
        loop thread runs while there is work (what ``Model.generate`` relies on)."""
        with self._lock:
            self._persistent = True
            self._stopping = False
            self._ensure_thread()

    def shutdown(self) -> None:
        """Stop the loop; requests not finished end with finish_reason "cancelled"."""
        with self._lock:
            self._stopping = True
            self._persistent = False
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            jobs = list(self._queue) + [j for j in self._rows if j is not None]
            self._queue.clear()
        for j in jobs:
            self._finish(j, Event(None, "", finish_reason="cancelled"))
        self._records.clear()

    def metrics(self) -> dict:
        """Queue depth, slots in use, slot count and running totals (requests, tokens, steps)."""
        with self._lock:
            return {"queue_depth": len(self._queue), "slots_in_use": sum(j is not None for j in self._rows),
                    "slots": self.slots, "prefill_chunk": self.prefill_chunk, **self._counts}

    def warmup(self) -> float:
        """Capture every decode graph the loop uses (each bucket in each sampling mode, with and without
        logprobs) and run each prefill chunk length once, so that no request captures or compiles;
        seconds. Run it while no request is in flight."""
        return self.run_in_loop(self._warmup)

    def prefill_last(self, row: int, prompt: list[int]) -> torch.Tensor:
        """Prefill ``prompt`` into cache row ``row`` as a request's prefill runs (its chunks; the first
        replays a graph where warm-up captured one for its padded length);
        logits [1, V] at the last position. For benchmarks, while no request is in flight."""
        if not 0 <= row < self.slots:
            raise ValueError(f"row: expected a cache row in [0, {self.slots}), got {row}")

        def run():
            plan = chunk_plan(len(prompt), self.prefill_chunk, self.model.max_seq_len)
            logits = None
            with torch.no_grad():
                for start, n, padded in plan:
                    logits = self.model._prefill_chunk(row, list(prompt[start:start + n]), start, padded)
            return logits
        return self.run_in_loop(run)

    def run_in_loop(self, fn):
        """``fn()`` on the thread that owns the GPU (inline when no loop thread runs); its result."""
        with self._lock:
            thread = self._thread
            if thread is None or thread is threading.current_thread():
                thread = None
            else:
                box: dict = {}
                done = threading.Event()
                self._tasks.append((fn, box, done))
                self._cond.notify_all()
        if thread is None:
            with torch.no_grad():
                return fn()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    # ------------------------------------------------------------------ validation
    def _validate(self, r: Request) -> frozenset[int]:
        m = self.model
        if not isinstance(r, Request):
            raise TypeError(f"request: expected a Request, got {type(r).__name__}")
        if not isinstance(r.prompt, (list, tuple)) or not r.prompt:
            raise ValueError(f"prompt: expected a non-empty list of token ids, got {r.prompt!r:.80}")
        for i, t in enumerate(r.prompt):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"prompt: expected integer token ids, got {type(t).__name__} {t!r} at position {i}")
            if not 0 <= t < m.net.vocab_size:
                raise ValueError(f"prompt: token id {t} at position {i} is outside [0, {m.net.vocab_size})")
        if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, int) or r.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an int >= 1, got {r.max_tokens!r}")
        if len(r.prompt) + r.max_tokens > m.max_seq_len:
            raise ValueError(f"max_tokens: prompt of {len(r.prompt)} tokens + max_tokens={r.max_tokens} exceeds "
                             f"max_seq_len={m.max_seq_len}")
        if not isinstance(r.sampling, SamplingParams):
            raise TypeError(f"sampling: expected an ember.SamplingParams, got {type(r.sampling).__name__}")
        if r.sampling.seed is not None and not -2 ** 63 <= r.sampling.seed < 2 ** 63:
            raise ValueError(f"sampling: seed {r.sampling.seed} is outside int64 [-2^63, 2^63)")
        if not isinstance(r.stop_ids, (frozenset, set)) or any(isinstance(t, bool) or not isinstance(t, int)
                                                               for t in r.stop_ids):
            raise TypeError(f"stop_ids: expected a frozenset of token ids, got {r.stop_ids!r:.80}")
        if not isinstance(r.stop_strings, tuple) or any(not isinstance(s, str) or not s for s in r.stop_strings):
            raise ValueError(f"stop_strings: expected a tuple of non-empty strings, got {r.stop_strings!r:.80}")
        if r.stop_strings and m.tokenizer is None:
            raise ValueError(f"stop_strings: {m.name} has no tokenizer to match text against")
        if r.logprobs is not None and (isinstance(r.logprobs, bool) or not isinstance(r.logprobs, int)
                                       or not 0 <= r.logprobs <= min(MAX_LOGPROBS, m.net.vocab_size)):
            raise ValueError(f"logprobs: expected None or an int in [0, {min(MAX_LOGPROBS, m.net.vocab_size)}], "
                             f"got {r.logprobs!r}")
        return frozenset(r.stop_ids) | frozenset(m.eos_ids)

    # ------------------------------------------------------------------ the loop thread
    def _busy(self) -> bool:
        with self._lock:
            return bool(self._queue) or any(j is not None for j in self._rows)

    def _wake(self) -> None:
        with self._lock:
            self._cond.notify_all()

    def _ensure_thread(self) -> None:  # with the lock held
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="ember-scheduler", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        dev = self.model.device
        ctx = torch.cuda.device(dev) if dev.type == "cuda" else _nullcontext()
        with ctx, torch.no_grad():
            while True:
                with self._lock:
                    while not self._has_work():
                        if self._stopping or not self._persistent:
                            self._thread = None
                            return
                        self._cond.wait()
                    if self._stopping:
                        self._thread = None
                        return
                try:
                    self._iterate()
                except Exception as e:  # a bug in the loop itself: end every request, keep serving
                    with self._lock:
                        jobs = [j for j in self._rows if j is not None]
                    self._records.clear()
                    self._fail(jobs, e)

    def _has_work(self) -> bool:  # with the lock held
        return bool(self._queue or self._tasks or self._records or any(j is not None for j in self._rows))

    def _iterate(self) -> None:
        with self._lock:
            tasks, self._tasks = list(self._tasks), deque()
            cancelled = [j for j in self._queue if j.handle.cancel_requested]
            for j in cancelled:
                self._queue.remove(j)
            cancelled += [j for j in self._rows if j is not None and j.handle.cancel_requested]
            admitted = []
            while self._queue and None in self._rows:
                job = self._queue.popleft()
                job.slot = self._rows.index(None)
                self._rows[job.slot] = job
                admitted.append(job)
        for fn, box, done in tasks:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller of run_in_loop
                box["error"] = e
            done.set()
        for j in cancelled:
            self._finish(j, Event(None, "", finish_reason="cancelled"))
        for j in admitted:
            try:
                j.mode = sampling_mode(j.req.sampling, self.model.net.vocab_size)
                self.model._set_row_sampling(j.slot, j.req.sampling)
            except Exception as e:
                self._fail([j], e)
                continue
            self._prefilling.append(j)
        issued = False
        if self._prefilling:
            # an eager chunk can hold the host until the GPU has run it: deliver the steps issued
            # before it first, or their tokens wait behind the whole chunk (H200, an 8,192-token
            # prompt in two chunks among 8 streams: their longest gap was 990 ms of a 1,009 ms TTFT)
            while self._records:
                self._process(self._records.popleft())
            issued = self._prefill_once(self._prefilling[0])
        if any(j is not None and j.decoding for j in self._rows):
            issued = self._decode_once() or issued
        while len(self._records) > (1 if issued else 0):  # the newest stays in flight
            self._process(self._records.popleft())

    def _prefill_once(self, job: _Job) -> bool:
        m = self.model
        start, n, padded = job.plan.pop(0)
        try:
            if job.stash is not None:  # decode steps ran over this row since the last chunk
                for t, saved in zip(m._recurrent_state, job.stash):
                    t[job.slot].copy_(saved)
                job.stash = None
            logits = m._prefill_chunk(job.slot, list(job.req.prompt[start:start + n]), start, padded)
            self._counts["prefill_chunks"] += 1
            if job.plan:
                if m._recurrent_state:  # the conv / recurrent state the next chunk continues from
                    job.stash = [t[job.slot].clone() for t in m._recurrent_state]
                return True
            self._prefilling.popleft()
            lp = job.req.logprobs is not None
            tok = m._first_token(job.slot, logits, job.req.sampling, job.seed, lp)
            m._set_row_sampling(job.slot, job.req.sampling)  # again if a decode step's mode refilled the row
            m._join(job.slot, tok, len(job.req.prompt))
            job.decoding = True
            self._records.append(self._read(tok.view(1), [(0, job)], lp, slice(job.slot, job.slot + 1)))
        except Exception as e:
            if job in self._prefilling:
                self._prefilling.remove(job)
            self._fail([job], e)
        return True

    def _decode_once(self) -> bool:
        m = self.model
        rows = [(s, j) for s, j in enumerate(self._rows) if j is not None and j.decoding and not j.finished]
        if not rows:
            return False
        B = next(b for b in self.buckets if b > rows[-1][0])
        mode = batch_mode(j.mode for _, j in rows)
        lp = any(j.req.logprobs is not None for _, j in rows)
        if lp and mode != "greedy":
            mode = "any"  # logprobs steps: greedy or any (fewer graphs to capture at warm-up)
        try:
            m._decode(B, mode, lp)
            self._counts["decode_steps"] += 1
            self._records.append(self._read(m._tokens[:B], rows, lp, slice(0, B)))
        except Exception as e:
            self._fail([j for _, j in rows], e)
        return True

    def _read(self, tokens: torch.Tensor, rows, logprobs: bool, lp_rows: slice):
        """Start the copy of a step's tokens (and logprobs) to the host; the record to process later."""
        m = self.model
        srcs = [tokens] + ([m._lp[lp_rows], m._top_lp[lp_rows], m._top_ids[lp_rows]] if logprobs else [])
        if m.device.type != "cuda":
            return [t.clone() for t in srcs], None, rows
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in srcs]
        for h, t in zip(host, srcs):
            h.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev, rows

    def _process(self, record) -> None:
        host, ev, rows = record
        try:
            if ev is not None:
                ev.synchronize()
            toks = host[0].tolist()
            lps = [h.tolist() for h in host[1:]] if len(host) > 1 else None
        except Exception as e:
            self._fail([j for _, j in rows], e)
            return
        for i, job in rows:
            if job.finished:
                continue  # a row's step after its end (the host reads one step behind)
            try:
                lp = top = None
                k = job.req.logprobs
                if k is not None and lps is not None:
                    lp = float(lps[0][i])
                    top = [(int(t), float(v)) for t, v in zip(lps[2][i][:k], lps[1][i][:k])] if k > 0 else None
                self._emit(job, int(toks[i]), lp, top)
            except Exception as e:
                self._fail([job], e)

    def _emit(self, job: _Job, token: int, lp, top) -> None:
        h = job.handle
        h.sampled_tokens += 1
        self._counts["generated_tokens"] += 1
        if token in job.stop_ids:
            self._finish(job, Event(None, job.text.flush(), finish_reason="stop"))
            return
        text, hit = job.text.push(token)
        h.tokens.append(token)
        h.completion_tokens += 1
        if hit:
            self._finish(job, Event(token, text, lp, top, "stop"))
        elif h.sampled_tokens >= job.req.max_tokens:
            self._finish(job, Event(token, text + job.text.flush(), lp, top, "length"))
        else:
            h._push(Event(token, text, lp, top))

    def _finish(self, job: _Job, ev: Event) -> None:
        """Free the job's row (if any) and end its handle with ``ev``."""
        if job.finished:
            return
        job.finished = True
        self._free(job)
        job.handle._push(ev)

    def _fail(self, jobs, exc: BaseException) -> None:
        for j in jobs:
            if not j.finished:
                j.finished = True
                self._free(j)
                j.handle._fail(exc)

    def _free(self, job: _Job) -> None:
        if job in self._prefilling:
            self._prefilling.remove(job)
        with self._lock:
            if job.slot is not None and self._rows[job.slot] is job:
                self._rows[job.slot] = None
                try:
                    self.model._release(job.slot)
                except Exception:  # a broken device: the handle still ends
                    pass

    # ------------------------------------------------------------------ warm-up
    def _warmup(self) -> float:
        if self._busy():
            raise RuntimeError("warmup: requests are in flight; warm up before serving")
        m = self.model
        if m.device.type != "cuda":
            return 0.0  # nothing to capture or compile on the reference path
        t0 = time.perf_counter()
        lengths = [n for n in chunk_sizes(self.prefill_chunk) if n <= m.max_seq_len]
        try:  # the Triton compiles side by side, before the captures
            m._compile_ahead(compile_tasks(self.buckets, lengths))
        except torch.cuda.OutOfMemoryError as e:  # the prefills at once did not fit: one at a time below
            warnings.warn(f"warmup: compiling ahead ran out of GPU memory ({str(e)[:160]}); compiling one "
                          "kernel after another instead")
        for B in self.buckets:
            for mode in SAMPLING_MODES:
                m._graph(B, mode, False)
            for mode in ("greedy", "any"):
                m._graph(B, mode, True)
        # each prefill length once (Triton compiles for that length), then the first-token paths
        # of both samplers, in row 0 (free: the next request's prefill rewrites it)
        for n in lengths:  # (compiled above; again here for a tensor-parallel rank, in the ranks' order)
            logits = m._prefill_chunk(0, [0] * n, 0, n)
        if self.prefill_chunk < m.max_seq_len:  # a chunk after a cached prefix (the masked attention)
            m._prefill_chunk(0, [0], self.prefill_chunk, 1)
        prefill_graphs.capture(m, chunk_sizes(self.prefill_chunk))  # a prompt's first chunk, every length
        for sampling in _MODE_EXAMPLES:  # the first token's sampler path of each mode
            for lp in (False, True):
                m._first_token(0, logits, sampling, 0, lp)
        m._release(0)
        torch.cuda.synchronize(m.device)
        return time.perf_counter() - t0


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
