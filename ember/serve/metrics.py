"""The server's Prometheus metrics, written as the text exposition format by hand (a dependency for a
few counters and two histograms is not worth it).

Counters: requests by route and status code, finished generations by finish reason, prompt and
generated tokens. Histograms: time to first token, time per output token (the gap between two
tokens of one stream, as the client sees it), whole-request latency. Gauges, read from the scheduler
on each scrape: queue depth, slots in use, slots, and every other number ``Scheduler.metrics()``
reports (``ember_scheduler_<key>``).

Example:
    >>> m = Metrics()
    >>> m.request("/v1/completions", 200)
    >>> "ember_requests_total" in m.render({"queue_depth": 0, "slots_in_use": 0, "slots": 4})
    True
"""
from __future__ import annotations

import bisect
import re
import threading

# seconds; TTFT spans a decode step (ms) to a long prefill behind a queue (s)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_NAME = re.compile(r"[^a-zA-Z0-9_]")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, c in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            total += c
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {total}"]


class Metrics:
    """Counters and histograms the routes update; ``render`` adds the scheduler's gauges."""

    def __init__(self):
        self._lock = threading.Lock()  # updates come from the event loop; a scrape may come from anywhere
        self.requests: dict[tuple[str, int], int] = {}
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def generation(self, *, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                   ttft_s: float | None, gaps: list[float], latency_s: float) -> None:
        with self._lock:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += completion_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            for g in gaps:
                self.tpot.observe(g)
            self.latency.observe(latency_s)

    def render(self, scheduler: dict) -> str:
        with self._lock:
            lines = ["# HELP ember_requests_total HTTP requests by route and status code.",
                     "# TYPE ember_requests_total counter"]
            lines += [f'ember_requests_total{{route="{r}",code="{c}"}} {n}' for (r, c), n in sorted(self.requests.items())]
            lines += ["# HELP ember_generations_total Finished generations by finish reason.",
                      "# TYPE ember_generations_total counter"]
            lines += [f'ember_generations_total{{finish_reason="{k}"}} {n}' for k, n in sorted(self.finished.items())]
            for name, v, doc in (("ember_prompt_tokens_total", self.prompt_tokens, "Prompt tokens prefilled."),
                                 ("ember_generation_tokens_total", self.generated_tokens, "Tokens generated.")):
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name} {v}"]
            for name, h, doc in (("ember_time_to_first_token_seconds", self.ttft, "Submit to first token."),
                                 ("ember_time_per_output_token_seconds", self.tpot, "Gap between two tokens of a stream."),
                                 ("ember_request_duration_seconds", self.latency, "Submit to the last token.")):
                lines += [f"# HELP {name} {doc}", f"# TYPE {name} histogram", *h.lines(name)]
        known = {"queue_depth": ("ember_queue_depth", "Requests waiting for a slot."),
                 "slots_in_use": ("ember_slots_in_use", "Cache rows holding a running request."),
                 "slots": ("ember_slots", "Cache rows (the largest batch a decode step runs).")}
        for key, v in scheduler.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue  # non-numeric scheduler details are not Prometheus samples
            name, doc = known.get(key, (f"ember_scheduler_{_NAME.sub('_', key)}", f"Scheduler.metrics()['{key}']."))
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name} {v!r}"]
        return "\n".join(lines) + "\n"
