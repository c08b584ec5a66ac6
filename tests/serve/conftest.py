"""A live ``ember serve`` in a subprocess on a free loopback port, over a tiny random Qwen3-MoE checkpoint
with a word-level tokenizer (tests.models.tiny); the same checkpoint loaded in this process is the
oracle (``model.generate``)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import ember  # noqa: E402
from tests.models import tiny  # noqa: E402

API_KEY = "sk-test-ember"
SLOTS = 8
MAX_SEQ_LEN = 96
NAME = "tiny-moe"


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    hf = tiny.build(tiny.moe_config(vocab_size=len(tiny.SPECIALS) + len(tiny.WORDS)), seed=3)
    with torch.no_grad():  # EOS (id 1) logit 0: greedy runs to max_tokens, sampling stops now and then
        hf.lm_head.weight[1].zero_()
    return tiny.save(hf, tmp_path_factory.mktemp("serve") / NAME, tokenizer=True)


@pytest.fixture(scope="session")
def oracle(ckpt):
    """The checkpoint in this process: what ``model.generate`` alone returns."""
    return ember.load(ckpt, device="cpu", max_seq_len=MAX_SEQ_LEN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A running server: its URL, process and log."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def metrics(self) -> dict[str, float]:
        r = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        r.raise_for_status()
        return parse_prometheus(r.text)


def parse_prometheus(text: str) -> dict[str, float]:
    """Exposition text -> {'name{labels}': value}; every non-comment line must be one sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


def start(ckpt: Path, log: Path, *flags: str, timeout: float = 120) -> Live:
    port = free_port()
    cmd = [sys.executable, "-m", "ember", "serve", "--model", str(ckpt), "--device", "cpu", "--port", str(port),
           "--max-batch-size", str(SLOTS), "--max-seq-len", str(MAX_SEQ_LEN), "--log-level", "warning", *flags]
    # the log goes to a file: a pipe nobody reads would block the server once full
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ember serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Live(proc, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"ember serve did not answer /health in {timeout} s:\n{log.read_text()}")


def stop(live: Live) -> int:
    live.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown (the scheduler's too)
    try:
        return live.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        live.proc.kill()
        raise


@pytest.fixture(scope="session")
def server(ckpt, tmp_path_factory):
    live = start(ckpt, tmp_path_factory.mktemp("log") / "server.log", "--api-key", API_KEY,
                 "--served-model-name", NAME)
    yield live
    rc = stop(live)
    assert rc == 0, live.log.read_text()
