"""``ember serve`` refuses bad flags and missing checkpoints with one line and exit code 2, before loading."""
import subprocess
import sys


def serve(*flags):
    return subprocess.run([sys.executable, "-m", "ember", "serve", *flags], capture_output=True, text=True, timeout=120)


def test_bad_flags_and_missing_model(tmp_path):
    for flags, words in ((["--model", str(tmp_path), "--port", "70000"], "--port"),
                         (["--model", str(tmp_path), "--max-batch-size", "0"], "--max-batch-size"),
                         (["--model", str(tmp_path), "--prefill-chunk", "0"], "--prefill-chunk"),
                         (["--model", str(tmp_path), "--api-key", " k "], "--api-key"),
                         (["--model", str(tmp_path / "nope"), "--device", "cpu"], "nope")):
        r = serve(*flags)
        assert r.returncode == 2, (flags, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr


def test_prefill_chunk_flag_reaches_the_scheduler(ckpt, oracle, tmp_path):
    """--prefill-chunk 4: a 10-token prompt prefills as 3 chunks (4 + 4 + 2, the last padded to 2)
    and still gives model.generate's greedy tokens; /metrics shows the chunk and the count."""
    from tests.serve.conftest import NAME, httpx, start, stop
    live = start(ckpt, tmp_path / "server.log", "--prefill-chunk", "4")
    try:
        prompt = list(range(5, 15))
        r = httpx.post(f"{live.url}/v1/completions", timeout=60,
                       json={"model": NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 10
        m = live.metrics()
        assert m["ember_scheduler_prefill_chunk"] == 4 and m["ember_scheduler_prefill_chunks"] == 3, m
        want = oracle.tokenizer.decode(oracle.generate(prompt, max_new_tokens=3)[0])
        assert r.json()["choices"][0]["text"] == want
    finally:
        assert stop(live) == 0, live.log.read_text()
