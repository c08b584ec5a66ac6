"""The engine's input checks on CPU: token ids that are not integers, sequences past the trained
length, seeds outside int64, a KV cache larger than free memory."""
import warnings

import numpy as np
import pytest
import torch

import ember
import ember.engine as engine
from tests.models import tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # no tokenizer and no eos: token-id prompts run the full max_new_tokens
    path = tiny.save(tiny.build(tiny.dense_config(max_position_embeddings=16)), tmp_path_factory.mktemp("eng"))
    return ember.load(path, device="cpu", max_seq_len=48)


@pytest.mark.parametrize("prompts, words", [
    ([1.0, 2.0, 3.0], "got float 1.0 at position 0"),
    ([[4, 5, 6.7]], "prompts[0]: expected integer token ids, got float 6.7 at position 2"),
    ([[4, 5], [6, True]], "prompts[1]: expected integer token ids, got bool True at position 1"),
    ([np.float32(3.0)], "got float32"),
    (torch.tensor([[1.0, 2.0]]), "expected a 1-d tensor of integer token ids, got torch.float32"),
    ([torch.tensor([1.5, 2.0])], "got torch.float32"),
])
def test_non_integer_token_ids_are_refused_not_truncated(model, prompts, words):
    with pytest.raises(TypeError) as info:
        model.generate(prompts, max_new_tokens=2)
    assert words in str(info.value)
    with pytest.raises(TypeError):
        next(iter(model.stream([3, 4.5], max_new_tokens=2)))


def test_integer_token_ids_in_every_form_agree(model):
    want = model.generate([[3, 9, 27]], max_new_tokens=4)
    for form in ([3, 9, 27], [np.int64(3), np.int32(9), 27], torch.tensor([3, 9, 27]),
                 torch.tensor([[3, 9, 27]], dtype=torch.int32), [torch.tensor([3, 9, 27])]):
        assert model.generate(form, max_new_tokens=4) == want


def test_passing_max_position_embeddings_warns_once(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate([list(range(1, 11))], max_new_tokens=4)  # 14 <= 16: quiet
        assert not caught
        out = model.generate([list(range(1, 11))], max_new_tokens=20)  # 30 > 16: one warning
    assert len(out[0]) == 20
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "max_position_embeddings=16" in msgs[0], msgs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(model.stream(list(range(1, 21)), max_new_tokens=3))  # the prompt alone is past it
    assert len(caught) == 1


def test_seed_outside_int64_is_refused(model):
    with pytest.raises(ValueError, match=r"seed 18446744073709551616 is outside int64"):
        model.generate([[1, 2]], max_new_tokens=2, sampling=ember.SamplingParams(temperature=1.0, seed=2 ** 64))


def test_free_host_memory_is_read():
    free = engine._free_host_memory()
    assert free is None or free > 0
    if free is not None:
        assert free < 1 << 50  # bytes, not kB or pages gone wrong


def test_cpu_cache_larger_than_free_memory_is_refused_before_allocating(tmp_path, monkeypatch):
    path = tiny.save(tiny.build(tiny.dense_config()), tmp_path / "ckpt")
    # 2 layers x (k, v) x 2 heads x 16 dims x 4 bytes = 512 bytes a token: 2.1 MB for 4,096 tokens
    monkeypatch.setattr(engine, "_free_host_memory", lambda: 1_000_000)
    allocated = []
    real = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocated.append(a) or real(*a, **k))
    with pytest.raises(MemoryError, match=r"need ~2\.1 MB \(1 x 4096 tokens\), 1\.0 MB free") as info:
        ember.load(path, device="cpu", max_seq_len=4096)
    assert "KV cache" in str(info.value)
    assert not any(len(a) and a[0] == (1, 2, 4096, 16) for a in allocated)
    monkeypatch.setattr(engine, "_free_host_memory", lambda: 3_000_000)
    assert ember.load(path, device="cpu", max_seq_len=4096).max_seq_len == 4096


def test_decode_graph_names_a_missing_capture(model):
    """The benchmarks' access to the captured step: on CPU nothing is captured, and the error says what to run."""
    with pytest.raises(KeyError, match=r"no captured decode step for batch 1.*model.warmup\(1\)"):
        model.decode_graph(1)


def test_prefill_last_is_the_engine_prefill(model):
    """``prefill_last`` (what the prefill benchmark times) gives the logits of the eager forward."""
    prompt = [3, 1, 4, 1, 5]
    logits = model.prefill_last(0, prompt)
    row = [tuple(t[:1] for t in layer) for layer in model.caches]
    torch.testing.assert_close(logits, model.net.prefill(torch.tensor([prompt]), row, last_only=True))
