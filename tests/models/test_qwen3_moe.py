"""Model oracle: tiny random Qwen3-MoE / Qwen3 models built and saved by transformers, loaded by
ember, compared with transformers' own forward and greedy generate (fp32 on CPU)."""
import pytest
import torch

import ember
from tests.models import tiny

PROMPT_LEN, NEW = 9, 32


def _hf_greedy(model, ids, n):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def _engine_decode_logits(em, prompt, tokens):
    """Logits the engine's cached path produces (prefill into the cache, then one decode step per
    token), driven through the same net.prefill / net.decode calls generate uses."""
    net, caches = em.net, [(k[:1], v[:1]) for k, v in em.caches]
    with torch.no_grad():
        out = [net.prefill(prompt, caches, last_only=True)]
        for i, t in enumerate(tokens[:-1]):
            pos = torch.tensor([prompt.shape[1] + i])
            out.append(net.decode(torch.tensor([t]), pos, (pos + 1).to(torch.int32), caches))
    return torch.cat(out)


@pytest.fixture(scope="module", params=["moe", "moe_dense_layer", "dense"])
def pair(request, tmp_path_factory):
    if request.param == "moe":
        cfg = tiny.moe_config()
    elif request.param == "moe_dense_layer":  # layer 1 keeps a dense MLP; norm_topk_prob off
        cfg = tiny.moe_config(mlp_only_layers=[1], norm_topk_prob=False, num_hidden_layers=2)
    else:
        cfg = tiny.dense_config()
    hf = tiny.build(cfg)
    path = tiny.save(hf, tmp_path_factory.mktemp(request.param))
    return hf, ember.load(path, max_seq_len=64, max_batch_size=2)


def test_cache_free_forward_matches_transformers(pair):
    hf, em = pair
    ids = torch.randint(0, 128, (2, 13))
    with torch.no_grad():
        ref = hf(ids).logits
    got = em(ids)
    assert got.shape == ref.shape and got.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-4 * scale


def test_greedy_decode_matches_transformers_generate(pair):
    hf, em = pair
    prompt = torch.randint(0, 128, (1, PROMPT_LEN))
    ref = _hf_greedy(hf, prompt, NEW)[0].tolist()
    got = em.generate(prompt[0].tolist(), max_new_tokens=NEW)[0]
    assert got == ref
    # and every cached decode step's logits match transformers' full forward over the sequence
    full = torch.cat([prompt, torch.tensor([ref])], 1)
    with torch.no_grad():
        ref_logits = hf(full).logits[0, PROMPT_LEN - 1:-1]
    dec = _engine_decode_logits(em, prompt, ref)
    assert (dec - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()


def test_batch_of_two_different_lengths(pair):
    hf, em = pair
    a, b = torch.randint(0, 128, (1, 5)), torch.randint(0, 128, (1, 12))
    got = em.generate([a[0].tolist(), b[0].tolist()], max_new_tokens=8)
    assert got == [_hf_greedy(hf, a, 8)[0].tolist(), _hf_greedy(hf, b, 8)[0].tolist()]


def test_prefill_last_index_reads_the_last_real_position_of_a_padded_prompt(pair):
    """What the engine's prefill graphs rely on: padding after the prompt changes nothing before it."""
    _, em = pair
    prompt = torch.randint(0, em.net.vocab_size, (1, 13))
    padded = torch.cat([prompt, torch.zeros(1, 19, dtype=torch.long)], 1)
    ref = em.net.prefill(prompt, last_only=True)
    out = em.net.prefill(padded, last_index=torch.tensor([12]))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(em.net.prefill(padded, last_only=True), ref, atol=1e-3)  # the pad's own logits differ


def test_cached_decode_through_the_kernels_matches_transformers(pair, interpreter):
    """The default decode through the Triton kernels (interpreter): the post-attention norm in the
    router's launch, the pre-attention norm deferred (scaled by the MoE down GEMV, 1 / rms applied
    after the qkv projection); the cached decode logits still match transformers' forward."""
    hf, em = pair
    prompt = torch.randint(0, 128, (1, 5))
    tokens = torch.randint(0, 128, (4,)).tolist()
    full = torch.cat([prompt, torch.tensor([tokens])], 1)
    with torch.no_grad():
        ref_logits = hf(full).logits[0, 4:-1]
    dec = _engine_decode_logits(em, prompt, tokens)
    assert (dec - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()
