"""Shared test helpers: tolerances per dtype, poisoned outputs, float64 comparisons."""
from __future__ import annotations

import torch

# (atol, rtol) for a result computed in fp32 math and rounded once to the output dtype.
# bf16 has 8 mantissa bits (2^-8 = 0.0039 relative), fp16 11 bits (2^-11), fp32 ~2^-24 plus
# reduction-order error over up to 16k elements.
ROUNDED_ONCE = {
    torch.bfloat16: (1e-2, 8e-3),
    torch.float16: (1e-3, 1e-3),
    torch.float32: (1e-5, 1e-5),
}


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer pre-filled with NaN (or the max int) so an unwritten element fails a check."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(dtype).max if dtype != torch.bool else True)
    return t


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **kw):
    atol, rtol = ROUNDED_ONCE[dtype or actual.dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=kw.get("atol", atol),
                               rtol=kw.get("rtol", rtol), equal_nan=False)


def check_compile_and_graph(f, x):
    """``f(x)`` under torch.compile(fullgraph=True) equals eager, and a CUDA graph of ``f`` replayed on
    new values of ``x`` equals eager too (both bit for bit). Returns the graph's output buffer."""
    exp = f(x)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), exp, atol=0, rtol=0)
    f(x)  # warm-up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out, f(x), atol=0, rtol=0)
    return out


def force_triton_or_skip(monkeypatch, force: bool) -> None:
    """With ``force``, run ember's Triton kernels through the interpreter for the rest of the test
    (EMBER_FORCE_TRITON=1), or skip where that cannot run (a CUDA machine, no triton)."""
    if not force:
        return
    import pytest

    from ember import _dispatch
    if not _dispatch.triton_available() or torch.cuda.is_available():
        pytest.skip("the forced-Triton compile test runs on CPU-only machines with triton")
    monkeypatch.setenv("EMBER_FORCE_TRITON", "1")
