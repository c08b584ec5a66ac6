"""``ember bench fp8``: FP8 linear layers (decode GEMV, batch-16, large GEMM) against torch.

Floors on the H200 (4.15 TB/s copy bandwidth, ~790 TFLOP/s dense bf16, fp8 tensor cores ~2x that):
* M=1 weight-only decode reads each weight byte once: 8192x8192 fp8 = 67.1 MB -> 16.2 us (bf16:
  134 MB -> 32.3 us); 4096x4096 16.8 MB -> 4.0 us; 1536x2048 3.1 MB -> 0.76 us; 2048x768 1.6 MB ->
  0.38 us (these two are launch-latency bound, ~2-3 us per kernel in a graph).
* M=16 8192x8192: still the 67 MB weight read, 16.2 us (2.1 GFLOP is nothing).
* M=4096 8192x8192 fp8 GEMM: 550 GFLOP -> ~0.35 ms at ~1580 TFLOP/s fp8 dense.
Stock figures measured before (GUIDE section 6): bf16 F.linear M=1 8192^2 55.8 us (events, launch
included); torch._scaled_mm rowwise M=16 69.3 us; naive dequantise + linear 434.6 us.

Every row times torch in the same run: bf16 F.linear (the baseline of the linear rows), and as extra
fields torch._scaled_mm rowwise (activations quantised per row) and naive dequantise-then-linear.
"""
from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from torch import nn

import ember
from ember.bench import BenchContext, Row, _timing

COPY_BW_GBPS = 4155.0
E4M3 = torch.float8_e4m3fn


def _linear_with(w):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


def _sets(nbytes, ctx):
    return _timing.copies_to_exceed_l2(nbytes) if ctx.on_gpu else 1


def _time_linear(ctx: BenchContext, M, N, K, granularity="row"):
    """(ember Fp8Linear us by activation mode (None: weight-only, "dynamic": fp8 per row), bf16 F.linear
    us, torch._scaled_mm rowwise us, naive dequant+linear us). The two modes share the weights."""
    dev = ctx.device
    n_fp8 = _sets(N * K, ctx)
    layers = [ember.nn.Fp8Linear.from_linear(_linear_with(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02),
                                             granularity=granularity) for _ in range(n_fp8)]
    xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(n_fp8)]
    t_ember = {}
    for mode in (None, "dynamic"):
        for f in layers:
            f.activations = mode
        t_ember[mode] = ctx.time_us([lambda f=f, x=x: f(x) for f, x in zip(layers, xs)])
    for f in layers:
        f.activations = None
    n_bf16 = _sets(2 * N * K, ctx)
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(n_bf16)]
    t_bf16 = ctx.time_us([lambda w=w, x=x: F.linear(x, w) for w, x in zip(ws, xs)])
    del ws
    t_naive = ctx.time_us([lambda f=f, x=x: F.linear(x, ember.ops.dequantize_fp8(f.weight, f.weight_scale))
                           for f, x in zip(layers, xs)])
    t_torch_mm = None
    if ctx.on_gpu and granularity == "row" and K % 16 == 0 and N % 16 == 0:
        qxs = [ember.ops.quantize_fp8(x, "row") for x in xs]
        try:
            t_torch_mm = ctx.time_us([lambda f=f, q=q: torch._scaled_mm(q[0], f.weight.t(), scale_a=q[1],
                                                                        scale_b=f.weight_scale.t(),
                                                                        out_dtype=torch.bfloat16)
                                      for f, q in zip(layers, qxs)])
        except RuntimeError as e:  # torch versions without rowwise support for this shape
            ctx.progress(f"torch._scaled_mm unavailable: {e}")
    return t_ember, t_bf16, t_torch_mm, t_naive


MODE_NAMES = {None: "Fp8Linear row scales, weight-only (bf16 activations)",
              "dynamic": "Fp8Linear row scales, activations='dynamic' (fp8 per row, W8A8; its result differs from "
                         "weight-only by the activations' e4m3 rounding, ~2.6% relative at K=8192)"}


def run(ctx: BenchContext) -> list[Row]:
    rows = []
    shapes = ([(1, 8192, 8192, 1.8), (1, 4096, 4096, 1.5), (1, 1536, 2048, 1.3), (1, 2048, 768, 1.3),
               (16, 8192, 8192, 1.5)] if not ctx.quick else [(1, 512, 512, 1.0), (16, 512, 512, 1.0)])
    for M, N, K, target in shapes:
        ctx.progress(f"linear M={M} N={N} K={K}")
        t_modes, t_b, t_mm, t_naive = _time_linear(ctx, M, N, K)
        # the row's mode is fixed by M, not picked by speed: one decode row keeps bf16 activations (the
        # GEMV reads each weight byte once either way); a batch of rows quantises them per row (W8A8,
        # what torch._scaled_mm rowwise computes), so fp8 operands go to the MMA without an upcast
        mode = None if M == 1 else "dynamic"
        t_e = t_modes[mode]
        floor = N * K / COPY_BW_GBPS / 1e3
        rows.append(Row(f"linear_fp8_M{M}_N{N}_K{K}", "us", t_e, t_b, f"bf16 F.linear (M={M})",
                        target=f">= {target}x bf16 F.linear", meets=t_b / t_e >= target,
                        extra={"mode": MODE_NAMES[mode], "weight_only_us": t_modes[None],
                               "dynamic_activations_us": t_modes["dynamic"],
                               "torch_scaled_mm_rowwise_us": t_mm, "naive_dequant_linear_us": t_naive,
                               "floor_us": floor, "fraction_of_floor": floor / t_e,
                               "achieved_GBps": N * K / t_e / 1e3}))
    if not ctx.quick:
        ctx.progress("linear block M=1")
        t_modes, t_b, _, t_naive = _time_linear(ctx, 1, 8192, 8192, granularity="block")
        t_e = t_modes[None]
        floor = 8192 * 8192 / COPY_BW_GBPS / 1e3
        rows.append(Row("linear_fp8_block_M1_N8192_K8192", "us", t_e, t_b, "bf16 F.linear (M=1)",
                        target="informational: 128x128 block scales (HF FP8 checkpoints)", meets=None,
                        extra={"naive_dequant_linear_us": t_naive, "floor_us": floor, "fraction_of_floor": floor / t_e}))
    rows.append(_gemm_row(ctx))
    rows.append(_bytes_row())
    return rows


def _gemm_row(ctx: BenchContext) -> Row:
    M, N, K = (4096, 8192, 8192) if not ctx.quick else (256, 512, 512)
    ctx.progress(f"scaled_mm rowwise M={M}")
    dev = ctx.device
    a, sa = ember.ops.quantize_fp8(torch.randn(M, K, device=dev), "row")
    qw, sw = ember.ops.quantize_fp8(torch.randn(N, K, device=dev), "row")
    b, sb = qw.t(), sw.t()
    t_e = ctx.time_us([lambda: ember.ops.scaled_mm(a, b, sa, sb, check=False)])
    t_t = ctx.time_us([lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)]) \
        if ctx.on_gpu else None
    flops = 2 * M * N * K
    return Row(f"scaled_mm_rowwise_M{M}_N{N}_K{K}", "us", t_e, t_t, "torch._scaled_mm rowwise (cuBLAS/CUTLASS)",
               target=">= 1.0x torch._scaled_mm", meets=None if t_t is None else t_t / t_e >= 1.0,
               extra={"ember_TFLOPs": flops / t_e / 1e6, "torch_TFLOPs": None if t_t is None else flops / t_t / 1e6})


# ----------------------------------------------------------------------------- weight bytes
QWEN3_30B_A3B = dict(hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128,
                     moe_intermediate=768, vocab=151936)


class _Layer(nn.Module):
    """One Qwen3-MoE decoder layer's weights (experts as nn.Linear; the router `mlp.gate`)."""

    def __init__(self, c):
        super().__init__()
        h, d = c["hidden"], c["head_dim"]
        self.self_attn = nn.ModuleDict(dict(q_proj=nn.Linear(h, c["heads"] * d, bias=False),
                                            k_proj=nn.Linear(h, c["kv_heads"] * d, bias=False),
                                            v_proj=nn.Linear(h, c["kv_heads"] * d, bias=False),
                                            o_proj=nn.Linear(c["heads"] * d, h, bias=False),
                                            q_norm=nn.RMSNorm(d), k_norm=nn.RMSNorm(d)))
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(h, c["experts"], bias=False)
        self.mlp.experts = nn.ModuleList(
            nn.ModuleDict(dict(gate_proj=nn.Linear(h, c["moe_intermediate"], bias=False),
                               up_proj=nn.Linear(h, c["moe_intermediate"], bias=False),
                               down_proj=nn.Linear(c["moe_intermediate"], h, bias=False)))
            for _ in range(c["experts"]))
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(h), nn.RMSNorm(h)


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def _bytes_row() -> Row:
    """Qwen3-30B-A3B-shaped weights on the meta device: bf16 vs quantize_(Fp8Config(granularity="row")).

    The 48 decoder layers are identical, so one layer is measured and multiplied; embedding, final
    norm and lm_head are added once (kept in bf16 by the default filter, as is the router).
    """
    c = QWEN3_30B_A3B
    with torch.device("meta"):
        layer = _Layer(c).to(torch.bfloat16)
        embed = nn.Embedding(c["vocab"], c["hidden"], dtype=torch.bfloat16)
        head = nn.Linear(c["hidden"], c["vocab"], bias=False, dtype=torch.bfloat16)
    fixed = _nbytes(embed) + _nbytes(head) + 2 * c["hidden"]
    before = fixed + c["layers"] * _nbytes(layer)
    ember.quantize_(layer, ember.Fp8Config(granularity="row"))
    after = fixed + c["layers"] * _nbytes(layer)
    ratio = after / before
    return Row("quantized_model_weight_bytes_ratio", "ratio", ratio, None, "bf16 weights of the same model",
               target="<= 0.52 of bf16", meets=ratio <= 0.52,
               extra={"model": "Qwen3-30B-A3B shape (48 layers, 128 experts), meta device",
                      "bf16_GB": before / 1e9, "fp8_GB": after / 1e9})


# ----------------------------------------------------------------------------- tuning sweep
def sweep(path: str | None = None, budget_s: float = 110.0) -> dict:
    """Time kernel tile configs on the bench shapes (run on the GPU; prints and returns the table)."""
    from ember import _dispatch
    k = _dispatch.kernels("fp8")
    dev = torch.device("cuda")
    t0 = time.time()
    results = {}
    cases = []
    for (M, N, K) in [(1, 8192, 8192), (16, 8192, 8192), (1, 4096, 4096), (1, 1536, 2048), (1, 2048, 768)]:
        cfgs = []
        for bn in (32, 64, 128):
            for bk in (256, 512, 128):
                for sk in (1, 2, 4, 8):
                    for w in (4, 8):
                        cfgs.append((1 if M == 1 else 16, bn, bk, sk, w, 3))
        if M == 1:
            # the one-launch GEMV kernel first (the default at M == 1): ("gemv", BLOCK_N, CHUNKS, KW, warps)
            cfgs = [("gemv", bn * w // 4, c, 512, w) for w in (4, 8) for bn in (4, 8) for c in (1, 2, 4, 8)] + cfgs
            cfgs += [(16, bn, bk, sk, 4, 3) for bn in (64, 128) for bk in (128, 256) for sk in (2, 4)]
        cases.append(("row", M, N, K, cfgs))
    cases.append(("block", 1, 8192, 8192, [("gemv", bn, c, 128, w) for bn in (16, 32) for c in (2, 4, 8)
                                             for w in (4, 8)]
                  + [(1, bn, 128, sk, w, 3) for bn in (32, 64, 128) for sk in (1, 2, 4, 8) for w in (4, 8)]))
    cases.append(("gemm", 4096, 8192, 8192, [(128, 256, 128, 1, 8, 3), (128, 256, 128, 1, 8, 4),
                                             (128, 128, 128, 1, 8, 4), (128, 128, 128, 1, 4, 4),
                                             (256, 128, 128, 1, 8, 3), (64, 256, 128, 1, 4, 4)]))
    for kind, M, N, K, cfgs in cases:
        gran = "block" if kind == "block" else "row"
        sets = _timing.copies_to_exceed_l2(N * K)
        qs = [ember.ops.quantize_fp8(torch.randn(N, K, device=dev) * 0.02, gran) for _ in range(sets)]
        if kind == "gemm":
            xs = [ember.ops.quantize_fp8(torch.randn(M, K, device=dev), "row") for _ in range(sets)]
        else:
            xs = [(torch.randn(M, K, device=dev, dtype=torch.bfloat16), None) for _ in range(sets)]
        key = f"{kind}_M{M}_N{N}_K{K}"
        table = []
        for cfg in cfgs:
            if time.time() - t0 > budget_s:
                break
            if cfg[0] == "gemv":
                conf = dict(kernel="gemv", BLOCK_N=cfg[1], CHUNKS=cfg[2], KW=cfg[3], num_warps=cfg[4])
            else:
                bm, bn, bk, sk, w, st = cfg
                conf = dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w,
                            num_stages=st, GROUP_M=8)
            calls = [lambda q=q, x=x, conf=conf: k.scaled_mm(x[0], q[0].t(), x[1], None if x[1] is None else "row",
                                                             q[1].t(), gran, None, torch.bfloat16, config=conf)
                     for q, x in zip(qs, xs)]
            try:
                table.append((_timing.graph_time_us(calls, replays=10), cfg))
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                table.append((float("inf"), cfg + (type(e).__name__,)))
        table.sort(key=lambda r: r[0])
        results[key] = table[:8]
        print(key, "floor_us", round(N * K / COPY_BW_GBPS / 1e3, 2), "best", table[:4], flush=True)
        del qs, xs
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    return results
