"""The maintained tools in bench/: each runs on CPU in its --help / --list / offline form."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_holds_only_the_maintained_tools():
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["plot_results.py", "step_timeline.py", "step_variants.py"]


@pytest.mark.parametrize("tool", ["step_variants", "step_timeline", "plot_results"])
def test_help(tool):
    r = subprocess.run([sys.executable, str(BENCH / f"{tool}.py"), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout


def test_step_variants_reads_variant_files_and_refuses_bad_ones(tmp_path):
    sv = _load("step_variants")
    good = tmp_path / "v.json"
    good.write_text(json.dumps({"qkv": {"tuning": {"gemv": {"bf16:5120x2048": {"BLOCK_N": 8}}}}}))
    variants = sv.load_variants(str(good))
    assert {"default", "generic_tiles", "pdl_off", "qkv"} <= set(variants)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"x": {"EMBER_FUSED_QKV": "1"}}))
    with pytest.raises(ValueError, match="variant 'x'"):
        sv.load_variants(str(bad))
    a = sv.parse_args(["out.json", "--names", "default,pdl_off", "--sizes", "400"])
    assert a.names == ["default", "pdl_off"] and a.sizes == (400,)


def test_built_in_step_variants_apply():
    """Every built-in decode-step variant is a valid ``bench.variant`` (switch names and types)."""
    from ember import _switches
    from ember.bench import moe as moe_bench, variant
    for name, spec in moe_bench.STEP_VARIANTS.items():
        with variant(spec):
            for sw, value in spec.get("switches", {}).items():
                assert _switches.get(sw) == value, name


def test_step_timeline_sums_increments_by_kernel():
    st = _load("step_timeline")
    kernels = [{"name": "a", "start": 0.0, "dur_us": 2.0, "incr_us": 2.0},
               {"name": "b", "start": 1.0, "dur_us": 3.0, "incr_us": 2.0},
               {"name": "a", "start": 4.0, "dur_us": 1.0, "incr_us": 1.0}]
    s = st.summarise(kernels, fp8=False)
    assert s["step_us_sum_of_increments"] == 5.0 and s["kernels"] == 3 and s["step_span_us"] == 5.0
    assert s["by_name"]["a"] == {"calls": 2, "mean_dur_us": 1.5, "mean_incr_us": 1.5, "share": 0.6}
    assert s["floors_us"]["lm_head"] > s["floors_us"]["router"] > 0


def test_plot_results_charts_suite_files_only(tmp_path):
    res = tmp_path / "res"
    res.mkdir()
    row = {"name": "r1", "unit": "us", "ember": 1.0, "baseline": 2.0, "baseline_name": "b", "speedup": 2.0}
    (res / "norm.json").write_text(json.dumps({"suite": "norm", "rows": [row]}))
    (res / "sweep.json").write_text(json.dumps({"table": []}))
    out = tmp_path / "s.png"
    r = subprocess.run([sys.executable, str(BENCH / "plot_results.py"), "--results", str(res), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "1 rows" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_h200_lists_its_groups():
    assert subprocess.run(["bash", "-n", str(BENCH / "run_h200.sh")]).returncode == 0
    r = subprocess.run(["bash", str(BENCH / "run_h200.sh"), "--list"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "tests:" in r.stdout and "moe" in r.stdout


def test_first_token_runs_cold_then_warm_in_fresh_processes():
    """The b1 row's warm-up figures come from two fresh processes sharing one new Triton cache; on CPU
    (reference path: nothing to compile or capture) the plumbing still returns each run's figures."""
    import torch

    from ember.bench import _first_token
    r = _first_token.cold_and_warm(True, torch.device("cpu"), prompt_len=8, max_seq_len=32, timeout=300)
    assert set(r) == {"cold", "warm"}, r
    for run in r.values():
        assert run["first_token_s"] > 0 and run["tokens"] == 1
        assert run["compiles"] == 0 and run["capture_s"] == 0.0 and run["warmup_s"] == 0.0
        assert run["cache_hits"] == run["cache_misses"] == 0 and "cache_log" not in run
        assert isinstance(run["warnings"], list)
    assert r["warm"]["recompiled"] == {"misses": 0, "new_variants": [], "same_spec_other_key": []}
