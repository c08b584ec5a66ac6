"""`ember generate` end to end on a tiny checkpoint with a tiny tokenizer saved beside it."""
import subprocess
import sys

import pytest
import torch

from ember.cli import main
from tests.models import tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = tiny.build(tiny.moe_config())
    return hf, tiny.save(hf, tmp_path_factory.mktemp("cli"), tokenizer=True)


def test_generate_prints_tokens_and_figures(ckpt, capsys):
    hf, path = ckpt
    assert main(["generate", "--model", str(path), "--prompt", "once upon a time", "--max-new-tokens", "6",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    text, figures = out.rsplit("\n[", 1)
    from tests.models.tiny import WORDS, SPECIALS  # noqa: F401
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode("once upon a time").ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                      eos_token_id=None)[0, len(ids):].tolist()
    ref = ref[: ref.index(1)] if 1 in ref else ref  # eos (id 1) ends the output
    assert text.strip() == tok.decode(ref, skip_special_tokens=True).strip()
    assert "prompt tokens" in figures and "tok/s decode" in figures and "peak memory" in figures


def test_generate_chat_and_sampling_flags(ckpt, capsys):
    _, path = ckpt
    assert main(["generate", "--model", str(path), "--prompt", "hello world", "--chat", "--max-new-tokens", "4",
                 "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--seed", "1", "--device", "cpu"]) == 0
    assert "tok/s decode" in capsys.readouterr().out


def test_generate_bad_input_exit_codes(ckpt, tmp_path, capsys):
    _, path = ckpt
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "x", "--temperature", "-1", "--device", "cpu"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "the cat " * 10, "--max-seq-len", "16",
                 "--device", "cpu"]) == 2
    assert "exceeds max_seq_len=16" in capsys.readouterr().err


def test_console_script_runs(ckpt):
    _, path = ckpt
    r = subprocess.run([sys.executable, "-m", "ember", "generate", "--model", str(path), "--prompt", "the dog",
                        "--max-new-tokens", "3", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "tok/s decode" in r.stdout


def test_generate_fp8_lm_head_flag(ckpt, capsys):
    _, path = ckpt
    assert main(["generate", "--model", str(path), "--prompt", "once upon a time", "--max-new-tokens", "4",
                 "--fp8", "--fp8-lm-head", "--device", "cpu"]) == 0
    assert "| fp8]" in capsys.readouterr().out
    assert main(["generate", "--model", str(path), "--prompt", "x", "--fp8-lm-head", "--device", "cpu"]) == 2
    assert "fp8_lm_head: needs fp8=True" in capsys.readouterr().err
