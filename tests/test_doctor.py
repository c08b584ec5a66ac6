import importlib
import json

import torch

import ember
from ember import cli

doc = importlib.import_module("ember.doctor")  # the module; `ember.doctor` is the function


def _no_cuda():
    return {"built": True, "torch_cuda_version": "13.0", "available": False, "device_count": 0, "devices": [],
            "warning": None, "error": None}


def _cuda(cc=(9, 0), name="NVIDIA H200"):
    return {"built": True, "torch_cuda_version": "13.0", "available": True, "device_count": 1,
            "devices": [{"name": name, "capability": list(cc), "memory_GB": 143.8, "sms": 132}],
            "warning": None, "error": None}


def _triton_ok(cuda_available):
    return {"importable": True, "version": "3.6.0", "runs_kernel": True if cuda_available else None, "error": None}


def test_cpu_only_machine_report_is_real():
    report = ember.doctor()
    assert report["ok"] is True
    assert report["torch"] == torch.__version__
    if not torch.cuda.is_available():
        assert "no CUDA device: ops run on the reference path" in report["notes"]
        assert report["families"]["norm"]["path"] == "reference"
        assert "no CUDA device" in doc.render(report)


def test_h200_like_machine(monkeypatch):
    monkeypatch.setattr(doc, "probe_cuda", lambda: _cuda())
    monkeypatch.setattr(doc, "probe_triton", _triton_ok)
    r = doc.doctor()
    assert r["families"]["norm"] == {"path": "triton", "why": "CUDA device and a working Triton"}
    assert any("FP8 tensor-core kernels enabled" in n for n in r["notes"])


def test_rocm_gpu_takes_the_reference_path_and_says_why(monkeypatch):
    """A ROCm build's "cuda" device is an AMD GPU: no Triton kernels there (NVIDIA PTX inside), the
    reference path on the GPU, and doctor names the reason instead of sm_ notes."""
    from types import SimpleNamespace

    from ember import _dispatch
    cuda_tensor = SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert _dispatch.use_triton(cuda_tensor) == _dispatch.triton_available()
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    assert _dispatch.rocm() and not _dispatch.use_triton(cuda_tensor)
    monkeypatch.setattr(doc, "probe_cuda", lambda: _cuda((9, 4), "AMD Instinct MI300X"))
    monkeypatch.setattr(doc, "probe_triton", _triton_ok)
    r = doc.doctor()
    assert r["families"]["norm"] == {"path": "reference", "why": doc.ROCM_WHY}
    assert doc.ROCM_WHY in r["notes"] and "AMD GPU (ROCm build of torch)" in doc.ROCM_WHY
    assert not any("sm_94" in n or "tensor-core" in n for n in r["notes"])


def test_old_gpu_says_why_fp8_tensor_cores_are_off(monkeypatch):
    monkeypatch.setattr(doc, "probe_cuda", lambda: _cuda((8, 0), "NVIDIA A100"))
    monkeypatch.setattr(doc, "probe_triton", _triton_ok)
    r = doc.doctor()
    assert any("need compute capability >= 8.9" in n and "A100" in n for n in r["notes"])
    assert any("launch one after another" in n and ">= 9.0" in n for n in r["notes"])


def test_dependent_launch_note_follows_the_switch(monkeypatch):
    monkeypatch.setattr(doc, "probe_cuda", lambda: _cuda())
    monkeypatch.setattr(doc, "probe_triton", _triton_ok)
    monkeypatch.delenv("EMBER_PDL", raising=False)
    assert any("overlap their launches" in n for n in doc.doctor()["notes"])
    monkeypatch.setenv("EMBER_PDL", "0")
    assert any("EMBER_PDL=0" in n and "one after another" in n for n in doc.doctor()["notes"])


def test_driver_too_old_is_reported(monkeypatch):
    msg = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040). "
           "Please update your GPU driver")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)

    def fake_available():
        import warnings
        warnings.warn(msg, UserWarning)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", fake_available)
    r = doc.doctor()
    assert r["cuda"]["available"] is False
    assert any("driver is too old" in n and "11040" in n for n in r["notes"])
    assert r["ok"] is True


def test_torch_without_cuda_build(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    r = doc.doctor()
    assert "CPU-only build" in r["cuda"]["error"]
    assert "CPU-only build" in doc.render(r)


def test_triton_missing(monkeypatch):
    monkeypatch.setattr(doc, "probe_cuda", lambda: _cuda())
    monkeypatch.setattr(doc._dispatch, "triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    r = doc.doctor()
    assert r["triton"]["importable"] is False
    assert r["families"]["norm"]["path"] == "reference"
    assert "No module named 'triton'" in r["families"]["norm"]["why"]


def test_triton_compile_failure_reports_exact_error(monkeypatch):
    monkeypatch.setattr(doc, "probe_cuda", lambda: _cuda())
    import types, sys
    fake = types.ModuleType("ember.kernels.probe")

    def boom():
        raise RuntimeError("PTX .version 8.7 does not support .target sm_90a")

    fake.add_one_matches = boom
    monkeypatch.setitem(sys.modules, "ember.kernels.probe", fake)
    import ember.kernels
    monkeypatch.setattr(ember.kernels, "probe", fake, raising=False)
    r = doc.doctor()
    assert r["triton"]["runs_kernel"] is False
    assert "PTX .version 8.7" in r["triton"]["error"]
    assert r["families"]["norm"]["path"] == "reference"
    assert any("Triton problem" in n for n in r["notes"])


def test_mps_unreachable(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    r = doc.probe_mps()
    assert r["built"] and not r["available"] and "no Metal device" in r["error"]


def test_missing_family_is_unavailable(monkeypatch):
    monkeypatch.setitem(doc.FAMILIES, "imaginary", "ember.ops.does_not_exist")
    r = doc.doctor()
    assert r["families"]["imaginary"]["path"] == "unavailable"


def test_cli_doctor_json(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"python", "torch", "cuda", "triton", "mps", "families", "notes", "ok"}


def test_cli_doctor_text(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "op families:" in out and "ember can run here" in out
