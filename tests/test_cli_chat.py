"""`ember chat` driven through a subprocess's stdin: turns, history, --system, /reset, /exit, EOF."""
import shutil
import subprocess
import sys

import pytest

import ember
from tests.models import tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = tiny.build(tiny.moe_config(vocab_size=len(tiny.SPECIALS) + len(tiny.WORDS)), seed=3)
    return tiny.save(hf, tmp_path_factory.mktemp("chat"), tokenizer=True)


def chat(path, stdin, *flags):
    return subprocess.run([sys.executable, "-m", "ember", "chat", "--model", str(path), "--device", "cpu",
                           "--max-new-tokens", "4", "--quiet", *flags], input=stdin, capture_output=True,
                          text=True, timeout=180)


def test_turns_history_system_and_reset(ckpt):
    r = chat(ckpt, "hello world\nonce upon a time\n/reset\nthe cat\n", "--system", "two three")
    assert r.returncode == 0 and r.stderr.strip() == "(conversation reset)", r.stderr
    replies = r.stdout.split("\n")
    assert replies[-1] == "" and len(replies) == 4  # three replies, each ended by a newline; EOF exits
    # the same conversation through the API, message by message
    model = ember.load(ckpt, device="cpu", max_seq_len=256)
    tok = model.tokenizer
    system = [{"role": "system", "content": "two three"}]

    def reply(messages):
        return model.generate(tok.apply_chat_template(messages), max_new_tokens=4)[0]

    u1, u2, u3 = ({"role": "user", "content": c} for c in ("hello world", "once upon a time", "the cat"))
    r1 = reply(system + [u1])
    r2 = reply(system + [u1, {"role": "assistant", "content": r1}, u2])  # the history is in the prompt
    r3 = reply(system + [u3])  # /reset forgot turns 1 and 2, kept the system prompt
    assert replies[:3] == [r1, r2, r3]


def test_exit_command_and_unknown_command(ckpt):
    r = chat(ckpt, "/help\nhello\n/exit\nnever answered\n")
    assert r.returncode == 0
    assert len(r.stdout.split("\n")) == 2  # one reply
    assert "unknown command '/help'" in r.stderr


def test_chat_needs_a_chat_template(ckpt, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt, path)
    (path / "tokenizer_config.json").write_text('{"eos_token": "<|eos|>"}')
    r = chat(path, "hello\n")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "no chat template" in r.stderr
