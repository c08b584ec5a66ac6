"""The engine runs the hybrid families end to end: ember.load on a saved checkpoint, then generate
with the static caches the net describes (conv and recurrent state included), against transformers'
own greedy generate."""
import pytest
import torch

import ember
from tests.models.test_lfm2_moe import NEW, PROMPT_LEN, VOCAB, build_hf, hf_greedy, lfm2_config
from tests.models import test_qwen3_5_moe as q35


def _families():
    return {"lfm2_moe": lambda: build_hf(lfm2_config()), "qwen3_5_moe": lambda: q35.build_hf("text"),
            "qwen3_5_moe_image_text": lambda: q35.build_hf("image_text", **q35.VARIANTS["image_text"][1])}


@pytest.mark.parametrize("family", sorted(_families()))
def test_load_and_generate_match_transformers(family, tmp_path):
    hf = _families()[family]()
    hf.save_pretrained(tmp_path)
    model = ember.load(tmp_path, dtype=torch.float32, max_seq_len=64, max_batch_size=2)
    assert model.net.cache_specs(2, 64, torch.float32) == [tuple((tuple(t.shape), t.dtype) for t in layer)
                                                           for layer in model.caches]
    prompts = [torch.randint(1, VOCAB, (PROMPT_LEN,)).tolist(), torch.randint(1, VOCAB, (PROMPT_LEN - 3,)).tolist()]
    got = model.generate(prompts, max_new_tokens=NEW)
    for p, g in zip(prompts, got):
        exp = hf_greedy(hf, torch.tensor([p]), NEW)[0].tolist()
        assert g == exp
    # a second request reuses the caches: the state a previous request left must not leak
    again = model.generate(prompts[:1], max_new_tokens=NEW)
    assert again[0] == got[0]


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(_families()))
def test_gpu_graph_generate_equals_eager(family, tmp_path, cuda):
    """The captured step advances conv / recurrent state in place: its warm-up must leave none behind."""
    _families()[family]().save_pretrained(tmp_path)
    model = ember.load(tmp_path, device=cuda, dtype=torch.bfloat16, max_seq_len=64, max_batch_size=2)
    prompts = [torch.randint(1, VOCAB, (PROMPT_LEN,)).tolist(), torch.randint(1, VOCAB, (5,)).tolist()]
    model.use_cuda_graph = False
    eager = model.generate(prompts, max_new_tokens=NEW)
    model.use_cuda_graph = True
    assert model.generate(prompts, max_new_tokens=NEW) == eager
    assert model.generate(prompts, max_new_tokens=NEW) == eager  # replayed graph, reused caches


@pytest.mark.parametrize("family", ["lfm2_moe", "qwen3_5_moe"])
def test_recurrent_state_is_the_conv_and_deltanet_states_not_the_kv_caches(family, tmp_path):
    """What warm-up clones and chunked prefill stashes per row: the states a step rewrites. The
    attention layers' KV caches (Qwen3.5's gated attention has a cache spec of its own) stay out: at
    long contexts they are GBs, and a step only appends to them."""
    _families()[family]().save_pretrained(tmp_path)
    model = ember.load(tmp_path, dtype=torch.float32, max_seq_len=64, max_batch_size=2)
    ptrs = {t.data_ptr() for t in model._recurrent_state}
    kinds = {"recurrent": 0, "attention": 0}
    for layer, cache in zip(model.net.layers, model.caches):
        recurrent = type(layer.attn).__name__ in ("ShortConv", "GatedDeltaNet")
        kinds["recurrent" if recurrent else "attention"] += 1
        assert all((t.data_ptr() in ptrs) == recurrent for t in cache), type(layer.attn).__name__
    assert kinds["recurrent"] and kinds["attention"]
