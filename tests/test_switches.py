"""The switch registry: the only environment reader in ember/, typed, validated, listed by doctor."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ember import _switches
from ember.doctor import doctor as run_doctor, render

EMBER = Path(__file__).parents[1] / "ember"


def test_at_most_twelve_switches_each_documented_and_categorised():
    assert 1 <= len(_switches.REGISTRY) <= 12
    for s in _switches.REGISTRY.values():
        assert s.name.startswith("EMBER_") and s.doc and s.category in _switches.CATEGORIES
        assert s.parse(str(int(s.default)) if s.kind is bool else str(s.default) or "x") is not None


def test_registry_is_the_only_environment_reader():
    offenders = []
    for path in EMBER.rglob("*.py"):
        if path.name == "_switches.py":
            continue
        text = path.read_text()
        if re.search(r"os\.environ|os\.getenv|os\.putenv", text):
            offenders.append(str(path.relative_to(EMBER)))
    assert offenders == []


def test_every_ember_variable_named_in_the_package_is_declared():
    named = set()
    for path in EMBER.rglob("*.py"):
        named |= set(re.findall(r"\bEMBER_[A-Z0-9_]+\b", path.read_text()))
    assert named - set(_switches.REGISTRY) == set()


def test_defaults_when_unset(monkeypatch):
    for name in _switches.REGISTRY:
        monkeypatch.delenv(name, raising=False)
    assert _switches.get("EMBER_PDL") is True
    assert _switches.get("EMBER_FORCE_TRITON") is False
    assert _switches.get("EMBER_TUNING") == "auto"
    assert _switches.get("EMBER_VAE_FRAME_CHUNK") == 0


@pytest.mark.parametrize("raw, want", [("0", False), ("1", True), ("false", False), ("TRUE", True), (" on ", True)])
def test_bool_spellings(monkeypatch, raw, want):
    monkeypatch.setenv("EMBER_PDL", raw)
    assert _switches.get("EMBER_PDL") is want


def test_a_changed_environment_is_seen_without_a_restart(monkeypatch):
    monkeypatch.setenv("EMBER_VAE_FRAME_CHUNK", "2")
    assert _switches.get("EMBER_VAE_FRAME_CHUNK") == 2
    monkeypatch.setenv("EMBER_VAE_FRAME_CHUNK", "1")
    assert _switches.get("EMBER_VAE_FRAME_CHUNK") == 1
    monkeypatch.setenv("EMBER_VAE_FRAME_CHUNK", "")  # empty is unset
    assert _switches.get("EMBER_VAE_FRAME_CHUNK") == 0


@pytest.mark.parametrize("name, raw, allowed", [
    ("EMBER_PDL", "maybe", "0 or 1"),
    ("EMBER_VAE_FRAME_CHUNK", "-1", "an integer >= 0"),
    ("EMBER_VAE_FRAME_CHUNK", "two", "an integer >= 0"),
    ("EMBER_TUNING", "fastest", "auto | generic"),
])
def test_bad_values_name_the_variable_the_allowed_values_and_what_came(monkeypatch, name, raw, allowed):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError) as e:
        _switches.get(name)
    msg = str(e.value)
    assert name in msg and repr(raw) in msg and allowed in msg


def test_unknown_switch_is_a_key_error_listing_the_known_ones():
    with pytest.raises(KeyError, match="EMBER_PDL"):
        _switches.get("EMBER_NOPE")


def test_override_is_scoped_typed_and_beats_the_environment(monkeypatch):
    monkeypatch.setenv("EMBER_TUNING", "auto")
    with _switches.override(EMBER_TUNING="generic", EMBER_PDL=False):
        assert _switches.get("EMBER_TUNING") == "generic" and _switches.get("EMBER_PDL") is False
        with _switches.override(EMBER_PDL=True):
            assert _switches.get("EMBER_PDL") is True
        assert _switches.get("EMBER_PDL") is False
    assert _switches.get("EMBER_TUNING") == "auto" and _switches.get("EMBER_PDL") is True
    with pytest.raises(TypeError, match="EMBER_PDL"):
        with _switches.override(EMBER_PDL="0"):
            pass
    with pytest.raises(ValueError, match="EMBER_TUNING"):
        with _switches.override(EMBER_TUNING="fastest"):
            pass


def test_doctor_lists_every_switch_with_its_value(monkeypatch):
    monkeypatch.setenv("EMBER_VAE_FRAME_CHUNK", "2")
    monkeypatch.setenv("EMBER_TUNING", "bogus")
    report = run_doctor()
    rows = {r["name"]: r for r in report["switches"]}
    assert set(rows) == set(_switches.REGISTRY)
    assert rows["EMBER_VAE_FRAME_CHUNK"]["value"] == 2 and rows["EMBER_VAE_FRAME_CHUNK"]["set"]
    assert "EMBER_TUNING='bogus'" in rows["EMBER_TUNING"]["error"]  # shown, not raised
    text = render(report)
    for name in _switches.REGISTRY:
        assert name in text


def test_cli_doctor_prints_the_switches():
    out = subprocess.run([sys.executable, "-m", "ember", "doctor"], capture_output=True, text=True, timeout=120)
    assert "switches (environment):" in out.stdout and "EMBER_PDL" in out.stdout
