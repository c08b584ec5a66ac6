"""``ember tune <family>``: sweep a kernel family's tiles on this GPU and cache the winners.

A :class:`Tunable` names, for one family, the keys worth tuning (the shapes of the supported models),
the candidate entries of a key, and how to run the public op for that key. :func:`tune` times every
candidate under ``tuning.override`` (CUDA events around CUDA-graph replays, inputs rotated past L2,
as the benchmarks time), checks its output against the op's reference before it may win, keeps the
fastest, and writes it with ``tuning.write_cache``; from then on ``tuning.lookup`` returns it on
this GPU (before any shipped entry).

Example (on a CUDA machine)::

    ember tune gemv                               # the default shapes
    ember tune gemv --keys bf16:4096x4096,fp8:14336x4096
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch

from ember import tuning


@dataclasses.dataclass
class Tunable:
    """One family's sweep: ``keys`` (defaults), ``candidates(key)``, and ``make_calls(key, device)`` ->
    (calls over rotated inputs, check) where ``check()`` runs one call and raises if its output is wrong."""
    family: str
    doc: str
    keys: Sequence[str]
    candidates: Callable[[str], list[dict]]
    make_calls: Callable[[str, torch.device], tuple[list[Callable[[], object]], Callable[[], None]]]


TUNABLES: dict[str, Tunable] = {}


def register(t: Tunable) -> Tunable:
    TUNABLES[t.family] = t
    return t


def _graph_timer(calls) -> float:
    from ember.bench import _timing
    return _timing.graph_time_us(calls)


def tune(family: str, device: torch.device, *, keys: Sequence[str] | None = None,
         timer: Callable[[list], float] = _graph_timer, write: bool = True,
         progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Sweep ``family`` on ``device``; returns ``{key: {"best", "best_us", "current_us", "tried",
    "failed"}}`` and (``write``) caches each key's winner where it beats what runs today. ``current_us`` is what the kernels ran
    before (shipped entry, generic entry or rule), timed in the same sweep."""
    if family not in TUNABLES:
        raise ValueError(f"family: expected one of {', '.join(sorted(TUNABLES))}, got {family!r}")
    t = TUNABLES[family]
    info = tuning.device_info(device)
    if info is None:
        raise ValueError(f"device: `ember tune` times kernels on a CUDA GPU, got {device}")
    report, winners = {}, {}
    for key in keys or t.keys:
        calls, check = t.make_calls(key, device)
        current_us = timer(calls)
        best, best_us, failed, tried = None, float("inf"), 0, 0
        for cand in t.candidates(key):
            tried += 1
            try:
                with tuning.override(family, {key: cand}):
                    check()
                    us = timer(calls)
            except Exception:  # a tile the kernel cannot compile or that computes wrong values
                failed += 1
                continue
            if us < best_us:
                best, best_us = cand, us
        progress(f"{family} {key}: {best_us:.2f} us (was {current_us:.2f}), {tried} tiles, {failed} failed")
        report[key] = {"best": best, "best_us": best_us, "current_us": current_us, "tried": tried, "failed": failed}
        if best is not None and best_us < current_us:  # never cache a tile slower than what runs today
            winners[key] = best
    if write and winners:
        report["_file"] = str(tuning.write_cache(info, family, winners))
    return report


# ----------------------------------------------------------------------------- gemv
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


def parse_gemv_key(key: str) -> tuple[str, int, int]:
    """``"bf16:2048x4096"`` -> ("bf16", 2048, 4096): the weight's dtype and its [N, K] shape."""
    try:
        dt, shape = key.split(":")
        n, k = (int(v) for v in shape.split("x"))
    except ValueError:
        raise ValueError(f"gemv key: expected '<bf16|fp16|fp32|fp8>:<N>x<K>', got {key!r}") from None
    if dt not in _DTYPES or n < 1 or k < 1:
        raise ValueError(f"gemv key: expected '<bf16|fp16|fp32|fp8>:<N>x<K>', got {key!r}")
    return dt, n, k


def _gemv_candidates(key: str) -> list[dict]:
    parse_gemv_key(key)
    return [dict(BLOCK_N=bn, CHUNKS=c, num_warps=w, STEP_REDUCE=sr)
            for bn, c, w, sr in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16), (1, 2, 4, 8), (False, True))]


def _gemv_calls(key: str, device: torch.device):
    """One-row linears (the decode projections) through the public path a model takes: ``ember.ops.linear``
    for bf16 / fp16 / fp32 weights, ``ember.nn.Fp8Linear`` (row scales) for fp8."""
    from ember import ops
    from ember.bench import _timing
    from ember.nn import Fp8Linear
    dt, n, k = parse_gemv_key(key)
    act = torch.bfloat16 if dt == "fp8" else _DTYPES[dt]
    sets = _timing.copies_to_exceed_l2(n * k * (1 if dt == "fp8" else _DTYPES[dt].itemsize))
    g = torch.Generator(device=device).manual_seed(0)
    xs = [torch.randn(1, k, device=device, dtype=act, generator=g) for _ in range(sets)]
    if dt == "fp8":
        mods = [Fp8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=device, dtype=act)) for _ in range(sets)]
        calls = [lambda x=x, m=m: m(x) for x, m in zip(xs, mods)]
        ref = lambda: xs[0].float() @ mods[0].dequantized_weight(torch.float32).T  # noqa: E731
        run = calls[0]
    else:
        ws = [torch.randn(n, k, device=device, dtype=act, generator=g) for _ in range(sets)]
        calls = [lambda x=x, w=w: ops.linear(x, w) for x, w in zip(xs, ws)]
        ref = lambda: xs[0].float() @ ws[0].float().T  # noqa: E731
        run = calls[0]

    def check():
        want = ref()
        got = run().float()
        tol = 2e-2 * want.abs().max().item() + 1e-3
        if not torch.allclose(got, want, atol=tol, rtol=2e-2):
            raise ValueError(f"{key}: wrong output under this tile")
    return calls, check


register(Tunable(
    family="gemv", doc="the one-row projection GEMV (batch-1 decode): bf16 / fp16 / fp32 and fp8 weights",
    keys=("bf16:5120x2048", "bf16:2048x4096", "fp8:5120x2048", "fp8:2048x4096"),
    candidates=_gemv_candidates, make_calls=_gemv_calls))
