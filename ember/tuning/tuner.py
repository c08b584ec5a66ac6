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
    (calls over rotated inputs, check) where ``check()`` runs one call and raises if its output is wrong;
    ``timer`` (default: 20 calls a graph, 25 replays) for families whose calls take milliseconds."""
    family: str
    doc: str
    keys: Sequence[str]
    candidates: Callable[[str], list[dict]]
    make_calls: Callable[[str, torch.device], tuple[list[Callable[[], object]], Callable[[], None]]]
    timer: Callable[[list], float] | None = None


TUNABLES: dict[str, Tunable] = {}


def register(t: Tunable) -> Tunable:
    TUNABLES[t.family] = t
    return t


def _graph_timer(calls) -> float:
    return _timing_graph(calls)


def _timing_graph(calls, **kw) -> float:
    from ember.bench import _timing
    return _timing.graph_time_us(calls, **kw)


def tune(family: str, device: torch.device, *, keys: Sequence[str] | None = None,
         timer: Callable[[list], float] | None = None, write: bool = True,
         progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Sweep ``family`` on ``device``; returns ``{key: {"best", "best_us", "current_us", "tried",
    "failed"}}`` and (``write``) caches each key's winner where it beats what runs today. ``current_us`` is what the kernels ran
    before (shipped entry, generic entry or rule), timed in the same sweep."""
    if family not in TUNABLES:
        raise ValueError(f"family: expected one of {', '.join(sorted(TUNABLES))}, got {family!r}")
    t = TUNABLES[family]
    timer = timer or t.timer or _graph_timer
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


# ----------------------------------------------------------------------------- cross_entropy
# the shape `ember bench train` times (tokens x hidden x vocab: Qwen3's 151,936-token vocabulary)
CE_SHAPE = (8192, 2048, 151936)
CE_CHECK_ROWS = 128  # rows the correctness check compares against torch (the whole [N, V] would be 5 GB)
_CE_SMEM_BYTES = 200 << 10  # Hopper's 227 KB a block, less the kernel's own


def parse_ce_key(key: str) -> tuple[str, torch.dtype]:
    """``"lse:bf16"`` -> ("lse", torch.bfloat16): the kernel (lse, grad, mm) and the input dtype."""
    kernel, _, dt = key.partition(":")
    if kernel not in ("lse", "grad", "mm") or dt not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"cross_entropy key: expected '<lse|grad|mm>:<bf16|fp16|fp32>', got {key!r}")
    return kernel, _DTYPES[dt]


def _ce_candidates(key: str) -> list[dict]:
    """Tiles whose operand stages fit shared memory (the rest would not compile)."""
    _, dtype = parse_ce_key(key)
    out = []
    for bm, bn, bk, w, st in itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4)):
        if (bm + bn) * bk * dtype.itemsize * st <= _CE_SMEM_BYTES:
            out.append(dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st))
    return out


def _ce_calls(key: str, device: torch.device):
    """One kernel of ``ember.ops.linear_cross_entropy`` at ``CE_SHAPE`` (the backward's kernels on one
    1,024-column vocab chunk, as the op runs them), and a check of its first ``CE_CHECK_ROWS`` rows
    against torch in float32."""
    from ember import _dispatch
    _dispatch.prepare_triton()
    from ember.kernels import cross_entropy as k
    kernel, dtype = parse_ce_key(key)
    N, H, V = CE_SHAPE
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(N, H, device=device, generator=g).to(dtype)
    w = (torch.randn(V, H, device=device, generator=g) * H ** -0.5).to(dtype)
    r, vc = min(CE_CHECK_ROWS, N), min(1024, V)
    t = torch.randint(0, V, (N,), device=device, generator=g)
    t[:r] = torch.randint(0, vc, (r,), device=device, generator=g)  # the checked rows' targets in the chunk
    logits = x[:r].float() @ w.float().T  # [r, V] float32
    lse_ref = torch.logsumexp(logits, dim=-1)
    # the kernels see the same rounded inputs and accumulate in float32: only the order differs
    if kernel == "lse":
        def run():
            return k.lse_partials(x, w, None, t, None, False)

        def check():
            m, s, _, _ = run()
            mx = m.max(dim=0).values
            lse = mx + torch.log((s * torch.exp(m - mx)).sum(dim=0))
            if not torch.allclose(lse[:r], lse_ref, atol=1e-3, rtol=1e-4):
                raise ValueError(f"{key}: wrong logsumexp under this tile")
        return [run], check
    lse = torch.zeros(N, device=device)
    lse[:r] = lse_ref
    scale = torch.ones(N, device=device)
    grad = torch.empty(N, vc, dtype=dtype, device=device)
    if kernel == "grad":
        def run():
            k.grad_logits(x, w, None, t, lse, scale, None, 1.0, 0.0, 0, grad)

        def check():
            run()
            # softmax - one-hot(target) over the chunk's columns, rounded to the input dtype by the kernel
            want = torch.exp(logits[:, :vc] - lse_ref[:, None])
            want -= (t[:r, None] == torch.arange(vc, device=device)).float()
            if not torch.allclose(grad[:r].float(), want, atol=1e-4, rtol=1e-2):
                raise ValueError(f"{key}: wrong logits gradient under this tile")
        return [run], check
    grad.copy_((torch.randn(N, vc, device=device, generator=g) * 1e-2).to(dtype))
    acc = torch.zeros(N, H, device=device)

    def run():
        k.mm_accumulate(grad, w[:vc], acc)

    def check():
        acc.zero_()
        run()
        want = grad[:r].float() @ w[:vc].float()
        if not torch.allclose(acc[:r], want, atol=1e-5, rtol=1e-3):
            raise ValueError(f"{key}: wrong product under this tile")
    return [run], check


register(Tunable(
    family="cross_entropy",
    doc="the fused linear + cross-entropy's kernels (forward logsumexp, logits gradient, grad_x product)",
    keys=("lse:bf16", "grad:bf16", "mm:bf16"), candidates=_ce_candidates, make_calls=_ce_calls,
    # the forward at CE_SHAPE takes ~12 ms a call: 2 calls a graph, 5 replays keep the sweep of ~100
    # tiles a key within minutes (compiles dominate)
    timer=lambda calls: _timing_graph(calls, replays=5, calls_per_graph=2)))
