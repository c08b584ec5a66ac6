"""Per-device tile data: lookup order, the generic fallback, the cache `ember tune` writes, the tuner."""
import json
import subprocess
import sys

import pytest
import torch

from ember import _switches, tuning
from ember.tuning import tuner

H200 = tuning.DeviceInfo("NVIDIA H200", (9, 0))
OTHER = tuning.DeviceInfo("NVIDIA RTX 4090", (8, 9))


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A private data folder: an H200 folder and a generic folder with one family each."""
    root = tmp_path / "data"
    (root / "sm_90-nvidia-h200").mkdir(parents=True)
    (root / "generic").mkdir()
    (root / "sm_90-nvidia-h200" / "device.json").write_text(json.dumps({"name": "NVIDIA H200", "capability": [9, 0]}))
    (root / "sm_90-nvidia-h200" / "fam.json").write_text(json.dumps({"a": {"T": 1}, "b": {"T": 2}}))
    (root / "generic" / "fam.json").write_text(json.dumps({"a": {"T": 10}, "c": {"T": 30}}))
    monkeypatch.setattr(tuning, "DATA_DIR", root)
    monkeypatch.setenv("EMBER_TUNING_CACHE", str(tmp_path / "cache"))
    for f in (tuning._shipped_devices, tuning._family_file, tuning._memo.clear):
        getattr(f, "cache_clear", f)()
    yield root
    for f in (tuning._shipped_devices, tuning._family_file, tuning._memo.clear):
        getattr(f, "cache_clear", f)()


def test_measured_device_gets_its_entries_then_generic_then_the_rule(data):
    assert tuning.lookup_with_source("fam", "a", H200) == ({"T": 1}, "shipped:sm_90-nvidia-h200")
    assert tuning.lookup_with_source("fam", "c", H200) == ({"T": 30}, "generic")
    assert tuning.lookup_with_source("fam", "zzz", H200) == (None, "rule")
    assert tuning.lookup("nofamily", "a", H200) is None


def test_an_unmeasured_gpu_gets_the_generic_entries(data):
    assert tuning.lookup("fam", "a", OTHER) == {"T": 10}
    assert tuning.lookup("fam", "b", OTHER) is None  # H200-only entry: the rule elsewhere
    # same name, other capability (e.g. a MIG or a mislabelled board) is not the measured device
    assert tuning.lookup("fam", "b", tuning.DeviceInfo("NVIDIA H200", (9, 1))) is None


def test_generic_mode_skips_measured_and_cached_entries(data, monkeypatch):
    tuning.write_cache(H200, "fam", {"c": {"T": 99}})
    monkeypatch.setenv("EMBER_TUNING", "generic")
    assert tuning.lookup("fam", "a", H200) == {"T": 10}
    assert tuning.lookup("fam", "b", H200) is None
    assert tuning.lookup("fam", "c", H200) == {"T": 30}
    with _switches.override(EMBER_TUNING="auto"):
        assert tuning.lookup("fam", "c", H200) == {"T": 99}


def test_the_cache_comes_first_and_a_new_write_is_seen(data):
    path = tuning.write_cache(H200, "fam", {"a": {"T": 5}})
    assert path.parent.name == H200.slug == "sm_90-nvidia-h200"
    assert tuning.lookup_with_source("fam", "a", H200)[0] == {"T": 5}
    tuning.write_cache(H200, "fam", {"b": {"T": 6}})  # merged, not replaced
    assert json.loads(path.read_text()) == {"a": {"T": 5}, "b": {"T": 6}}
    assert tuning.lookup("fam", "b", H200) == {"T": 6}
    assert tuning.lookup("fam", "a", OTHER) == {"T": 10}  # another GPU's cache is its own


def test_override_beats_everything_and_is_scoped(data):
    with tuning.override("fam", {"a": {"T": 0}}):
        assert tuning.lookup_with_source("fam", "a", H200) == ({"T": 0}, "override")
        assert tuning.lookup("fam", "a", None) == {"T": 0}  # sweeps on the interpreter too
        assert tuning.lookup("fam", "b", H200) == {"T": 2}
    assert tuning.lookup("fam", "a", H200) == {"T": 1}


def test_cpu_tensors_use_the_kernel_rule(data):
    assert tuning.device_info(torch.device("cpu")) is None
    assert tuning.lookup("fam", "a", torch.device("cpu")) is None


def test_a_broken_data_file_is_named(data):
    (data / "generic" / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        tuning.lookup("bad", "a", OTHER)


def test_shipped_h200_data_parses_and_names_the_h200():
    tuning._shipped_devices.cache_clear()
    tuning._family_file.cache_clear()
    tuning._memo.clear()
    assert tuning.shipped_folder(H200) is not None
    for path in tuning.DATA_DIR.glob("*/*.json"):
        assert isinstance(json.loads(path.read_text()), dict), path


def test_tuner_picks_the_fastest_correct_tile_and_caches_it(data):
    timings = {1: 5.0, 2: 3.0, 3: 1.0, 5: 1.5}  # 3 is fastest but computes wrong values

    def candidates(key):
        return [{"T": 1}, {"T": 2}, {"T": 3}, {"T": 4}]

    def make_calls(key, device):
        def call():
            e = tuning.lookup("toy", key, H200)
            return e["T"] if e else 0

        def check():
            if call() == 3:
                raise ValueError("wrong output")
            if call() == 4:
                raise RuntimeError("does not compile")
        return [call], check

    def timer(calls):
        return timings.get(calls[0](), 4.0)

    tuner.register(tuner.Tunable("toy", "a toy family", ("k1",), candidates, make_calls))
    try:
        with pytest.raises(ValueError, match="CUDA GPU"):
            tuner.tune("toy", torch.device("cpu"), timer=timer)
        report = tuner.tune("toy", H200, timer=timer)
        assert report["k1"]["best"] == {"T": 2} and report["k1"]["failed"] == 2 and report["k1"]["current_us"] == 4.0
        assert tuning.lookup_with_source("toy", "k1", H200) == ({"T": 2}, f"cache:{tuning.cache_file(H200, 'toy')}")
        # what runs now is {"T": 2} at 3.0 us; a sweep whose best is slower writes nothing
        candidates = lambda key: [{"T": 1}]  # noqa: E731
        tuner.TUNABLES["toy"].candidates = candidates
        again = tuner.tune("toy", H200, timer=timer)
        assert again["k1"]["best_us"] == 5.0 and "_file" not in again
        assert tuning.lookup("toy", "k1", H200) == {"T": 2}
    finally:
        del tuner.TUNABLES["toy"]


def test_gemv_keys_are_validated():
    assert tuner.parse_gemv_key("fp8:2048x4096") == ("fp8", 2048, 4096)
    for bad in ("bf16:2048", "int8:4x4", "bf16:0x4", "2048x4096"):
        with pytest.raises(ValueError, match="gemv key"):
            tuner.parse_gemv_key(bad)
    with pytest.raises(ValueError, match="family: expected one of"):
        tuner.tune("nosuch", torch.device("cpu"))


def test_cli_tune_lists_families_and_refuses_without_a_gpu():
    run = lambda *a: subprocess.run([sys.executable, "-m", "ember", "tune", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    listed = run("--list")
    assert listed.returncode == 0 and "gemv:" in listed.stdout and "bf16:5120x2048" in listed.stdout
    if not torch.cuda.is_available():
        r = run("gemv")
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    r = run("nosuch")
    assert r.returncode == 2 and "unknown family 'nosuch'" in r.stderr


def test_cross_entropy_keys_candidates_and_tiles():
    """The fused loss's tiles are tuning data: the rule without an entry, an entry where one exists;
    the sweep's candidates fit shared memory and include the rule's tiles."""
    from ember.kernels import cross_entropy as ce
    assert tuner.parse_ce_key("grad:bf16") == ("grad", torch.bfloat16)
    for bad in ("lse", "dot:bf16", "mm:int8", "bf16:lse"):
        with pytest.raises(ValueError, match="cross_entropy key"):
            tuner.parse_ce_key(bad)
    rule = ce.gpu_tiles("lse", torch.bfloat16, H200)
    assert rule == dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
    cands = tuner._ce_candidates("lse:bf16")
    assert rule in cands and all((c["BM"] + c["BN"]) * c["BK"] * 2 * c["num_stages"] <= 200 << 10 for c in cands)
    tile = dict(BM=64, BN=256, BK=64, num_warps=8, num_stages=3)
    with tuning.override("cross_entropy", {"mm:bf16": tile}):
        assert ce.gpu_tiles("mm", torch.bfloat16, H200) == tile
        assert ce.gpu_tiles("lse", torch.bfloat16, H200) == rule
    with pytest.raises(ValueError, match="kernel: expected one of"):
        ce.tile_key("fwd", torch.bfloat16)


@pytest.mark.parametrize("key", ["lse:fp32", "grad:fp32", "mm:fp32"])
def test_cross_entropy_sweep_checks_catch_a_wrong_kernel(key, interpreter, monkeypatch):
    """Each kernel's sweep check passes for the kernel as it is (small shape, through the interpreter)
    and refuses an output the tile got wrong."""
    monkeypatch.setattr(tuner, "CE_SHAPE", (48, 32, 1300))
    monkeypatch.setattr(tuner, "CE_CHECK_ROWS", 16)
    calls, check = tuner._ce_calls(key, torch.device("cpu"))
    check()
    assert len(calls) == 1
    from ember.kernels import cross_entropy as ce
    kernel = {"lse": "lse_partials", "grad": "grad_logits", "mm": "mm_accumulate"}[key.split(":")[0]]
    real = getattr(ce, kernel)

    def wrong(*a):
        out = real(*a)
        if out is not None:                        # lse: (max, sum, ...) partials
            out[1].mul_(1.01)
        else:                                      # grad / mm write into their last argument
            a[-1][0, 0] += 0.5
        return out
    monkeypatch.setattr(ce, kernel, wrong)
    with pytest.raises(ValueError, match="under this tile"):
        check()
