import os
import random

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton can only run through its interpreter, and it must be on before the first
    # `import triton` (triton.language jit-compiles its own helpers at import).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember import _dispatch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on a GPU machine with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same seeds, so a failure reproduces."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def interpreter(monkeypatch):
    """Run Triton kernels on CPU tensors through Triton's interpreter (EMBER_FORCE_TRITON=1)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines; the GPU covers kernels under -m gpu")
    if not _dispatch.triton_available():
        pytest.skip(f"triton not importable: {_dispatch.triton_import_error()}")
    monkeypatch.setenv("EMBER_FORCE_TRITON", "1")
    yield


@pytest.fixture
def cuda():
    return torch.device("cuda")
