import json
import statistics

import pytest
import torch

from ember import bench, cli
from ember.bench import Row


def test_row_speedup_direction():
    assert Row("t", "us", 10.0, 20.0, "b").speedup == pytest.approx(2.0)
    assert Row("r", "GB/s", 300.0, 100.0, "b").speedup == pytest.approx(3.0)
    assert Row("r", "tok/s", 50.0, 100.0, "b").speedup == pytest.approx(0.5)
    assert Row("n", "us", 1.0, None, "none").speedup is None


def test_norm_suite_quick_runs_on_cpu():
    rows = bench.run_suite("norm", quick=True)
    assert [r.name for r in rows] == ["add_rmsnorm_1x256_bf16", "add_rmsnorm_64x512_bf16"]
    assert all(r.ember > 0 and r.baseline > 0 for r in rows)


def test_unknown_suite_is_named():
    with pytest.raises(ValueError, match="suite: expected one of"):
        bench.run_suite("nope", quick=True)


def test_cli_quick_json_and_plot(tmp_path, capsys):
    out = tmp_path / "norm.json"
    png = tmp_path / "norm.png"
    assert cli.main(["bench", "norm", "--quick", "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    assert data["suite"] == "norm" and set(data["versions"]) == {"torch", "triton", "transformers", "diffusers"}
    for row in data["rows"]:
        assert set(row) >= {"name", "unit", "ember", "baseline", "baseline_name", "speedup", "target", "meets"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_needs_a_suite(capsys):
    assert cli.main(["bench"]) == 2
    assert "name a suite" in capsys.readouterr().err


def test_cli_bench_unknown_suite(capsys):
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


def test_cli_names_a_missing_baseline_package(monkeypatch, capsys):
    import ember.bench as b

    def missing(*a, **k):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(b, "run_suite", missing)
    assert cli.main(["bench", "norm", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "'transformers'" in err and "ember[bench]" in err


def test_variant_applies_switches_and_tiles_inside_the_block_only():
    from ember import _switches, tuning
    from ember.bench import variant
    spec = {"switches": {"EMBER_TUNING": "generic"}, "tuning": {"fam": {"k": {"T": 1}}}}
    with variant(spec):
        assert _switches.get("EMBER_TUNING") == "generic"
        assert tuning.lookup("fam", "k", None) == {"T": 1}
    assert _switches.get("EMBER_TUNING") == "auto" and tuning.lookup("fam", "k", None) is None
    with pytest.raises(ValueError, match="unknown part"):
        with variant({"env": {}}):
            pass


def test_moe_hybrid_floor_counts_the_folded_shared_expert(monkeypatch):
    """Qwen3.5 with its shared expert folded into the experts (the bf16 default) reads the same weight
    bytes per token as the unfolded block: the floor must not change with the layout."""
    from ember.bench import moe_hybrid
    from ember.models import qwen3_5_moe
    hf, cfg = moe_hybrid.make_hf("qwen3_5_moe_35b_a3b", True, torch.device("cpu"))
    hf = hf.to(torch.bfloat16)
    nets = {"1": moe_hybrid.ember_net(hf, cfg, fp8=False, max_seq_len=64)}
    monkeypatch.setattr(qwen3_5_moe, "fold_shared_expert", lambda moe: None)  # the unfolded block
    nets["0"] = moe_hybrid.ember_net(hf, cfg, fp8=False, max_seq_len=64)
    assert any(isinstance(m, qwen3_5_moe.FoldedSharedMoe) for m in nets["1"].modules())
    assert not any(isinstance(m, qwen3_5_moe.FoldedSharedMoe) for m in nets["0"].modules())
    folded, unfolded = (moe_hybrid.decode_bytes(nets[f]) for f in ("1", "0"))
    assert folded == pytest.approx(unfolded, rel=1e-6)


def test_moe_suite_quick_rows_record_the_user_rate_and_judge_nothing_on_cpu():
    """The floors are H200 figures: a CPU run records every row's figures and judges none. The b1
    rows carry the user's rate (model.generate by wall clock) and the fraction of the bandwidth
    limit; the batch row's baseline is the uniform-routing bound, above batch 1's limit; the
    experts-backend row times HF's default and the ember backend alternately and takes each side's
    median."""
    rows = {r.name: r for r in bench.run_suite("moe", quick=True)}
    b1, b2, fp8 = (rows[f"qwen3_moe_30b_a3b_{n}"] for n in ("bf16_b1", "bf16_b2", "fp8_b1"))
    for r in (b1, b2, fp8):
        assert r.meets is None and r.ember > 0 and r.extra["e2e_tok_s"] > 0, r
    for r in (b1, fp8):
        assert r.extra["fraction_of_roofline"] == pytest.approx(r.ember / r.extra["roofline_tok_s"])
        assert r.extra["e2e_vs_engine"] == pytest.approx(r.extra["e2e_tok_s"] / r.ember)
    # two tokens a step read less than twice one token's bytes: the bound per token is higher
    assert b1.extra["roofline_tok_s"] < b2.baseline < 2 * b1.extra["roofline_tok_s"]
    assert b2.extra["fraction_of_bound"] == pytest.approx(b2.ember / b2.baseline)
    assert "90 %" in b2.target and "80 %" in b1.target and "900" in fp8.target
    assert b1.extra["hf_static_compiled_tok_s"] is None and b1.baseline == b1.extra["hf_default_tok_s"]
    backend = rows["hf_experts_backend_ember"]
    default, ember_backend = backend.extra["hf_default_tok_s_each"], backend.extra["hf_ember_backend_tok_s_each"]
    assert len(default) == len(ember_backend) == 2 and min(default + ember_backend) > 0
    assert backend.baseline == pytest.approx(statistics.median(default))
    assert backend.ember == pytest.approx(statistics.median(ember_backend))


class _ScriptedGenerate:
    """A stand-in for an HF model whose generate sleeps a scripted time per call (in call order)."""

    def __init__(self, seconds):
        self.seconds = list(seconds)

    def generate(self, ids, max_new_tokens, **kw):
        import time
        time.sleep(self.seconds.pop(0))


def test_hf_decode_rate_measures_again_after_an_impossible_pair():
    from ember.bench import moe as moe_bench
    ids = torch.zeros(1, 4, dtype=torch.long)
    # warm-up, then three 1-token calls and an 8+1-token call faster than them (a busy host), then a sane pair
    model = _ScriptedGenerate([0.0, 0.05, 0.05, 0.05, 0.01, 0.02, 0.02, 0.02, 0.1])
    rate = moe_bench.hf_decode_tok_s(model, ids, 8)
    # the second pair's 8 tokens over ~(0.1 - 0.02) s; the bound below only allows for a busy host's
    # late wake-ups (the first pair would have raised or given a negative rate)
    assert 8 / 0.5 < rate < 8 / 0.06
    assert model.seconds == []
    bad = _ScriptedGenerate([0.0] + [0.03, 0.03, 0.03, 0.0] * 3)
    with pytest.raises(RuntimeError, match="three times"):
        moe_bench.hf_decode_tok_s(bad, ids, 8)


def test_moe_hybrid_quick_rows_time_the_engine_and_judge_nothing_on_cpu():
    """Each family's rows come from the engine's Model (model.generate's wall-clock rate beside the
    decode rate) and judge nothing on CPU; the fp8 row is compared with its bf16 row."""
    rows = {r.name: r for r in bench.run_suite("moe_hybrid", quick=True)}
    for kind in ("lfm2_moe_8b_a1b", "qwen3_5_moe_35b_a3b"):
        bf16, fp8 = rows[f"{kind}_bf16_b1"], rows[f"{kind}_fp8_b1"]
        for r in (bf16, fp8):
            assert "error" not in r.extra and r.meets is None and r.ember > 0 and r.extra["e2e_tok_s"] > 0, r
            assert r.extra["fraction_of_roofline"] == pytest.approx(r.ember / r.extra["roofline_tok_s"])
        assert "80 %" in bf16.target
        assert fp8.extra["vs_bf16"] == pytest.approx(fp8.ember / bf16.ember)


def test_moe_hybrid_a_family_that_fails_to_build_leaves_the_other_familys_rows(monkeypatch):
    """A family whose HF model cannot be built (out of memory on an 80 GB card) gets error rows naming
    the cause, and the suite still returns the other family's measured rows."""
    from ember.bench import moe_hybrid
    real = moe_hybrid.make_hf

    def make_hf(kind, quick, device):
        if kind == "qwen3_5_moe_35b_a3b":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
        return real(kind, quick, device)
    monkeypatch.setattr(moe_hybrid, "make_hf", make_hf)
    rows = {r.name: r for r in bench.run_suite("moe_hybrid", quick=True)}
    assert rows["lfm2_moe_8b_a1b_bf16_b1"].ember > 0 and "error" not in rows["lfm2_moe_8b_a1b_bf16_b1"].extra
    for p in ("bf16", "fp8"):
        r = rows[f"qwen3_5_moe_35b_a3b_{p}_b1"]
        assert r.ember == 0 and r.meets is False and "out of memory" in r.extra["error"]


def test_moe_hybrid_step_bytes_grow_with_the_attention_layers_cache_only():
    """Only attention layers' caches grow with the context; the conv / recurrent states are read and
    written once a step whatever the context."""
    from ember.bench import moe_hybrid
    hf, cfg = moe_hybrid.make_hf("lfm2_moe_8b_a1b", True, torch.device("cpu"))
    S = 48
    model = moe_hybrid.engine_model(moe_hybrid.ember_net(hf, cfg, fp8=False, max_seq_len=S), cfg, S)
    attention = [c for layer, c in zip(model.net.layers, model.caches) if not hasattr(layer.attn, "cache_spec")]
    recurrent = [c for layer, c in zip(model.net.layers, model.caches) if hasattr(layer.attn, "cache_spec")]
    assert attention and recurrent
    kv_token = sum(t.numel() * t.element_size() for c in attention for t in c) / S
    assert moe_hybrid.step_bytes(model, 10) - moe_hybrid.step_bytes(model, 0) == pytest.approx(10 * kv_token)
    states = sum(t.numel() * t.element_size() for c in recurrent for t in c)
    assert moe_hybrid.step_bytes(model, 0) == pytest.approx(moe_hybrid.decode_bytes(model.net) + 2 * states)


def test_compile_timer_keeps_two_threads_compiling_variants_of_one_kernel():
    """Warm-up compiles from threads; two variants of one kernel that differ only in constexprs share
    Triton's hook ``repr``. Both compiles are timed, each from its own start."""
    import threading
    from triton import knobs
    from ember.bench import _timing
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    compiles, remove = _timing.triton_compile_timer()
    pre, post = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    repr_ = "gemv_kernel[num_warps=4](x_ptr: *bf16)"
    first_started, second_done = threading.Event(), threading.Event()

    def first():
        assert pre(repr=repr_) is False  # never skips the compile
        first_started.set()
        second_done.wait(5)  # the other thread starts and ends its compile meanwhile
        post(repr=repr_)

    def second():
        first_started.wait(5)
        pre(repr=repr_)
        post(repr=repr_)
        second_done.set()
    try:
        threads = [threading.Thread(target=f) for f in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    finally:
        remove()
    assert [name for name, _ in compiles] == ["gemv_kernel", "gemv_kernel"]
    assert compiles[1][1] >= compiles[0][1] >= 0  # the first spans the second
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before


def test_cache_log_records_hits_and_misses_and_puts_the_listener_back():
    """The listener sees each variant Triton builds, loaded from its cache or compiled (called here as
    Triton's compile calls it); removing it restores the listener that was there."""
    from types import SimpleNamespace

    from triton import knobs
    from ember.bench import _timing
    seen = []
    knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    try:
        log, remove = _timing.triton_cache_log()
        src = SimpleNamespace(name="gemv_kernel", fn=SimpleNamespace(cache_key="k1"), signature={"x": "*bf16"},
                              constants={(3,): 8}, attrs={(0,): [["tt.divisibility", 16]]})
        for hit in (True, False):
            knobs.compilation.listener(src=src, metadata={"hash": "h"}, metadata_group={}, times=None, cache_hit=hit)
        remove()
        assert [(e["kernel"], e["hit"], e["hash"], e["fn_key"]) for e in log] == [
            ("gemv_kernel", True, "h", "k1"), ("gemv_kernel", False, "h", "k1")]
        assert "*bf16" in log[0]["spec"] and "divisibility" in log[0]["spec"]
        assert seen == [True, False]  # the listener before it still heard both
    finally:
        knobs.compilation.listener = None


def test_cache_misses_explained_tells_new_variants_from_unstable_keys():
    from ember.bench import _timing
    cold = [{"kernel": "a", "hit": False, "hash": "1", "fn_key": "fa", "spec": "s1"},
            {"kernel": "b", "hit": False, "hash": "2", "fn_key": "fb", "spec": "s2"}]
    warm = [{"kernel": "a", "hit": True, "hash": "1", "fn_key": "fa", "spec": "s1"},   # loaded
            {"kernel": "b", "hit": False, "hash": "9", "fn_key": "fb*", "spec": "s2"},  # same spec, other key
            {"kernel": "c", "hit": False, "hash": "3", "fn_key": "fc", "spec": "s3"}]   # never built cold
    r = _timing.cache_misses_explained(cold, warm)
    assert r["misses"] == 2 and r["new_variants"] == ["c"]
    assert r["same_spec_other_key"] == [{"kernel": "b", "source_key_differs": True, "spec": "s2"}]
