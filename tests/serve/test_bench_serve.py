"""``ember bench serve``: the bound's byte count against the engine suite's batch-1 count, and the
quick rows on CPU."""
import pytest

from ember import bench


@pytest.fixture(scope="module")
def model():
    from ember.bench.moe import ember_from_hf, make_hf
    import torch
    hf, cfg = make_hf(True, torch.device("cpu"))
    return ember_from_hf(hf, cfg, max_seq_len=64, max_batch_size=4)


def test_step_bytes_uniform_routing(model):
    from ember.bench.moe import decode_bytes, step_bytes
    # one token reads exactly top_k experts a layer: the moe suite's batch-1 count
    assert step_bytes(model, 1, 0) == pytest.approx(decode_bytes(model.net), rel=1e-12)
    kv = sum(t.numel() * t.element_size() for layer in model.caches for t in layer) / (4 * 64)
    assert step_bytes(model, 1, 10) - step_bytes(model, 1, 0) == pytest.approx(10 * kv)
    # many tokens: every expert once, never more
    m = model.net.layers[0].mlp
    all_experts = sum((l.mlp.w_gate_up.numel() + l.mlp.w_down.numel()) * l.mlp.w_gate_up.element_size()
                      for l in model.net.layers)
    top = decode_bytes(model.net) - m.top_k * all_experts / m.w_gate_up.shape[0]
    assert step_bytes(model, 10 ** 4, 0) == pytest.approx(top + all_experts, rel=1e-9)


@pytest.mark.slow
def test_quick_rows_on_cpu():
    rows = {r.name: r for r in bench.run_suite("serve", quick=True)}
    assert set(rows) == {"serve_c1", "serve_c2", "serve_c4", "serve_interference"}
    for r in rows.values():
        assert r.ember > 0 and r.extra["ttft_p50_ms"] > 0 and r.extra["tpot_p99_ms"] >= r.extra["tpot_p50_ms"]
    assert rows["serve_c4"].extra["requests"] == 12
