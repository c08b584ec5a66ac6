"""The one-launch kernels compile for sm_90 on a CPU-only machine (tests/ops/sm90_compile_check.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember import _dispatch

CHECK = Path(__file__).with_name("sm90_compile_check.py")


@pytest.mark.parametrize("case", ["sample_topk_tagged", "softmax_waves", "moe_fp8_decode", "pad_wide_rows"])
def test_kernels_compile_for_sm90(case):
    if not _dispatch.triton_available():
        pytest.skip(f"triton not importable: {_dispatch.triton_import_error()}")
    root = CHECK.parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # this tree's ember, whatever an editable install elsewhere points at
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [v for v in [os.environ.get("PYTHONPATH")] if v])
    res = subprocess.run([sys.executable, str(CHECK), case], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    if res.returncode == 3:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "compiled " in res.stdout, res.stdout
