"""A core install (`pip install ember`, no extras) into a fresh virtual environment runs `ember
generate` and `ember chat` on a checkpoint with tokenizer.json and a chat template.

The venv is plain (no system site-packages). torch is pinned to the build this interpreter runs
(CI's CPU wheel, which pip finds again in its cache or wheel folder instead of downloading a CUDA
build); everything else comes from the index pip is configured with (PIP_* variables and pip.conf
apply as they do for CI's own install), as a user's install would.
"""
import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest
import torch

from tests.models import tiny

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _core_env(base: Path):
    """A fresh venv with ember installed from a copy of the sources, no extras: (python, env)."""
    src = base / "src"  # a copy, so the build writes nothing into the working tree
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ember", src / "ember", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    py = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    torch_req = f"torch=={torch.__version__}"  # e.g. 2.13.0+cpu, the wheel pip already has
    _run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", torch_req, src], env=env,
         timeout=600, cwd=base)
    return py, env


# One test (not several sharing a fixture): under xdist each worker would build its own venv.
@pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                    reason="a GPU build of torch would be installed into the venv (gigabytes); the CPU CI runs this")
def test_core_install_runs_generate_and_chat(tmp_path):
    py, env = _core_env(tmp_path)
    ckpt = tiny.save(tiny.build(tiny.moe_config(vocab_size=len(tiny.SPECIALS) + len(tiny.WORDS))),
                     tmp_path / "ckpt", tokenizer=True)
    r = _run([py, "-c", "import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m in "
                        "('transformers', 'diffusers', 'pytest', 'tokenizers', 'jinja2', 'huggingface_hub')}))"],
             env=env, cwd=tmp_path)
    assert json.loads(r.stdout) == {"transformers": False, "diffusers": False, "pytest": False, "tokenizers": True,
                                    "jinja2": True, "huggingface_hub": True}
    ember_bin = py.parent / "ember"
    r = _run([ember_bin, "--version"], env=env, cwd=tmp_path)
    dist = _run([py, "-c", "import importlib.metadata as m; print(m.version('ember'))"], env=env, cwd=tmp_path)
    assert r.stdout.strip() == f"ember {dist.stdout.strip()}"
    r = _run([ember_bin, "generate", "--model", ckpt, "--prompt", "once upon a time", "--chat",
              "--max-new-tokens", "5", "--device", "cpu"], env=env, cwd=tmp_path, timeout=300)
    assert "tok/s decode" in r.stderr
    words = r.stdout.split()
    assert len(words) <= 5 and all(w in tiny.WORDS for w in words)
    r = _run([ember_bin, "chat", "--model", ckpt, "--max-new-tokens", "3", "--device", "cpu", "--quiet"],
             input="hello world\n", env=env, cwd=tmp_path, timeout=300)
    assert len(r.stdout.splitlines()) == 1 and r.stderr == ""
