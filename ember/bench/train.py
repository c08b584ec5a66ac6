"""``ember bench train``: the training ops, forward + backward, against the stock paths in the same run.

Rows (H200 shapes; ``--quick`` runs tiny ones on the CPU):

* ``linear_cross_entropy_8192x2048x151936_bf16``: ms and peak extra GB of loss + grads of x and W for
  ember, the torch path (F.linear, then float32 F.cross_entropy), Liger-Kernel's
  ``LigerFusedLinearCrossEntropyLoss`` and Cut Cross-Entropy's ``linear_cross_entropy`` (each
  peer imported lazily; one not installed is recorded so in the row). Floor: 3 GEMMs of
  2 * 8192 * 2048 * 151936 FLOP plus the forward's recomputation = 20.4 TFLOP -> 25.8 ms at 790 TFLOP/s.
* ``rmsnorm_fwd_bwd_8192x2048_bf16``: GB/s of rmsnorm forward + backward over the bytes it must move
  (forward: read x, write y; backward: read x and dy, write dx: 5 x 32 MiB = 168 MB -> 40 us at
  4.155 TB/s) against the float32 torch composite under autograd.

The model-level rows of ``ember/bench/_train_model.py`` are appended when that module exists.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

import ember
from ember.bench import BenchContext, Row, _timing

BF16_TFLOPS = 790.0


def _fwd_bwd_ms(fn, ctx: BenchContext, iters: int) -> float:
    """Median ms of one call of ``fn`` (loss + backward): CUDA events around eager calls on the GPU
    (autograd and the peers' host work included, as a training step pays them), wall clock elsewhere."""
    if not ctx.on_gpu:
        return _timing.host_time_us([fn], iters=iters, warmup=1) / 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _peak_extra_gb(fn, ctx: BenchContext) -> float:
    """Peak GPU memory allocated during one call of ``fn`` above what was allocated before it (grads
    included: the caller returns them and drops them), NaN off CUDA."""
    if not ctx.on_gpu:
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def _loss_peers():
    """name -> loss(x, w, t) or the reason it cannot run."""
    peers = {"torch": lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        peers["liger"] = lambda x, w, t: liger(w, x, t)
    except Exception as e:  # ImportError, or a wheel that fails on this torch / triton
        peers["liger"] = f"not installed ({type(e).__name__}: {e})"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        peers["cce"] = lambda x, w, t: cce(x, w, t)
    except Exception as e:
        peers["cce"] = f"not installed ({type(e).__name__}: {e})"
    return peers


def _loss_row(ctx: BenchContext) -> Row:
    N, H, V = (8192, 2048, 151936) if not ctx.quick else (64, 128, 1000)
    dtype = torch.bfloat16
    ctx.progress(f"linear_cross_entropy {N}x{H}x{V}")
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(N, H, device=ctx.device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device=ctx.device, generator=gen) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), device=ctx.device, generator=gen)
    iters = 10 if ctx.on_gpu else 3
    fns = {"ember": lambda x, w, t: ember.ops.linear_cross_entropy(x, w, t)}
    fns.update(_loss_peers())
    ms, gb, losses, notes = {}, {}, {}, {}
    for name, f in fns.items():
        if isinstance(f, str):
            notes[name] = f
            continue

        def step(f=f):
            loss = f(x, w, t)
            torch.autograd.grad(loss, (x, w))
            return loss
        try:
            losses[name] = float(step().detach())
            gb[name] = _peak_extra_gb(step, ctx)
            ms[name] = _fwd_bwd_ms(step, ctx, iters)
        except Exception as e:  # out of memory, a peer broken on this stack: recorded, not fatal
            notes[name] = f"failed ({type(e).__name__}: {str(e)[:200]})"
            if ctx.on_gpu:
                torch.cuda.empty_cache()
    flops = 4 * 2 * N * H * V  # forward, the backward's recomputation, grad_x, grad_W
    base = "cce" if "cce" in ms else "torch"
    extra = {f"{k}_ms": v for k, v in ms.items()}
    extra.update({f"{k}_peak_extra_gb": v for k, v in gb.items()})
    extra.update({f"{k}_loss": v for k, v in losses.items()})
    extra.update({f"{k}_note": v for k, v in notes.items()})
    extra["flop_bound_ms"] = flops / (BF16_TFLOPS * 1e12) * 1e3
    if "ember" in ms:
        extra["fraction_of_flop_bound"] = extra["flop_bound_ms"] / ms["ember"]
    meets = None
    if ctx.on_gpu and "ember" in ms and "cce" in ms and "torch" in gb:
        meets = ms["ember"] <= ms["cce"] and gb["ember"] <= 0.05 * gb["torch"]
    return Row(f"linear_cross_entropy_{N}x{H}x{V}_bf16", "ms", ms.get("ember", float("nan")), ms.get(base),
               {"cce": "Cut Cross-Entropy 25.1.1 linear_cross_entropy", "torch": "F.linear + float32 F.cross_entropy"}[base],
               target="<= Cut Cross-Entropy's ms and peak extra <= 5% of the torch path's", meets=meets, extra=extra)


def torch_rmsnorm(x, w, eps):
    """HF's Qwen3RMSNorm: float32 math, cast back, then the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _norm_row(ctx: BenchContext) -> Row:
    M, H = (8192, 2048) if not ctx.quick else (64, 256)
    dtype, eps = torch.bfloat16, 1e-6
    ctx.progress(f"rmsnorm fwd+bwd {M}x{H}")
    w = torch.randn(H, dtype=dtype, device=ctx.device).requires_grad_()
    sets = _timing.copies_to_exceed_l2(3 * M * H * 2) if ctx.on_gpu else 1
    data = [(torch.randn(M, H, dtype=dtype, device=ctx.device).requires_grad_(),
             torch.randn(M, H, dtype=dtype, device=ctx.device)) for _ in range(sets)]

    def calls(norm):
        return [lambda x=x, g=g: torch.autograd.grad(norm(x, w, eps), (x, w), g) for x, g in data]
    timer = "cuda graph"
    try:
        t_ember, t_torch = ctx.time_us(calls(ember.ops.rmsnorm)), ctx.time_us(calls(torch_rmsnorm))
    except Exception:  # autograd that cannot be captured on this stack: eager events instead
        timer = "eager cuda events"
        t_ember = _timing.event_time_us(calls(ember.ops.rmsnorm))
        t_torch = _timing.event_time_us(calls(torch_rmsnorm))
    nbytes = 5 * M * H * 2  # fwd: read x, write y; bwd: read x and dy, write dx (w and partials: noise)
    gbps_e, gbps_t = nbytes / t_ember / 1e3, nbytes / t_torch / 1e3
    bw = _timing.copy_bandwidth_gbs(ctx.device)
    return Row(f"rmsnorm_fwd_bwd_{M}x{H}_bf16", "GB/s", gbps_e, gbps_t, "torch float32 RMSNorm (HF Qwen3RMSNorm) under autograd",
               target=">= 80% of the copy bandwidth measured in the run", meets=(gbps_e >= 0.8 * bw) if ctx.on_gpu else None,
               extra={"bytes": nbytes, "ember_us": t_ember, "baseline_us": t_torch, "copy_bw_gbs": bw,
                      "fraction_of_copy_bw": gbps_e / bw, "timer": timer})


def run(ctx: BenchContext) -> list[Row]:
    rows = [_loss_row(ctx), _norm_row(ctx)]
    try:
        from ember.bench import _train_model
    except ImportError:
        _train_model = None
    if _train_model is not None:
        rows += _train_model.rows(ctx)
    return rows
