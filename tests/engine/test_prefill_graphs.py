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


@pytest.mark.parametrize("row,n,length", [(2, 11, 16), (0, 16, 16), (3, 1, 8)])
def test_staged_prefill_equals_the_eager_chunk(moe_path, row, n, length):
    m = ember.load(moe_path, device="cpu", max_seq_len=64, max_batch_size=4)
    for layer in m.caches:  # poison: an entry the prefill should write but does not shows
        for t in layer:
            t.normal_()
    before = [tuple(t.clone() for t in layer) for layer in m.caches]
    ids = torch.randint(0, m.net.vocab_size, (n,)).tolist()
    with torch.no_grad():
        want = m._prefill_chunk(row, ids, 0, length)
        eager = [tuple(t.clone() for t in layer) for layer in m.caches]
        for layer, saved in zip(m.caches, before):
            for t, s in zip(layer, saved):
                t.copy_(s)
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


def test_no_prefill_graphs_off_the_gpu_or_with_recurrent_state(moe_path):
    m = ember.load(moe_path, device="cpu", max_seq_len=64, max_batch_size=2)
    assert not prefill_graphs.can_capture(m)
    assert prefill_graphs.capture(m, [8, 4]) == 0.0 and m._prefill_graphs == {}
    m.use_cuda_graph = True  # even where graphs run, a conv / recurrent state keeps prefill eager
    m._recurrent_state = [torch.zeros(1)]
    assert not prefill_graphs.can_capture(m)


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
