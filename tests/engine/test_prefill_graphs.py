"""A prompt's first prefill chunk as one CUDA graph per padded length (ember.engine.prefill_graphs), and
the prefill chunk length derived from the model (ember.engine.default_prefill_chunk).

On CPU: what a graph runs (``staged_prefill``: prefill into a one-row staging cache, then copy into the
request's row by a device index) writes the same cache entries and returns the same logits as the
eager chunk, in any row and padded length, and touches no other row. On the GPU: after warm-up a
request's first chunk replays the graph, bit for bit the eager chunk."""
import types

import pytest
import torch
from torch import nn

import ember
from ember.engine import default_prefill_chunk, prefill_graphs
from ember.engine.scheduler import Request, Scheduler, chunk_sizes
from tests.models import tiny

GREEDY = ember.SamplingParams(temperature=0.0)


def _net(dense: int, expert_elems: int, experts: int, top_k: int, layers: int = 2):
    """A stand-in decoder: per layer ``dense`` always-read weights and an MoE of ``experts`` experts
    holding ``expert_elems`` weights in all, ``top_k`` of them read a token."""
    out = []
    for _ in range(layers):
        layer = nn.Module()
        layer.attn = nn.Linear(dense, 1, bias=False) if dense else nn.Module()
        mlp = nn.Module()
        mlp.w_gate_up = nn.Parameter(torch.zeros(experts, expert_elems // experts // 2), requires_grad=False)
        mlp.w_down = nn.Parameter(torch.zeros(experts, expert_elems // experts // 2), requires_grad=False)
        mlp.top_k = top_k
        layer.mlp = mlp
        out.append(layer)
    return types.SimpleNamespace(layers=out)


def test_default_prefill_chunk_is_the_weight_read_ridge():
    X = 8 * 1024
    # the rule: the smallest power of two >= 512 (<= 4096) past 190 x (all bytes / bytes a token reads)
    assert default_prefill_chunk(_net(0, X, experts=8, top_k=1)) == 2048       # ratio 8 -> 1,520
    assert default_prefill_chunk(_net(X // 8, X, experts=8, top_k=1)) == 1024  # ratio 4.5 -> 855
    assert default_prefill_chunk(_net(0, X, experts=64, top_k=1)) == 4096      # ratio 64: capped
    assert default_prefill_chunk(_net(X, X, experts=8, top_k=8)) == 512        # all read: ratio 1
    assert default_prefill_chunk(_net(0, X, experts=8, top_k=1), least=64, most=1024) == 1024


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return tiny.save(tiny.build(tiny.moe_config()), tmp_path_factory.mktemp("prefill_graphs_moe"))


def test_model_takes_the_derived_chunk_unless_given(moe_path):
    m = ember.load(moe_path, device="cpu", max_seq_len=64, max_batch_size=2)
    assert m.prefill_chunk == default_prefill_chunk(m.net)
    assert m.scheduler.prefill_chunk == m.prefill_chunk
    assert Scheduler(m).prefill_chunk == m.prefill_chunk  # what ember.serve.app builds
    assert Scheduler(m, prefill_chunk=8).prefill_chunk == 8
    given = ember.load(moe_path, device="cpu", max_seq_len=64, max_batch_size=2)
    given.prefill_chunk = 16
    assert given.scheduler.prefill_chunk == 16


def _poison(caches) -> list[tuple[torch.Tensor, ...]]:
    """Fill every cache with noise (an entry or state a prefill should write but does not shows) and
    return a copy to compare against or put back with ``_restore``."""
    for layer in caches:
        for t in layer:
            t.normal_()
    return _snapshot(caches)


def _snapshot(caches) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t.clone() for t in layer) for layer in caches]


def _restore(caches, saved) -> None:
    for layer, copies in zip(caches, saved):
        for t, s in zip(layer, copies):
            t.copy_(s)


@pytest.mark.parametrize("row,n,length", [(2, 11, 16), (0, 16, 16), (3, 1, 8)])
def test_staged_prefill_equals_the_eager_chunk(moe_path, row, n, length):
    m = ember.load(moe_path, device="cpu", max_seq_len=64, max_batch_size=4)
    before = _poison(m.caches)
    ids = torch.randint(0, m.net.vocab_size, (n,)).tolist()
    with torch.no_grad():
        want = m._prefill_chunk(row, ids, 0, length)
        eager = _snapshot(m.caches)
        _restore(m.caches, before)
        staging = m.net.allocate_caches(1, 32, m.dtype, m.device)  # longer than the chunk, as for shorter graphs
        padded = torch.tensor([ids + [0] * (length - n)])
        got = prefill_graphs.staged_prefill(m, staging, padded, torch.tensor([n - 1]), torch.tensor([row]), length)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for layer_e, layer_g, layer_b in zip(eager, m.caches, before):
        for e, g, b in zip(layer_e, layer_g, layer_b):
            torch.testing.assert_close(g[row, :, :length], e[row, :, :length], rtol=1e-6, atol=1e-6)
            assert torch.equal(g[row, :, length:], b[row, :, length:])  # past the chunk: untouched
            others = [r for r in range(g.shape[0]) if r != row]
            assert torch.equal(g[others], b[others])                    # other rows: untouched


def test_no_prefill_graphs_off_the_gpu(moe_path):
    m = ember.load(moe_path, device="cpu", max_seq_len=64, max_batch_size=2)
    assert not prefill_graphs.can_capture(m)
    assert prefill_graphs.capture(m, [8, 4]) == 0.0 and m._prefill_graphs == {}


@pytest.fixture(scope="module")
def hybrid_paths(tmp_path_factory):
    from tests.models import test_qwen3_5_moe as q35
    from tests.models.test_lfm2_moe import build_hf, lfm2_config
    paths = {}
    for family, hf in (("lfm2_moe", lambda: build_hf(lfm2_config())), ("qwen3_5_moe", lambda: q35.build_hf("text"))):
        paths[family] = tmp_path_factory.mktemp(f"prefill_graphs_{family}")
        hf().save_pretrained(paths[family])
    return paths


@pytest.mark.parametrize("family", ["lfm2_moe", "qwen3_5_moe"])
@pytest.mark.parametrize("row,n,length", [(1, 5, 16), (0, 8, 8), (2, 1, 4)])
def test_hybrid_staged_prefill_leaves_the_states_of_an_exact_length_prefill(hybrid_paths, family, row, n, length):
    """A padded first chunk (what a hybrid's prefill graph runs) leaves the conv / recurrent states and
    KV entries an unpadded prefill of the real tokens leaves, and the same logits; rows other than
    ``row`` keep theirs."""
    m = ember.load(hybrid_paths[family], dtype=torch.float32, max_seq_len=32, max_batch_size=3)
    assert m._recurrent_state
    before = _poison(m.caches)
    ids = torch.randint(1, m.net.vocab_size, (n,)).tolist()
    with torch.no_grad():
        want = m._prefill_chunk(row, ids, 0, n)  # exact length: no padding, no last_index
        exact = _snapshot(m.caches)
        _restore(m.caches, before)
        staging = m.net.allocate_caches(1, 16, m.dtype, m.device)
        _poison(staging)  # a previous prompt's states in the staging caches must not leak either
        padded = torch.tensor([ids + [7] * (length - n)])
        got = prefill_graphs.staged_prefill(m, staging, padded, torch.tensor([n - 1]), torch.tensor([row]), length)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    states = {t.data_ptr() for t in m._recurrent_state}
    others = [r for r in range(3) if r != row]
    for layer_e, layer_g, layer_b in zip(exact, m.caches, before):
        for e, g, b in zip(layer_e, layer_g, layer_b):
            # (close, not equal: the projections' matmuls round differently at another token count)
            got_row, want_row = (g[row], e[row]) if g.data_ptr() in states else (g[row, :, :n], e[row, :, :n])
            torch.testing.assert_close(got_row, want_row, rtol=1e-5, atol=1e-5)
            assert torch.equal(g[others], b[others])


@pytest.mark.parametrize("family", ["lfm2_moe", "qwen3_5_moe"])
def test_hybrid_padded_chunks_generate_what_transformers_generates(hybrid_paths, family):
    """Prompts whose last chunk is padded (every length 1..9 at chunk 4), through the scheduler, decode
    the tokens transformers' greedy generate gives."""
    import transformers
    from tests.models.test_lfm2_moe import hf_greedy
    m = ember.load(hybrid_paths[family], dtype=torch.float32, max_seq_len=32, max_batch_size=2)
    m.prefill_chunk = 4
    hf = transformers.AutoModelForCausalLM.from_pretrained(hybrid_paths[family], dtype=torch.float32).eval()
    for n in range(1, 10):
        prompt = torch.randint(1, m.net.vocab_size, (n,)).tolist()
        got = m.generate([prompt], max_new_tokens=4)[0]
        assert got == hf_greedy(hf, torch.tensor([prompt]), 4)[0].tolist(), n


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_graphed_first_chunk_equals_eager(moe_path, cuda):
    m = ember.load(moe_path, device=cuda, dtype=torch.bfloat16, max_seq_len=256, max_batch_size=4)
    sched = Scheduler(m, prefill_chunk=64)
    prompts = [torch.randint(0, m.net.vocab_size, (n,)).tolist() for n in (5, 64, 100)]
    eager = sched.submit_many([Request(p, 10, GREEDY, logprobs=1) for p in prompts])  # before warm-up: eager
    for h in eager:
        h.wait()
    sched.warmup()
    assert sorted(m._prefill_graphs) == sorted(n for n in chunk_sizes(64) if n <= m.max_seq_len)
    for row in (0, 3):
        for n in (5, 64):
            ids = torch.randint(0, m.net.vocab_size, (n,)).tolist()
            padded = min(s for s in chunk_sizes(64) if s >= n)
            got = m._prefill_chunk(row, ids, 0, padded).clone()
            k_graph = m.caches[-1][0][row, :, :n].clone()
            m._prefill_graphs, saved = {}, m._prefill_graphs
            want = m._prefill_chunk(row, ids, 0, padded)
            m._prefill_graphs = saved
            assert torch.equal(got, want)
            assert torch.equal(k_graph, m.caches[-1][0][row, :, :n])
    graphed = sched.submit_many([Request(p, 10, GREEDY, logprobs=1) for p in prompts])
    for a, b in zip(eager, graphed):
        b.wait()
        assert a.tokens == b.tokens
        assert [e.logprob for e in a] == [e.logprob for e in b]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["lfm2_moe", "qwen3_5_moe"])
def test_gpu_hybrid_graphed_first_chunk_equals_eager(hybrid_paths, family, cuda):
    """A hybrid's first chunk replays its graph after warm-up: the same logits and states as the eager
    padded chunk, bit for bit, and requests decode the same tokens as before warm-up."""
    m = ember.load(hybrid_paths[family], device=cuda, dtype=torch.bfloat16, max_seq_len=128, max_batch_size=2)
    sched = Scheduler(m, prefill_chunk=32)
    prompts = [torch.randint(1, m.net.vocab_size, (n,)).tolist() for n in (5, 32, 45)]
    eager = sched.submit_many([Request(p, 8, GREEDY, logprobs=1) for p in prompts])
    for h in eager:
        h.wait()
    sched.warmup()
    assert sorted(m._prefill_graphs) == sorted(chunk_sizes(32))
    for row in (0, 1):
        ids = torch.randint(1, m.net.vocab_size, (5,)).tolist()
        got = m._prefill_chunk(row, ids, 0, 8).clone()
        states = [t[row].clone() for t in m._recurrent_state]
        m._prefill_graphs, saved = {}, m._prefill_graphs
        want = m._prefill_chunk(row, ids, 0, 8)
        m._prefill_graphs = saved
        assert torch.equal(got, want)
        assert all(torch.equal(a, t[row]) for a, t in zip(states, m._recurrent_state))
    graphed = sched.submit_many([Request(p, 8, GREEDY, logprobs=1) for p in prompts])
    for a, b in zip(eager, graphed):
        b.wait()
        assert a.tokens == b.tokens
