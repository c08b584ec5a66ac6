"""How an op chooses its path: Triton kernel or plain-PyTorch reference.

Rules (ARCHITECTURE.md, "Dispatch"):
  * CUDA tensors and an importable Triton  -> the Triton kernel.
  * ``EMBER_FORCE_TRITON=1``               -> the Triton kernel even for CPU tensors, run by
    Triton's interpreter (we set ``TRITON_INTERPRET=1`` just before the first kernel module is
    imported, because ``triton.jit`` reads it when a kernel is defined). This is how CI tests
    kernels on machines without a GPU. The interpreter must be on before Triton is first imported
    in the process; test suites on CPU-only machines set ``TRITON_INTERPRET=1`` at start-up.
  * anything else (CPU, MPS, no Triton)    -> the reference implementation. That includes AMD GPUs
    under a ROCm build of torch (their tensors also say "cuda"): the kernels are written and tested
    for NVIDIA GPUs only (inline PTX, Hopper's dependent launch, float8_e4m3fn), so there the ops
    run their plain-PyTorch reference on the GPU and ``ember doctor`` says so.

Triton is imported lazily, so ``import ember`` works where Triton does not exist (macOS, Windows).
"""
from __future__ import annotations

import functools

import torch

from ember import _switches


def force_triton() -> bool:
    """True when ``EMBER_FORCE_TRITON=1``: run Triton kernels on CPU tensors via the interpreter."""
    return bool(_switches.get("EMBER_FORCE_TRITON"))


def prepare_triton() -> None:
    """Call before importing an ``ember.kernels`` module: switches Triton's interpreter on under
    ``EMBER_FORCE_TRITON=1`` without a GPU. Ops import their kernel module by name right after it,
    at the launch site, so ``import ember`` never imports Triton and the dependency stays visible::

        _dispatch.prepare_triton()
        from ember.kernels import norm as kernels
    """
    _enable_interpreter_if_forced()


def _enable_interpreter_if_forced() -> None:
    # Must happen before the first ``import triton``: triton.language defines its own @jit helpers
    # (the combine functions of tl.sum, tl.max, ...) at import time, and they only run under the
    # interpreter if it was on then.
    if force_triton() and not torch.cuda.is_available():
        _switches.set_process_env("TRITON_INTERPRET", "1")


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    """None when ``import triton`` works, else the reason it does not."""
    _enable_interpreter_if_forced()
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising anything
        return f"{type(e).__name__}: {e}"
    return None


def triton_available() -> bool:
    return triton_import_error() is None


def rocm() -> bool:
    """Whether this torch is a ROCm (AMD GPU) build, whose "cuda" device is an AMD GPU."""
    return getattr(torch.version, "hip", None) is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` should take the Triton path."""
    if not triton_available():
        return False
    if t.device.type == "cuda":
        return not rocm()
    return t.device.type == "cpu" and force_triton()


def kernels(family: str):
    """``ember.kernels.<family>``, imported after :func:`prepare_triton`: for tests and benchmarks that
    call a kernel module's launch helpers directly. Library code imports the module by name instead."""
    import importlib
    prepare_triton()
    return importlib.import_module(f"ember.kernels.{family}")


def pdl_allowed() -> bool:
    """EMBER_PDL is on: decode kernels may use programmatic dependent launch (where the GPU has it,
    sm_90+; read per call, so also while a CUDA graph is captured)."""
    return bool(_switches.get("EMBER_PDL"))


def compiling() -> bool:
    """True while torch.compile / dynamo traces the caller."""
    return torch.compiler.is_compiling()
