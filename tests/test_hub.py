"""Hub repo ids: `ember.load("org/name")` and `ember quantize org/name OUT` through a Hugging Face cache
laid out as huggingface_hub writes one (models--org--name/{blobs,refs,snapshots}), offline."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ember
from ember.hub import CheckpointNotFound, resolve_checkpoint
from tests.models import tiny

COMMIT_A, COMMIT_B = "a" * 39 + "1", "b" * 39 + "2"


def cache_repo(hub_cache: Path, repo_id: str, checkpoint: Path, commit: str, refs=("main",)) -> Path:
    """Put ``checkpoint``'s files in the cache as snapshot ``commit``: content-addressed blobs (sha256
    for LFS files, the git object id for the rest), relative symlinks from the snapshot, refs/<name>."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(checkpoint.iterdir()):
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else \
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    a = tiny.save(tiny.build(tiny.dense_config(), seed=0), root / "a", tokenizer=True)
    b = tiny.save(tiny.build(tiny.dense_config(), seed=1), root / "b")
    home = root / "hf"
    cache_repo(home / "hub", "org/tiny", a, COMMIT_A)
    cache_repo(home / "hub", "org/tiny", b, COMMIT_B, refs=("v2",))
    return home, a, b


@pytest.fixture
def offline(models, monkeypatch):
    """HF_HOME=<the test cache>, HF_HUB_OFFLINE=1 for this process (huggingface_hub reads both at import)."""
    from huggingface_hub import constants
    home = models[0]
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def _ids():
    return torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))


def test_load_repo_id_from_the_offline_cache(models, offline):
    _, a, b = models
    em = ember.load("org/tiny", max_seq_len=16)
    assert torch.equal(em(_ids()), ember.load(a, max_seq_len=16)(_ids()))
    assert em.tokenizer is not None and em.name == "org/tiny"
    for rev in ("v2", COMMIT_B):  # a tag and a commit: the other snapshot
        got = ember.load("org/tiny", revision=rev, max_seq_len=16)(_ids())
        assert torch.equal(got, ember.load(b, max_seq_len=16)(_ids()))


def test_missing_repo_offline_says_what_and_how(offline):
    with pytest.raises(CheckpointNotFound) as e:
        resolve_checkpoint("org/absent", revision="dev")
    msg = str(e.value)
    assert "\n" not in msg
    for words in ("org/absent", "revision dev", str(offline / "hub"), "HF_HUB_OFFLINE=1",
                  "huggingface-cli download org/absent"):
        assert words in msg, (words, msg)
    with pytest.raises(CheckpointNotFound, match="org/tiny.*revision nope"):
        resolve_checkpoint("org/tiny", revision="nope")


def test_local_directory_wins_over_a_repo_id(models, offline, tmp_path, monkeypatch):
    _, _, b = models
    monkeypatch.chdir(tmp_path)
    local = Path("org", "tiny")
    local.mkdir(parents=True)
    for f in b.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    assert resolve_checkpoint("org/tiny") == local
    with pytest.raises(ValueError, match="revision: applies to Hugging Face repo ids"):
        resolve_checkpoint("org/tiny", revision="v2")


@pytest.mark.parametrize("name", ["no/such/dir", "./org/x", "-org/x", "org--a/x", "bad name/x", "plain"])
def test_neither_directory_nor_repo_id(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFound, match="not a directory and not a Hugging Face repo id"):
        ember.load(name)


def _env(home, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(home), **kw}


def test_quantize_cli_from_a_repo_id_offline(models, tmp_path):
    home, a, _ = models
    blobs = {p.name: p.read_bytes() for p in (home / "hub" / "models--org--tiny" / "blobs").iterdir()}
    r = subprocess.run([sys.executable, "-m", "ember", "quantize", "org/tiny", str(tmp_path / "out"), "--fp8",
                        "--device", "cpu"], capture_output=True, text=True, env=_env(home, HF_HUB_OFFLINE="1"),
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert {p.name: p.read_bytes() for p in (home / "hub" / "models--org--tiny" / "blobs").iterdir()} == blobs
    assert not any(p.is_symlink() for p in (tmp_path / "out").iterdir())  # real files, not links into the cache
    em = ember.load(tmp_path / "out", max_seq_len=16)
    assert em.fp8 and em.tokenizer is not None


def test_quantize_cli_unreachable_hub_names_repo_cache_and_fix(models, tmp_path):
    home = models[0]
    # a closed loopback port: the Hub cannot be reached, at once, on any machine
    r = subprocess.run([sys.executable, "-m", "ember", "quantize", "org/absent", str(tmp_path / "out"), "--fp8",
                        "--revision", "main"], capture_output=True, text=True,
                       env=_env(home, HF_ENDPOINT="http://127.0.0.1:9"), timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line, = r.stderr.strip().splitlines()
    for words in ("ember quantize: org/absent (revision main)", "could not be reached", str(home / "hub"),
                  "huggingface-cli download org/absent", "HF_HUB_OFFLINE=1"):
        assert words in line, (words, line)
    assert list(tmp_path.iterdir()) == []
