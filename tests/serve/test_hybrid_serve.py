"""A live ``ember serve`` over a tiny random LFM2-MoE checkpoint (short convolutions + attention), with
a 4-token prefill chunk: concurrent requests prefill in padded chunks between the decode steps of the
others, so each row's conv state is stashed, restored and stopped at its last real token. Every
completion must equal transformers' greedy continuation of its prompt."""
from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")
import torch  # noqa: E402

from tests.models import tiny  # noqa: E402
from tests.models.test_lfm2_moe import build_hf, hf_greedy, lfm2_config  # noqa: E402
from tests.serve.conftest import API_KEY, start, stop  # noqa: E402

NEW = 8


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    hf = build_hf(lfm2_config(vocab_size=len(tiny.SPECIALS) + len(tiny.WORDS)), seed=5)
    path = tiny.save(hf, tmp_path_factory.mktemp("serve_lfm2") / "tiny-lfm2", tokenizer=True)
    live = start(path, tmp_path_factory.mktemp("log") / "server.log", "--api-key", API_KEY,
                 "--prefill-chunk", "4")
    yield hf, live, path
    assert stop(live) == 0, live.log.read_text()


def test_concurrent_padded_chunked_prefills_match_transformers(hybrid):
    hf, live, path = hybrid
    g = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(len(tiny.SPECIALS), vocab, (n,), generator=g).tolist() for n in (3, 6, 9, 11, 13)]

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        return await asyncio.gather(*[
            client.completions.create(model="tiny-lfm2", prompt=p, max_tokens=NEW, temperature=0, logprobs=1)
            for p in prompts])

    results = asyncio.run(all_at_once())
    from ember.engine.tokenizer import load_tokenizer
    tok = load_tokenizer(path)
    lengths = []
    for p, r in zip(prompts, results):
        want = hf_greedy(hf, torch.tensor([p]), NEW)[0].tolist()
        if 1 in want:  # the EOS id (tiny.save's) ends the request there
            want = want[:want.index(1)]
        c = r.choices[0]
        assert c.text == tok.decode(want), (p, c.text, want)
        # the logprob of each token against transformers' forward over prompt + continuation: a state
        # that ran through the padding shows here even where the greedy token survives it
        with torch.no_grad():
            ids = torch.tensor([p + want])
            ref = torch.log_softmax(hf(ids, attention_mask=torch.ones_like(ids)).logits[0].double(), -1)
        ref = [ref[len(p) - 1 + i, t].item() for i, t in enumerate(want)]
        assert c.logprobs.token_logprobs == pytest.approx(ref, abs=1e-4)
        assert c.finish_reason == ("length" if len(want) == NEW else "stop")
        assert r.usage.prompt_tokens == len(p)
        lengths.append(len(want))
    assert sum(lengths) >= 2 * NEW, lengths  # the comparison is over real continuations, not early stops
