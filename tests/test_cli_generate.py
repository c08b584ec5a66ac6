"""`ember generate` as a user runs it: subprocesses on a tiny checkpoint with a tiny tokenizer saved
beside it, exit codes and messages checked; a few in-process runs where a spy must see inside."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import ember
from ember.cli import main
from ember.models import SUPPORTED
from tests.models import tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    hf = tiny.build(tiny.moe_config())
    return hf, tiny.save(hf, tmp_path_factory.mktemp("cli"), tokenizer=True)


def ember_cli(*args, input=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "ember", *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=timeout)


def assert_one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def copy_ckpt(path, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(path, out)
    return out


def test_generate_prints_tokens_and_figures_on_stderr(ckpt, capsys):
    hf, path = ckpt
    assert main(["generate", "--model", str(path), "--prompt", "once upon a time", "--max-new-tokens", "6",
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode("once upon a time").ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                      eos_token_id=None)[0, len(ids):].tolist()
    ref = ref[: ref.index(1)] if 1 in ref else ref  # eos (id 1) ends the output
    assert captured.out.strip() == tok.decode(ref, skip_special_tokens=True).strip()
    assert "tok/s" not in captured.out
    figures = captured.err.strip()
    assert figures.startswith("[") and "prompt tokens" in figures and "tok/s decode" in figures \
        and "peak memory" in figures


def test_quiet_drops_the_statistics_line_and_stdin_prompt(ckpt):
    _, path = ckpt
    common = ["generate", "--model", path, "--max-new-tokens", "5", "--device", "cpu"]
    loud = ember_cli(*common, "--prompt", "the cat sat on")
    quiet = ember_cli(*common, "--prompt", "-", "--quiet", input="the cat sat on\n")
    assert loud.returncode == 0 and quiet.returncode == 0, (loud.stderr, quiet.stderr)
    assert "tok/s decode" in loud.stderr and quiet.stderr == ""
    assert quiet.stdout == loud.stdout  # the prompt read from stdin is the same prompt
    empty = ember_cli(*common, "--prompt", "-", input="")
    assert_one_line_error(empty, "--prompt -", "stdin was empty")


def test_sampling_flags_reach_the_sampler(ckpt, capsys, monkeypatch):
    _, path = ckpt
    seen = []
    real = ember.ops.sample

    def spy(logits, **kw):
        seen.append({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
        return real(logits, **kw)

    monkeypatch.setattr(ember.ops, "sample", spy)
    assert main(["generate", "--model", str(path), "--prompt", "hello world", "--chat", "--max-new-tokens", "4",
                 "--temperature", "0.8", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05", "--seed", "1234",
                 "--device", "cpu", "--quiet"]) == 0
    assert seen, "the sampler never ran"
    from ember.engine import SEED_STEP, _wrap64
    for k, call in enumerate(seen):
        assert call["temperature"] == [pytest.approx(0.8)] and call["top_k"] == [5]
        assert call["top_p"] == [pytest.approx(0.9)] and call["min_p"] == [pytest.approx(0.05)]
        assert call["seed"] == [_wrap64(1234 + k * SEED_STEP)]  # the request's seed, one step per draw
    # top_k 1 keeps only the most likely token: at any temperature, the greedy continuation
    capsys.readouterr()
    args = ["generate", "--model", str(path), "--prompt", "the dog ran under", "--max-new-tokens", "8",
            "--device", "cpu", "--quiet"]
    assert main(args) == 0
    greedy = capsys.readouterr().out
    assert main(args + ["--temperature", "5", "--top-k", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy
    # and a hot sampler without top-k is not greedy (the temperature is not ignored)
    assert main(args + ["--temperature", "5", "--seed", "3"]) == 0
    assert capsys.readouterr().out != greedy


def test_generate_bad_input_exit_codes(ckpt, tmp_path, capsys):
    _, path = ckpt
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "x", "--temperature", "-1", "--device", "cpu"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "the cat " * 10, "--max-seq-len", "16",
                 "--device", "cpu"]) == 2
    assert "exceeds max_seq_len=16" in capsys.readouterr().err


@pytest.mark.parametrize("device, words", [
    ("nosuch", ["--device", "'nosuch' is not a device"]),
    ("cuda", ["--device cuda"]),
    ("mps", ["--device mps", "MPS is not available"]),
])
def test_unusable_device_is_one_line(ckpt, device, words):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    if device == "cuda":
        words = words + (["no CUDA support"] if not torch.backends.cuda.is_built() else ["no usable CUDA device"])
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    _, path = ckpt
    assert_one_line_error(ember_cli("generate", "--model", path, "--prompt", "x", "--device", device), *words)


def test_seed_out_of_int64_range(ckpt):
    _, path = ckpt
    r = ember_cli("generate", "--model", path, "--prompt", "x", "--temperature", "1", "--seed", str(2 ** 64),
                  "--device", "cpu")
    assert_one_line_error(r, "--seed", str(2 ** 64), "int64")


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m['content'] | nosuch }}{% endfor %}", ["does not parse", "line 1"]),
    ("hello\n{% for m in messages %}\n{{ m['content'] + 1 }}{% endfor %}", ["failed at line 3", "TypeError"]),
    ("{{ raise_exception('no system messages') }}", ["refused the messages: no system messages"]),
])
def test_broken_chat_template_names_the_file(ckpt, tmp_path, template, words):
    _, path = ckpt
    path = copy_ckpt(path, tmp_path)
    (path / "chat_template.jinja").write_text(template)
    args = ("generate", "--model", path, "--prompt", "hello", "--chat", "--device", "cpu")
    assert_one_line_error(ember_cli(*args), "chat_template.jinja", *words)
    if "does not parse" in words:  # --debug shows the traceback instead (once is enough)
        debug = ember_cli(*args, "--debug")
        assert debug.returncode != 0 and "Traceback" in debug.stderr and "chat_template.jinja" in debug.stderr


def test_bad_json_in_tokenizer_config_names_the_file(ckpt, tmp_path):
    _, path = ckpt
    path = copy_ckpt(path, tmp_path)
    (path / "tokenizer_config.json").write_text('{"eos_token": "<|eos|>",')
    r = ember_cli("generate", "--model", path, "--prompt", "hello", "--device", "cpu")
    assert_one_line_error(r, "tokenizer_config.json", "not valid JSON", "line 1")


def test_default_cache_fits_the_request_and_passing_max_positions_warns_once(ckpt):
    # 4,100 prompt tokens: more than the 4,096 the cache once defaulted to, and past the
    # checkpoint's max_position_embeddings (256), which is worth one warning, not one a token
    _, path = ckpt
    r = ember_cli("generate", "--model", path, "--prompt", "-", "--max-new-tokens", "3", "--device", "cpu",
                  input="the " * 4100)
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "max_position_embeddings" in line]
    assert len(warned) == 1 and "warning" in warned[0] and "256" in warned[0], r.stderr
    assert "[4100 prompt tokens" in r.stderr


def test_cache_that_does_not_fit_in_memory_is_refused(ckpt):
    _, path = ckpt
    # this process sees 1 MB of free memory; the 4,096-token cache of the tiny model needs 2.1 MB
    code = ("import sys, ember.engine as e\n"
            "e._free_host_memory = lambda: 1_000_000\n"
            "from ember.cli import main\n"
            f"sys.exit(main(['generate', '--model', {str(path)!r}, '--prompt', 'x', '--max-seq-len', '4096', "
            "'--device', 'cpu']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert_one_line_error(r, "not enough memory on cpu", "need ~2.1 MB (1 x 4096 tokens), 1.0 MB free")


def test_ctrl_c_ends_generate_cleanly(ckpt, tmp_path):
    _, path = ckpt
    path = copy_ckpt(path, tmp_path)  # no EOS anywhere: the generation cannot end on its own
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    (path / "config.json").write_text(json.dumps(cfg))
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    tcfg.pop("eos_token")
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    inherited = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])

    def as_from_a_shell():  # SIGINT delivered and handled, whatever this (test worker) process set
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

    p = subprocess.Popen([sys.executable, "-m", "ember", "generate", "--model", str(path), "--prompt", "the cat",
                          "--max-new-tokens", "200000", "--device", "cpu"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=as_from_a_shell)
    started = threading.Event()

    def drain():  # read everything: a child blocked on a full stdout pipe could not exit on SIGINT
        while p.stdout.read1(4096):
            started.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "no output within 120 s"  # decoding has started
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"generate ignored SIGINT for 60 s (the test process's SIGINT handler and "
                                 f"blocked signals: {inherited}); stderr: {p.stderr.read().decode()[-2000:]}")
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(timeout=10)
    err = p.stderr.read().decode()
    assert rc == 130, err
    assert "Traceback" not in err and "interrupted" in err


def test_console_script_runs(ckpt):
    _, path = ckpt
    r = ember_cli("generate", "--model", path, "--prompt", "the dog", "--max-new-tokens", "3", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "tok/s decode" in r.stderr


def test_generate_help_names_every_model_type():
    r = ember_cli("generate", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for model_type in SUPPORTED:
        assert model_type in text


def test_generate_fp8_lm_head_flag(ckpt, capsys):
    _, path = ckpt
    assert main(["generate", "--model", str(path), "--prompt", "once upon a time", "--max-new-tokens", "4",
                 "--fp8", "--fp8-lm-head", "--device", "cpu"]) == 0
    assert "| fp8]" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "x", "--fp8-lm-head", "--device", "cpu"]) == 2
    assert "fp8_lm_head: needs fp8=True" in capsys.readouterr().err


def test_hub_id_goes_through_the_hub_resolver(tmp_path):
    # offline, with an empty cache: the resolver's own one-line answer, exit 2
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    r = subprocess.run([sys.executable, "-m", "ember", "generate", "--model", "nosuch-org/nosuch-model",
                        "--revision", "main", "--prompt", "x", "--device", "cpu"], capture_output=True, text=True,
                       env=env, timeout=180)
    assert_one_line_error(r, "nosuch-org/nosuch-model")
