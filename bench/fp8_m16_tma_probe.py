"""Probe: a TMA-fed few-row fp8 weight-only matmul (M=16, 8192x8192, row scales) against ember's
Fp8Linear (the swapped-operand ``_skinny_mm_kernel``) and bf16 F.linear, graph-timed.

    python bench/fp8_m16_tma_probe.py OUT_JSON

Measured (H200, bench/results/h200/fp8_m16_tma_probe.json): best TMA config 28.9 us vs Fp8Linear 28.0
and bf16 F.linear 34.5 (the issue's 1.5x needs <= 23 us). Feeding the weight through TMA changes
nothing: the limit is the fp8 -> bf16 upcast of each weight tile in registers before the bf16 MMA,
not the loads.
"""
import itertools
import json
import sys

import torch
import triton
import triton.language as tl
import torch.nn.functional as F
from triton.tools.tensor_descriptor import TensorDescriptor

import ember
from ember.bench import _timing
from ember.kernels._common import pdl_start


@triton.jit
def tma_skinny_kernel(w_desc, x_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                      SPLIT: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BN
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    offs_n = n0 + tl.arange(0, BN)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    pdl_start(PDL)
    k_start = pid_k * k_per_split
    for k0 in tl.range(k_start, k_start + k_per_split, BK, num_stages=STAGES):
        w = w_desc.load([n0, k0]).to(tl.bfloat16)
        x = tl.load(x_ptr + offs_m[None, :] * K + (k0 + offs_k)[:, None], mask=offs_m[None, :] < M, other=0.0)
        acc = tl.dot(w, x, acc)
    acc = acc * tl.load(s_ptr + offs_n)[:, None]
    ptrs = out_ptr + offs_m[None, :] * N + offs_n[:, None]
    mask = offs_m[None, :] < M
    if SPLIT == 1:
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, acc, mask=mask, sem="relaxed")


def run(x, desc, s, out, M, N, K, BN, BK, STAGES, SPLIT, warps):
    if SPLIT > 1:
        out.zero_()
    tma_skinny_kernel[(N // BN, SPLIT)](desc, x, s, out, M, N, K, K // SPLIT, BM=16, BN=BN, BK=BK, STAGES=STAGES,
                                         SPLIT=SPLIT, PDL=True, num_warps=warps, launch_pdl=True)
    return out


def main(path):
    dev = torch.device("cuda")
    res = {}
    M, N, K = 16, 8192, 8192
    nsets = _timing.copies_to_exceed_l2(N * K, 8)
    lins = [ember.nn.Fp8Linear.from_linear(torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16))
            for _ in range(nsets)]
    xs = [torch.randn(M, K, device=dev, dtype=torch.bfloat16) for _ in range(nsets)]
    res["ember_fp8linear"] = _timing.graph_time_us([lambda i=i: lins[i](xs[i]) for i in range(nsets)], calls_per_graph=48)
    wb = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(_timing.copies_to_exceed_l2(2 * N * K, 4))]
    res["bf16_F.linear"] = _timing.graph_time_us([lambda i=i: F.linear(xs[i], wb[i]) for i in range(len(wb))], calls_per_graph=48)
    del wb
    qs = [l.weight for l in lins]
    ss = [l.weight_scale.reshape(-1).float().contiguous() for l in lins]
    print({k: round(v, 2) for k, v in res.items()}, qs[0].dtype, tuple(qs[0].shape), ss[0].shape, flush=True)
    ref = lins[0](xs[0]).float()
    best = None
    for BN, BK, STAGES, SPLIT, warps in itertools.product((64, 128), (128, 256), (3, 4, 6), (1, 2), (4, 8)):
        if BN * BK * STAGES > 200 * 1024:
            continue
        key = f"tma_{BN}_{BK}_{STAGES}_{SPLIT}_{warps}"
        try:
            descs = [TensorDescriptor.from_tensor(q, [BN, BK]) for q in qs]
            outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16 if SPLIT == 1 else torch.float32) for _ in range(nsets)]
            got = run(xs[0], descs[0], ss[0], outs[0], M, N, K, BN, BK, STAGES, SPLIT, warps).float()
            err = ((got - ref).norm() / ref.norm()).item()
            us = _timing.graph_time_us([lambda i=i: run(xs[i], descs[i], ss[i], outs[i], M, N, K, BN, BK, STAGES, SPLIT, warps)
                                        for i in range(nsets)], calls_per_graph=48)
            res[key] = (round(us, 3), err)
            if err < 2e-2 and (best is None or us < best[1]):
                best = (key, us, err)
        except Exception as e:
            res[key] = repr(e)[:160]
    res["best"] = best
    print("best", best, flush=True)
    print({k: v for k, v in res.items() if k.startswith("tma")}, flush=True)
    json.dump(res, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
