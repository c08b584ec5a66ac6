"""``ember serve`` refuses bad flags and missing checkpoints with one line and exit code 2, before loading."""
import subprocess
import sys


def serve(*flags):
    return subprocess.run([sys.executable, "-m", "ember", "serve", *flags], capture_output=True, text=True, timeout=120)


def test_bad_flags_and_missing_model(tmp_path):
    for flags, words in ((["--model", str(tmp_path), "--port", "70000"], "--port"),
                         (["--model", str(tmp_path), "--max-batch-size", "0"], "--max-batch-size"),
                         (["--model", str(tmp_path), "--api-key", " k "], "--api-key"),
                         (["--model", str(tmp_path / "nope"), "--device", "cpu"], "nope")):
        r = serve(*flags)
        assert r.returncode == 2, (flags, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stderr
