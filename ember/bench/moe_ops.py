"""``ember bench moe_ops``: the fused MoE ops at Qwen3-30B-A3B shapes (E=128, top-8, H=2048, I=768), one layer.

Floors (H200, 4.15 TB/s copy bandwidth, 790 TFLOP/s bf16); an expert is 3 x 2048 x 768 weights:
* decode T=1 bf16: 8 experts x 9.44 MB = 75.5 MB -> 18.2 us (FLOPs negligible). The whole 48-layer
  model at this floor is ~0.87 ms/token of expert reads; the engine's 400 tok/s needs well under ~30 us.
* decode T=1 fp8: 37.7 MB -> 9.1 us.
* decode T=16 bf16: the distinct experts the 128 (token, expert) pairs pick (~81 of 128 for random
  routing, counted per run) x 9.44 MB -> ~185 us.
* prefill T=512 bf16: ~all 128 experts, 1.21 GB -> 291 us; 4096 pairs x 2 x 3 x 2048 x 768 = 38.7 GFLOP
  -> 49 us, so this size is still bandwidth-bound.

Timing: CUDA-graph replays (``ctx.time_us``) rotating over 8 layers' worth of weights so L2 (60 MB)
never holds the experts of the next call. Baseline: the plain-PyTorch decode MoE of
``shared/reference/probe_torch_moe_decode.py`` (softmax, top-k, renormalise, gather the chosen
experts' weights, two einsums), captured in a graph too; for fp8 the same loop dequantises the
gathered experts first. For prefill the baseline is the eager per-expert loop (transformers-style:
find the tokens of each expert, two linears), which syncs and so is timed eagerly with CUDA events.

T=1 kernel variants: the default rows run the kernels the tuning data picks (entry "t1": v1 for
bf16, v2 for fp8 on the H200; analysis and figures at ``ember.kernels.moe.gemv_v2.v2_tiles``); the
``_v1`` rows time the v1 kernels in the same run (``ember.tuning.override``), with
``default_speedup`` = v1 time / default time. ``sweep()`` times v1 and several v2 configs at T=1
(bf16 and fp8 with 128x128 block and row scales), and grouped-GEMM tile configs for a 2048-token
prefill; the winners are the H200's entries in ember/tuning/data/sm_90-nvidia-h200/moe.json.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import time

import torch
import torch.nn.functional as F

from ember import tuning
from ember.bench import BenchContext, Row, _timing

COPY_BW_GBPS = 4155.0
E, K, H, I = 128, 8, 2048, 768
LAYERS = 8  # weight sets rotated through: 8 x 1.2 GB, far beyond L2
FP8 = torch.float8_e4m3fn


def _moe_module():
    return importlib.import_module("ember.ops.moe")


def probe_moe(x, logits, w13, w2, top_k, scale13=None, scale2=None):
    """The reference probe's MoE, generalised to T tokens (one gathered expert copy per pair)."""
    T = x.shape[0]
    probs = logits.float().softmax(-1)
    w, idx = probs.topk(top_k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    idx = idx.reshape(-1)
    g13, g2 = w13[idx], w2[idx]
    if scale13 is not None:  # fp8: dequantise the gathered experts (128x128 block scales)
        g13 = (g13.float() * _expand(scale13[idx], g13.shape)).to(x.dtype)
        g2 = (g2.float() * _expand(scale2[idx], g2.shape)).to(x.dtype)
    xr = x.repeat_interleave(top_k, 0)
    gu = torch.einsum("ph,poh->po", xr, g13)
    g, u = gu.split(w2.shape[2], -1)
    y = torch.einsum("pi,phi->ph", F.silu(g) * u, g2)
    return (w.reshape(-1, 1) * y).view(T, top_k, -1).sum(1)


def _expand(scale, shape):
    return scale.repeat_interleave(128, 1)[:, :shape[1]].repeat_interleave(128, 2)[:, :, :shape[2]]


def per_expert_loop(x, logits, w13, w2, top_k):
    """Eager transformers-style loop: for each expert that got tokens, two linears over those tokens."""
    probs = logits.float().softmax(-1)
    w, idx = probs.topk(top_k, -1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        gu = F.linear(x[tok], w13[e])
        g, u = gu.split(w2.shape[2], -1)
        out.index_add_(0, tok, w[tok, slot, None] * F.linear(F.silu(g) * u, w2[e]).float())
    return out.to(x.dtype)


def _layers(n, dtype, device, e, h, i):
    layers = []
    for _ in range(n):
        w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) * h ** -0.5
        w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16) * i ** -0.5
        if dtype == FP8:
            q13, s13 = _quantize_blocks(w13)
            q2, s2 = _quantize_blocks(w2)
            layers.append((q13, q2, s13, s2))
        else:
            layers.append((w13, w2, None, None))
    return layers


def _quantize_blocks(w):
    Ex, N, Kd = w.shape
    nb, kb = -(-N // 128), -(-Kd // 128)
    pad = torch.zeros(Ex, nb * 128, kb * 128, device=w.device)
    pad[:, :N, :Kd] = w.float()
    s = pad.view(Ex, nb, 128, kb, 128).abs().amax((2, 4)).clamp_min(1e-12) / 448.0
    return (w.float() / _expand(s, w.shape)).to(FP8), s


def _kernels():
    return importlib.import_module("ember.kernels.moe")


def t1_kernels(spec: tuple | str | None, device: torch.device | None = None):
    """Run the block with other T=1 kernels (read at launch, so also while a graph is captured):
    None the tuning data's, "v1" or "v2" those kernels for every weight dtype, or
    ``("v2", gate_up_warps, gate_up_rows, down_warps, down_rows)`` the v2 kernels with those tiles."""
    if spec is None:
        return contextlib.nullcontext()
    name, *tile = (spec,) if isinstance(spec, str) else spec
    entries = {"t1": {"GEMV": name, "GEMV_FP8": name}}
    if tile:
        k = _kernels()
        gw, gr, dw, dr = tile
        entries["gemv_v2_gate_up"] = {**k.tiles("gemv_v2_gate_up", device), "num_warps": gw, "ROWS": gr, "ROWS_FP8": gr}
        entries["gemv_v2_down"] = {**k.tiles("gemv_v2_down", device), "num_warps": dw, "ROWS": dr, "ROWS_FP8": dr}
    return tuning.override("moe", entries)


def _distinct_experts(logits_list, top_k):
    return [int(torch.unique(lg.float().topk(top_k, -1).indices).numel()) for lg in logits_list]


def run(ctx: BenchContext) -> list[Row]:
    moe = _moe_module().moe
    if ctx.quick:
        e, k, h, i, layers = 16, 4, 256, 128, 2
        cases = [("T1_bf16", 1, torch.bfloat16), ("T1_bf16_v1", 1, torch.bfloat16), ("T32_bf16", 32, torch.bfloat16)]
    else:
        e, k, h, i, layers = E, K, H, I, LAYERS
        cases = [("T1_bf16", 1, torch.bfloat16), ("T1_bf16_v1", 1, torch.bfloat16), ("T1_fp8", 1, FP8),
                 ("T1_fp8_v1", 1, FP8), ("T16_bf16", 16, torch.bfloat16), ("T512_bf16", 512, torch.bfloat16)]
    expert_bytes = {torch.bfloat16: 3 * h * i * 2, FP8: 3 * h * i}
    weights = {}
    rows = []
    default_times, inputs, base_times = {}, {}, {}
    for label, T, dtype in cases:
        ctx.progress(f"moe {label}")
        variant = "v1" if label.endswith("_v1") else None
        base_label = label.removesuffix("_v1")
        if dtype not in weights:
            weights = {dtype: _layers(layers, dtype, ctx.device, e, h, i)}  # free the other dtype first
        ws = weights[dtype]
        if base_label not in inputs:  # a _v1 row reuses its default row's inputs (and baseline time)
            inputs[base_label] = ([torch.randn(T, h, device=ctx.device, dtype=torch.bfloat16) for _ in ws],
                                  [torch.randn(T, e, device=ctx.device) for _ in ws])
        xs, logits = inputs[base_label]
        ember_calls = [lambda x=x, lg=lg, w=w: moe(x, lg, w[0], w[1], k, gate_up_scale=w[2], down_scale=w[3])
                       for x, lg, w in zip(xs, logits, ws)]
        with t1_kernels(variant):  # read while the calls are captured into the timing graph
            t_ember = ctx.time_us(ember_calls)
        if variant is None:
            default_times[label] = t_ember
        distinct = sum(_distinct_experts(logits, k)) / len(logits)
        nbytes = distinct * expert_bytes[dtype]
        floor_us = nbytes / COPY_BW_GBPS / 1e3
        gbps = nbytes / t_ember / 1e3
        prefill = T > 16
        if prefill:
            base_calls = [lambda x=x, lg=lg, w=w: per_expert_loop(x, lg, w[0], w[1], k) for x, lg, w in zip(xs, logits, ws)]
            t_base = _timing.event_time_us(base_calls, iters=20, warmup=3) if ctx.on_gpu else ctx.time_us(base_calls)
            base_name = "eager per-expert loop (transformers-style, bf16 linears)"
            name = f"moe_prefill_qwen3_30b_{label}" if not ctx.quick else f"moe_prefill_quick_{label}"
        else:
            base_calls = [lambda x=x, lg=lg, w=w: probe_moe(x, lg, w[0], w[1], k, w[2], w[3]) for x, lg, w in zip(xs, logits, ws)]
            if base_label not in base_times:
                base_times[base_label] = ctx.time_us(base_calls)
            t_base = base_times[base_label]
            base_name = "plain-PyTorch probe MoE (gathered experts + einsum), CUDA graph"
            name = f"moe_decode_qwen3_30b_{label}" if not ctx.quick else f"moe_decode_quick_{label}"
        frac = gbps / COPY_BW_GBPS
        if base_label == "T1_bf16":
            target, meets = "<= 30 us per layer (engine's 400 tok/s) and >= 2x probe", t_ember <= 30 and t_base / t_ember >= 2
        elif base_label == "T1_fp8":
            target, meets = "<= 20 us per layer (engine's fp8 600 tok/s)", t_ember <= 20
        else:
            target, meets = ">= 50% of 4155 GB/s and >= 2x baseline", frac >= 0.5 and t_base / t_ember >= 2
        rows.append(Row(name, "us", t_ember, t_base, base_name, target=target, meets=meets if ctx.on_gpu else None,
                        extra={"achieved_gbps": gbps, "fraction_of_copy_bw": frac, "floor_us": floor_us,
                               "mb_read": nbytes / 1e6, "distinct_experts": distinct, "tokens": T,
                               **({"t1_kernels": variant, "default_speedup": t_ember / default_times[base_label]}
                                  if variant else {})}))
    return rows


# T=1 configs for sweep(): (t1_kernels spec, label); v2 tiles are gate_up warps, rows, down warps, rows
SWEEP_T1 = [("v1", "v1"), ("v2", "v2 tuned config")] + [
    (("v2", gw, gr, dw, dr), f"v2 gu {gw}w x{gr} dn {dw}w x{dr}")
    for gw, gr, dw, dr in [(2, 1, 2, 1), (4, 2, 4, 1), (8, 1, 4, 1), (4, 1, 2, 1), (4, 1, 8, 1), (2, 1, 4, 2),
                           (8, 1, 8, 1), (4, 2, 4, 2)]]


def sweep(path: str | None = None, budget_s: float = 120.0, parts: tuple[str, ...] = ("t1", "prefill")) -> dict:
    """Time the T=1 kernel variants/configs at Qwen3-30B-A3B shapes (on the GPU; prints and returns the table).

    One H200 run: ``python -c "from ember.bench.moe_ops import sweep; sweep('$OUT/moe_t1_sweep.json')"``.
    """
    moe = _moe_module().moe
    dev = torch.device("cuda")
    t0 = time.time()
    results = {}
    t1_cases = (("bf16", torch.bfloat16, None), ("fp8_block", FP8, "block"), ("fp8_row", FP8, "row"))
    for wlabel, dtype, scale in t1_cases if "t1" in parts else ():
        ws = _layers(LAYERS, dtype, dev, E, H, I)
        if scale == "row":  # per-row decode scales instead of 128x128 blocks (same fp8 bits, coarser scale)
            ws = [(q13, q2, s13.amax(2).repeat_interleave(128, 1)[:, :2 * I].contiguous(),
                   s2.amax(2).repeat_interleave(128, 1)[:, :H].contiguous()) for q13, q2, s13, s2 in ws]
        xs = [torch.randn(1, H, device=dev, dtype=torch.bfloat16) for _ in ws]
        logits = [torch.randn(1, E, device=dev) for _ in ws]
        calls = [lambda x=x, lg=lg, w=w: moe(x, lg, w[0], w[1], K, gate_up_scale=w[2], down_scale=w[3])
                 for x, lg, w in zip(xs, logits, ws)]
        with t1_kernels("v1"):
            expected = calls[0]().float()
        table = []
        for spec, name in SWEEP_T1:
            if time.time() - t0 > budget_s:
                break
            try:
                with t1_kernels(spec, dev):
                    # same op, other kernels: only summation order (and so an odd bf16 rounding) differs
                    diff = (calls[0]().float() - expected).abs().max().item()
                    table.append((_timing.graph_time_us(calls, replays=25), str(spec),
                                  f"{name}; max|out - v1| {diff:.3g}"))
            except Exception as exc:  # a config that fails to compile is reported, not fatal
                table.append((float("inf"), str(spec), f"{name}: {type(exc).__name__}: {exc}"[:200]))
        floor = 8 * 3 * H * I * (2 if dtype == torch.bfloat16 else 1) / COPY_BW_GBPS / 1e3
        table.sort(key=lambda r: r[0])
        results[f"T1_{wlabel}"] = {"floor_us": floor, "table": table}
        print(f"T1_{wlabel} floor_us {floor:.1f}", *[f"{t:.1f} us  {spec}  {note}" for t, spec, note in table],
              sep="\n  ", flush=True)
        del ws, calls
    try:
        if "prefill" in parts:
            results["T2048_bf16_prefill"] = _sweep_prefill(moe, dev, budget_s)
    except Exception as exc:  # the T=1 tables above are still written
        results["T2048_bf16_prefill"] = f"{type(exc).__name__}: {exc}"[:300]
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results


# Prefill tile sweep for sweep(): per row-block cap, gate_up tiles (down at the default), then down
# tiles (gate_up at the default), then the best of each together. Tiles: BLOCK_N, BLOCK_K, warps,
# stages (ember.kernels.moe.prefill_configs); shared memory per stage is (BLOCK_M x BLOCK_K + 2 (gate_up)
# or 1 (down) x BLOCK_K x BLOCK_N) x 2 bytes of the 227 KB, the fp32 accumulators 2 or 1 x BLOCK_M x
# BLOCK_N over the threads' registers.
SWEEP_PREFILL = {
    128: {"gate_up": [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 8, 4), (128, 32, 8, 6)],
          "down": [(128, 64, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3), (256, 128, 8, 2), (64, 64, 4, 4)]},
    64: {"gate_up": [(128, 64, 4, 4), (128, 64, 4, 5), (64, 64, 4, 4), (128, 128, 4, 2), (64, 128, 4, 3)],
         "down": [(128, 64, 4, 4), (256, 64, 8, 4), (256, 64, 4, 4), (128, 128, 4, 3), (256, 128, 8, 2)]},
}
TILE_FIELDS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def _tile(fields: tuple) -> dict:
    return dict(zip(TILE_FIELDS, fields))


def prefill_override(device: torch.device, **parts):
    """Run the block with other prefill tiles for ``device``'s prefill entry: ``gate_up`` / ``down``
    (dicts of TILE_FIELDS) and ``max_block_m``, the rest as the tuning data has them."""
    k = _kernels()
    key = "prefill:large_smem" if device.type == "cuda" and k.config.large_smem(device) else "prefill"
    return tuning.override("moe", {key: {**k.tiles(key, device), **parts}})


def _sweep_prefill(moe, dev, budget_s: float, T: int = 2048) -> dict:
    """Time grouped-GEMM tiles for a T-token bf16 prefill (one ``prefill_override`` per variant).

    Floors per layer: all 128 experts' weights, 1.21 GB at 4.15 TB/s -> 291 us, and
    2 x T x 8 x 3 x 2048 x 768 = 155 GFLOP at 790 TFLOP/s -> 196 us."""
    ws = _layers(2, torch.bfloat16, dev, E, H, I)
    xs = [torch.randn(T, H, device=dev, dtype=torch.bfloat16) for _ in ws]
    logits = [torch.randn(T, E, device=dev) for _ in ws]
    calls = [lambda x=x, lg=lg, w=w: moe(x, lg, w[0], w[1], K) for x, lg, w in zip(xs, logits, ws)]
    default = _kernels().prefill_configs(dev)
    expected = calls[0]().float()
    flops = 2 * T * K * 3 * H * I
    table, t0 = [], time.time()

    def timed(parts: dict) -> float:
        label = ";".join(f"{k}={v}" for k, v in parts.items())
        with prefill_override(dev, **parts):
            try:
                diff = (calls[0]().float() - expected).abs().max().item()
                us = _timing.graph_time_us(calls, replays=10)
                table.append((us, label, f"{flops / us / 1e6:.0f} TFLOP/s; max|out - default| {diff:.3g}"))
            except Exception as exc:  # a tile that does not fit is reported, not fatal
                us = float("inf")
                table.append((us, label, f"{type(exc).__name__}: {exc}"[:200]))
        print(f"  {us:.1f} us  {label}", flush=True)
        return us

    for block_m, kernels in SWEEP_PREFILL.items():
        best = {}
        for kernel, other in (("gate_up", "down"), ("down", "gate_up")):
            results = [(timed({kernel: _tile(tile), other: default[other], "max_block_m": block_m}), tile)
                       for tile in kernels[kernel] if time.time() - t0 < budget_s]
            best[kernel] = min(results)[1] if results else None
        if best["gate_up"] and best["down"]:
            timed({"gate_up": _tile(best["gate_up"]), "down": _tile(best["down"]), "max_block_m": block_m})
    table.sort(key=lambda r: r[0])
    print(f"T{T}_bf16_prefill (default {default})", *[f"{t:.1f} us  {c}  {n}" for t, c, n in table[:8]],
          sep="\n  ", flush=True)
    return {"floor_us_weights": E * 3 * H * I * 2 / COPY_BW_GBPS / 1e3, "floor_us_compute": flops / 790e12 * 1e6,
            "default": default, "table": table}
