"""A bounded load test of a live ``ember serve``: two rounds of 64 concurrent requests (random prompt and
output lengths, chat and completions, streamed and not, greedy and seeded), 10 % cancelled mid-stream,
5 % malformed. Every well-formed request completes with the right finish reason and token count
(greedy ones with exactly ``model.generate``'s text), every malformed one gets a 4xx JSON error naming
the field, all slots are free afterwards and the server's memory is flat across the rounds."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from tests.serve.conftest import API_KEY, MAX_SEQ_LEN, NAME, SLOTS

httpx = pytest.importorskip("httpx")

N = 64
WORD_IDS = range(4, 40)  # tests.models.tiny: ids 4.. are words
MAX_OUT = 12


def _plan(rng: random.Random, prompts: list[list[int]]) -> list[dict]:
    """One round: (kind, body, what to check) per request, shuffled."""
    jobs = []
    for i in range(N):
        if i % 20 == 0:  # 5 %: malformed, one of four ways
            jobs.append({"kind": "bad", "case": i // 20 % 4})
        elif i % 10 == 5:  # 10 %: cancelled after two chunks of a long stream
            jobs.append({"kind": "cancel", "body": {"model": NAME, "prompt": rng.choice(prompts), "max_tokens": 30,
                                                    "temperature": 0, "stream": True}})
        else:
            p, m = rng.randrange(len(prompts)), rng.randint(1, MAX_OUT)
            body = {"model": NAME, "max_tokens": m, "stream": rng.random() < 0.5}
            greedy = rng.random() < 0.6
            body |= {"temperature": 0} if greedy else {"temperature": 0.9, "seed": rng.randrange(1 << 30)}
            if rng.random() < 0.5:
                body |= {"prompt": prompts[p]}
                route = "completions"
            else:
                body |= {"messages": [{"role": "user", "content": " ".join(map(str, prompts[p]))}]}
                route = "chat/completions"
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
                if route == "completions":
                    body["logprobs"] = 0  # its chunks then list their tokens (a text chunk may hold none)
            jobs.append({"kind": "ok", "route": route, "body": body, "prompt": p, "greedy": greedy})
    rng.shuffle(jobs)
    return jobs


BAD = [  # (raw body, the field the error must name)
    (b'{"model": "tiny-moe", "prompt": [5, 6', None),
    (json.dumps({"model": NAME, "prompt": [5, 6], "max_tokens": 4.5}).encode(), "max_tokens"),
    (json.dumps({"model": NAME, "prompt": [5] * (MAX_SEQ_LEN - 3), "max_tokens": 8}).encode(), "max_tokens"),
    (json.dumps({"model": NAME, "prompt": [5, 6], "top_p": 0.0}).encode(), "top_p"),
]


async def _sse(r) -> list[dict]:
    out = []
    async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


async def _one(client, job, url) -> dict:
    if job["kind"] == "bad":
        body, param = BAD[job["case"]]
        r = await client.post(f"{url}/v1/completions", content=body)
        return {"job": job, "status": r.status_code, "json": r.json(), "param": param}
    if job["kind"] == "cancel":
        async with client.stream("POST", f"{url}/v1/completions", json=job["body"]) as r:
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 2:
                    break  # leaving the block closes the connection mid-stream
        return {"job": job, "chunks": n}
    body, route = job["body"], job["route"]
    if not body["stream"]:
        r = await client.post(f"{url}/v1/{route}", json=body)
        return {"job": job, "status": r.status_code, "json": r.json()}
    async with client.stream("POST", f"{url}/v1/{route}", json=body) as r:
        return {"job": job, "status": r.status_code, "chunks": await _sse(r)}


def _text_usage_reason(res) -> tuple[str, dict, str, int | None]:
    """(text, usage, finish reason, token chunks or None) of a well-formed result, streamed or not."""
    chat = res["job"]["route"] == "chat/completions"
    if "json" in res:
        c = res["json"]["choices"][0]
        return (c["message"]["content"] if chat else c["text"]), res["json"]["usage"], c["finish_reason"], None
    chunks = res["chunks"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    body = [ch["choices"][0] for ch in chunks[:-1]]
    if chat:
        assert body[0]["delta"] == {"role": "assistant", "content": ""}
        body = body[1:]
    texts = [b["delta"].get("content") if chat else b["text"] for b in body]
    reasons = [b["finish_reason"] for b in body if b["finish_reason"]]
    assert len(reasons) == 1 and body[-1]["finish_reason"] == reasons[0]
    # tokens: a chat chunk with content carries one (text-free final chunks have an empty delta); a
    # completion chunk lists its tokens in logprobs
    tokens = sum(t is not None for t in texts) if chat else sum(len(b["logprobs"]["tokens"]) for b in body)
    return "".join(t or "" for t in texts), usage, reasons[0], tokens


async def _round(url, jobs):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=N + 8, max_keepalive_connections=N + 8)
    async with httpx.AsyncClient(headers=headers, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(_one(client, j, url) for j in jobs))


def _settle(server, timeout=20.0) -> dict:
    """Metrics once every slot is free and the queue empty (cancellations land within a step)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["ember_slots_in_use"] == 0 and m["ember_queue_depth"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_bounded_load(server, oracle):
    rng = random.Random(0)
    tok = oracle.tokenizer
    prompts = [[rng.choice(WORD_IDS) for _ in range(rng.randint(3, 24))] for _ in range(6)]
    # greedy continuations by model.generate alone; a shorter max_tokens takes a prefix of them
    chat_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": " ".join(map(str, p))}]))
                for p in prompts]
    want = {("completions", i): oracle.generate([p], max_new_tokens=MAX_OUT)[0] for i, p in enumerate(prompts)}
    want |= {("chat/completions", i): oracle.generate([p], max_new_tokens=MAX_OUT)[0] for i, p in enumerate(chat_ids)}
    before = server.metrics()
    rss = []
    for _ in range(2):
        jobs = _plan(rng, prompts)
        results = asyncio.run(_round(server.url, jobs))
        for res in results:
            job = res["job"]
            if job["kind"] == "bad":
                err = res["json"]["error"]
                assert 400 <= res["status"] < 500 and err["param"] == res["param"], res
                assert res["param"] is None and "JSON" in err["message"] or res["param"] in err["message"], res
                continue
            if job["kind"] == "cancel":
                assert res["chunks"] == 2
                continue
            assert res["status"] == 200, res
            text, usage, reason, n_chunks = _text_usage_reason(res)
            m = job["body"]["max_tokens"]
            P = len(prompts[job["prompt"]]) if job["route"] == "completions" else len(chat_ids[job["prompt"]])
            assert usage["prompt_tokens"] == P and usage["total_tokens"] == P + usage["completion_tokens"]
            if n_chunks is not None:
                assert n_chunks == usage["completion_tokens"], res
            if job["greedy"]:  # EOS never wins an argmax in this checkpoint: always max_tokens
                assert (reason, usage["completion_tokens"]) == ("length", m), res
                assert text == tok.decode(want[(job["route"], job["prompt"])][:m]), res
            else:  # sampled: EOS may come first
                n = usage["completion_tokens"]
                assert (reason == "length" and n == m) or (reason == "stop" and n < m), res
        after = _settle(server)
        assert after["ember_slots_in_use"] == 0 and after["ember_queue_depth"] == 0, after
        assert after["ember_slots"] == SLOTS
        rss.append(server.rss_bytes())
    n_cancel = sum(j["kind"] == "cancel" for j in jobs)
    cancelled = after.get('ember_generations_total{finish_reason="cancelled"}', 0) - before.get(
        'ember_generations_total{finish_reason="cancelled"}', 0)
    assert cancelled == 2 * n_cancel, after  # each one was cancelled, not run to its end
    assert server.proc.poll() is None
    # flat: the second round allocates nothing the first did not (allocator noise allowed)
    assert rss[1] - rss[0] < 24 << 20, [r >> 20 for r in rss]
