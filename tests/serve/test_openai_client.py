"""The real openai client (sync and async, streaming and not) against a live ``ember serve``, checked
against ``model.generate`` on the same checkpoint in this process."""
from __future__ import annotations

import asyncio
import math

import pytest

openai = pytest.importorskip("openai")
import torch  # noqa: E402

from tests.serve.conftest import API_KEY, MAX_SEQ_LEN, NAME, SLOTS  # noqa: E402

CHAT = [{"role": "user", "content": "hello world once upon a time"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def aclient(server):
    """A factory: an async client lives in one event loop (one ``asyncio.run``)."""
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def token_text(oracle, t: int) -> str:
    """What the server names a token in logprobs: its text, a special token by its vocabulary entry."""
    return oracle.tokenizer.decode([t]) or oracle.tokenizer._tok.id_to_token(t)


def expected(oracle, ids: list[int], n: int) -> tuple[list[int], str]:
    """Greedy continuation of ``ids`` by model.generate alone: (token ids, finish reason)."""
    out = oracle.generate([ids], max_new_tokens=n)[0]
    return out, "length" if len(out) == n else "stop"


def test_models_health_and_auth(server, client):
    import httpx
    assert [m.id for m in client.models.list()] == [NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # no key needed
    for method, route in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                          ("POST", "/v1/chat/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = httpx.request(method, f"{server.url}{route}", headers=headers, json={})
            assert r.status_code == 401, (route, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_greedy_equals_generate_sync_and_stream(client, oracle):
    tok = oracle.tokenizer
    ids = tok.encode(tok.apply_chat_template(CHAT))
    want, reason = expected(oracle, ids, 12)
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == NAME
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == tok.decode(want)
    assert c.finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(want),
                                                                                        len(ids) + len(want))
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-1].usage.prompt_tokens == len(ids)
    body = [ch for ch in chunks[1:-1] if ch.choices[0].delta.content is not None]
    assert "".join(ch.choices[0].delta.content for ch in body) == c.message.content
    assert len(body) == len(want)  # one chunk per token (a special token's is empty text)
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]].count(reason) == 1
    assert chunks[-2].choices[0].finish_reason == reason


def test_completions_token_ids_logprobs_async(aclient, oracle):
    new = aclient
    prompt = [5, 9, 12, 7, 30, 22]
    want, reason = expected(oracle, prompt, 10)

    async def both():
        aclient = new()
        plain = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
        stream = await aclient.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0,
                                                  logprobs=3, stream=True, stream_options={"include_usage": True})
        return plain, [ch async for ch in stream]

    plain, chunks = asyncio.run(both())
    c = plain.choices[0]
    assert c.text == oracle.tokenizer.decode(want) and c.finish_reason == reason
    assert plain.usage.completion_tokens == len(want) and plain.usage.prompt_tokens == len(prompt)
    # logprobs: log-softmax of the model's logits at each chosen token (a cache-free forward here)
    logits = oracle(prompt + want)[0, len(prompt) - 1:-1].double()
    ref = torch.log_softmax(logits, -1)
    lp = c.logprobs
    assert lp.tokens == [token_text(oracle, t) for t in want]
    for i, t in enumerate(want):
        assert math.isclose(lp.token_logprobs[i], ref[i, t].item(), abs_tol=1e-3)
        top = torch.topk(ref[i], 3)
        got = lp.top_logprobs[i]
        assert len(got) == 3
        for v, j in zip(top.values.tolist(), top.indices.tolist()):
            assert math.isclose(got[token_text(oracle, j)], v, abs_tol=1e-3)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text and chunks[-1].usage.completion_tokens == len(want)
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices) == len(want)


def test_text_prompt_and_stop_strings(client, oracle):
    tok = oracle.tokenizer
    prompt = "the cat sat on the mat and then"
    want, _ = expected(oracle, tok.encode(prompt), 16)
    words = tok.decode(want).split(" ")
    stop = " " + words[3]  # a word the greedy continuation reaches: the text ends before it
    cut = tok.decode(want)
    cut = cut[:cut.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "zzz"],
                                      stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(ch.choices[0].text for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (text, reason) == (cut, "stop"), stream


def test_seeds_reproducible_and_independent_of_load(aclient):
    new = aclient
    prompt = [4, 8, 15, 16, 23]
    kw = dict(model=NAME, prompt=prompt, max_tokens=16, temperature=1.0, extra_body={"top_k": 20, "min_p": 0.01})

    async def run():
        aclient = new()
        alone = await aclient.completions.create(seed=1234, **kw)
        again = await aclient.completions.create(seed=1234, **kw)
        # the same seeded request among others of other lengths (it lands in another slot, another batch)
        others = [aclient.completions.create(model=NAME, prompt=[7] * (3 + i), max_tokens=6 + 2 * i, temperature=0.8)
                  for i in range(SLOTS + 1)]
        loaded, *_ = await asyncio.gather(aclient.completions.create(seed=1234, **kw), *others)
        other_seed = await aclient.completions.create(seed=99, **kw)
        return alone, again, loaded, other_seed

    alone, again, loaded, other_seed = asyncio.run(run())
    text = alone.choices[0].text
    assert again.choices[0].text == text and loaded.choices[0].text == text
    assert other_seed.choices[0].text != text  # the seed is honoured, not ignored


def test_errors_name_the_field(server, client, oracle):
    import httpx
    h = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.url}/v1"
    ok = {"model": NAME, "prompt": [5, 6], "max_tokens": 4}
    cases = [  # (body, status, param, words in the message)
        (b"{not json", 400, None, "JSON"),
        (ok | {"max_tokens": "4"}, 400, "max_tokens", "integer"),
        (ok | {"temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
        (ok | {"top_p": 1.5}, 400, "top_p", "1"),
        (ok | {"n": 2}, 400, "n", "n=1"),
        (ok | {"stream": "yes"}, 400, "stream", "boolean"),
        (ok | {"prompt": [[1, 2], [3]]}, 400, "prompt", "batch"),
        (ok | {"prompt": [5, 10 ** 6]}, 400, None, str(10 ** 6)),
        (ok | {"max_tokens": MAX_SEQ_LEN}, 400, "max_tokens", f"{MAX_SEQ_LEN + 2} > max_seq_len={MAX_SEQ_LEN}"),
        (ok | {"prompt": [5] * (MAX_SEQ_LEN + 1)}, 400, "prompt", f"{MAX_SEQ_LEN + 1} tokens"),
        (ok | {"frobnicate": 1}, 400, "frobnicate", "unrecognized"),
        (ok | {"model": "gpt-4"}, 404, "model", NAME),
    ]
    for body, status, param, words in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{url}/completions", headers=h, **kw)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and words in err["message"], (body, err)
    r = httpx.post(f"{url}/chat/completions", headers=h,
                   json={"model": NAME, "messages": [{"role": "user", "content": 3}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX_SEQ_LEN)
    n = len(oracle.tokenizer.encode(oracle.tokenizer.apply_chat_template(CHAT)))
    assert f"the prompt is {n} tokens and max_tokens is {MAX_SEQ_LEN}" in e.value.message
    big = b'{"model": "x", "prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(f"{url}/completions", headers=h, content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
