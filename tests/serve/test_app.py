"""The app in process (``ember.serve.app`` over a stand-in scheduler) for what a live engine rarely
does on cue: a full queue (429 + Retry-After), an engine failure (500, or an error event mid-stream),
the scheduler's gauges in /metrics; and on the live server, a disconnect freeing its slot."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.serve.conftest import API_KEY, NAME, parse_prometheus

httpx = pytest.importorskip("httpx")

import ember.serve  # noqa: E402
from ember.engine.scheduler import Event, QueueFull  # noqa: E402


class Handle:
    def __init__(self, request, events):
        self.id, self.prompt_tokens, self.completion_tokens = "h0", len(request.prompt), 0
        self.finish_reason, self.ttft_s, self._events, self.cancelled = None, None, events, False

    async def __aiter__(self):
        for ev in self._events:
            if ev.token is not None:
                self.completion_tokens += 1
            self.finish_reason = ev.finish_reason
            yield ev

    def cancel(self):
        self.cancelled = True


class StandIn:
    """Duck-types Scheduler: ``full`` makes submit raise QueueFull; else handles replay ``events``."""

    def __init__(self, events=(), full=False):
        self.events, self.full, self.submitted = list(events), full, []

    def submit(self, request):
        if self.full:
            raise QueueFull("the waiting queue holds 4 requests")
        self.submitted.append(request)
        return Handle(request, self.events)

    def metrics(self):
        return {"queue_depth": 4, "slots_in_use": 2, "slots": 2, "prefill_tokens": 7, "device": "cpu"}

    def start(self):
        pass


def call(app, method, path, **kw):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


BODY = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 3}


def test_full_queue_is_429_with_retry_after(oracle):
    app = ember.serve.app(oracle, scheduler=StandIn(full=True), model_name=NAME)
    r = call(app, "POST", "/v1/completions", json=BODY)
    assert r.status_code == 429 and r.headers["Retry-After"].isdigit()
    assert r.json()["error"]["type"] == "rate_limit_error" and "queue is full" in r.json()["error"]["message"]
    m = parse_prometheus(call(app, "GET", "/metrics").text)
    assert m["ember_queue_depth"] == 4 and m["ember_slots_in_use"] == 2 and m["ember_slots"] == 2
    assert m["ember_scheduler_prefill_tokens"] == 7 and not any("device" in k for k in m)
    assert m['ember_requests_total{route="/v1/completions",code="429"}'] == 1


def test_engine_error_is_500_or_an_error_event(oracle):
    events = [Event(9, "a", None, None, None), Event(None, "", None, None, "error")]
    app = ember.serve.app(oracle, scheduler=StandIn(events), model_name=NAME)
    r = call(app, "POST", "/v1/completions", json=BODY)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    r = call(app, "POST", "/v1/completions", json=BODY | {"stream": True})
    lines = [x for x in r.text.split("\n\n") if x]
    assert lines[0].startswith('data: {"id"') and '"error"' in lines[1] and lines[-1] == "data: [DONE]"


def test_request_maps_to_the_scheduler_request(oracle):
    sched = StandIn([Event(9, " a", -0.5, [(9, -0.5), (3, -1.0)], "length")])
    app = ember.serve.app(oracle, scheduler=sched, model_name=NAME)
    r = call(app, "POST", "/v1/chat/completions",
             json={"model": NAME, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                   "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.05, "seed": 3, "stop": "x",
                   "stop_token_ids": [2], "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    req, = sched.submitted
    tok = oracle.tokenizer
    assert req.prompt == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 0, 0.05, 3)
    assert req.stop_strings == ("x",) and req.stop_ids == frozenset({2}) and req.logprobs == 2
    assert req.max_tokens == oracle.max_seq_len - len(req.prompt)  # no max_tokens: what the cache row holds
    c = r.json()["choices"][0]
    assert c["message"]["content"] == " a" and c["finish_reason"] == "length"
    entry = c["logprobs"]["content"][0]
    assert entry["logprob"] == -0.5 and [t["logprob"] for t in entry["top_logprobs"]] == [-0.5, -1.0]
    assert entry["bytes"] == list(entry["token"].encode())


def test_disconnect_mid_stream_frees_the_slot(server):
    h = {"Authorization": f"Bearer {API_KEY}"}
    key = 'ember_generations_total{finish_reason="cancelled"}'
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=h, timeout=60,
                      json={"model": NAME, "prompt": [5, 6, 7], "max_tokens": 90, "temperature": 0,
                            "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 2:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["ember_slots_in_use"] == 0 and m.get(key, 0) > before.get(key, 0):
            break
        time.sleep(0.05)
    assert m["ember_slots_in_use"] == 0 and m.get(key, 0) == before.get(key, 0) + 1
    made = m["ember_generation_tokens_total"] - before["ember_generation_tokens_total"]
    assert made < 90  # it stopped, not ran to max_tokens
