"""A core install (`pip install ember`, no extras) into a fresh virtual environment runs `ember
generate` and `ember chat` on a checkpoint with tokenizer.json and a chat template.

The venv is plain (no system site-packages). torch is the build this interpreter runs (the CPU
wheel CI installs, so pip finds it in its cache / wheel folder instead of downloading a CUDA
build); every other package comes from the index pip is configured with, as a user's would.
"""
import json
import os
import shutil
import subprocess
import sys
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


@pytest.fixture(scope="module")
def core_env(tmp_path_factory):
    base = tmp_path_factory.mktemp("core-install")
    # a copy of the sources, so the build writes nothing into the working tree
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "ember", src / "ember", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    py = env_dir / ("Scripts" if os.name == "nt" else "bin") / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    torch_req = f"torch=={torch.__version__}"  # e.g. 2.13.0+cpu: never a CUDA build pulled in here
    _run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", torch_req, src], env=env,
         timeout=600, cwd=base)
    return py, env, base


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("core-ckpt")
    return tiny.save(tiny.build(tiny.moe_config(vocab_size=len(tiny.SPECIALS) + len(tiny.WORDS))), out, tokenizer=True)


def test_core_install_has_no_extras(core_env):
    py, env, base = core_env
    r = _run([py, "-c", "import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m in "
                        "('transformers', 'diffusers', 'pytest', 'tokenizers', 'jinja2', 'huggingface_hub')}))"],
             env=env, cwd=base)
    found = json.loads(r.stdout)
    assert found == {"transformers": False, "diffusers": False, "pytest": False, "tokenizers": True,
                     "jinja2": True, "huggingface_hub": True}


def test_core_install_generates_and_chats(core_env, ckpt):
    py, env, base = core_env
    ember_bin = py.parent / "ember"
    r = _run([ember_bin, "--version"], env=env, cwd=base)
    dist = _run([py, "-c", "import importlib.metadata as m; print(m.version('ember'))"], env=env, cwd=base)
    assert r.stdout.strip() == f"ember {dist.stdout.strip()}"
    r = _run([ember_bin, "generate", "--model", ckpt, "--prompt", "once upon a time", "--chat",
              "--max-new-tokens", "5", "--device", "cpu"], env=env, cwd=base, timeout=300)
    assert "tok/s decode" in r.stderr
    words = r.stdout.split()
    assert len(words) <= 5 and all(w in tiny.WORDS for w in words)
    r = _run([ember_bin, "chat", "--model", ckpt, "--max-new-tokens", "3", "--device", "cpu", "--quiet"],
             input="hello world\n", env=env, cwd=base, timeout=300)
    assert len(r.stdout.splitlines()) == 1 and r.stderr == ""
