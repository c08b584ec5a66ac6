"""`ember` itself: --version, help text on every flag, bench's suite list, doctor's explanations."""
import argparse
import importlib
import subprocess
import sys

import ember
from ember import bench
from ember.cli import build_parser

doc = importlib.import_module("ember.doctor")


def ember_cli(*args):
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True, timeout=120)


def test_version():
    r = ember_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ember {ember.__version__}"


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def test_every_flag_of_every_verb_has_help():
    parser = build_parser()
    verbs = _subparsers(parser)
    assert {"generate", "chat", "doctor", "bench"} <= set(verbs)
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in [("ember", parser), *verbs.items()] for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
               and (not a.help or a.help == argparse.SUPPRESS)]
    assert not missing, f"flags without help text: {missing}"
    assert all(verbs[v].description for v in ("generate", "chat", "bench"))


def test_bench_help_lists_the_suites():
    r = ember_cli("bench", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    suites = bench.suites()
    assert suites and all(s in text for s in suites)


def _cuda():
    return {"built": True, "torch_cuda_version": "13.0", "available": True, "device_count": 1,
            "devices": [{"name": "NVIDIA L40S", "capability": [8, 9], "memory_GB": 48.0, "sms": 142}],
            "warning": None, "error": None}


def test_doctor_explains_a_cuda_gpu_without_triton(monkeypatch):
    monkeypatch.setattr(doc, "probe_cuda", _cuda)
    monkeypatch.setattr(doc, "probe_triton", lambda available: {
        "importable": False, "version": None, "runs_kernel": None, "error": "ModuleNotFoundError: No module named 'triton'"})
    # (no real GPU to read tuning data for)
    monkeypatch.setattr(doc.tuning, "summary", lambda device: {"device": "sm_89-nvidia-l40s", "mode": "measured",
                                                               "shipped": None, "cache": "-", "cached_families": []})
    report = doc.doctor()
    assert report["families"]["norm"]["path"] == "reference"
    why = report["families"]["norm"]["why"]
    assert "Triton is not installed" in why and "pip install triton" in why and "No module named 'triton'" in why
    assert any("reference" in n and "pip install triton" in n for n in report["notes"])
    assert "pip install triton" in doc.render(report)


def test_doctor_names_a_missing_text_package(monkeypatch):
    monkeypatch.setattr(doc, "probe_packages", lambda: {"tokenizers": None, "jinja2": "3.1.6",
                                                        "huggingface_hub": "1.0.0"})
    report = doc.doctor()
    notes = [n for n in report["notes"] if "tokenizers" in n]
    assert len(notes) == 1 and "pip install tokenizers" in notes[0] and "tokenizer.json" in notes[0]
    assert "tokenizers MISSING" in doc.render(report)


def test_doctor_reports_the_installed_text_packages():
    found = doc.probe_packages()
    assert set(found) == {"tokenizers", "jinja2", "huggingface_hub"}
    assert all(found.values())  # core dependencies: present wherever ember is installed


def test_missing_checkpoint_is_one_line():
    r = ember_cli("chat", "--model", "/nonexistent/dir", "--device", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "/nonexistent/dir" in r.stderr
