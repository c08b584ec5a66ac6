"""How fast one program can sum a chunk's mass and count above NB pivots (the nucleus search's
per-round partials), by formulation (H200, graph-timed, 126 programs x 1024 elements, 4 warps):
  2d     one [CHUNK, NB] where + two sums over axis 0 (the kernel's ``_pivot_partials``)
  loop   NB one-dimensional sums of mass and of count (static loop over the pivots)
  tuple  NB one-dimensional reductions of (mass, count) pairs in one tl.reduce each
Also the registers / spills of the one-launch sampler per NB. Standalone the loop forms use fewer
registers but are slower; inside the sampler (255 registers) the 2d form at NB = 8 was fastest too. Outputs are checked against torch.

    python bench/pivot_partials_probe.py [out.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ember.bench import _timing
from ember.kernels import sampling as ks

V, CHUNK = 128256, 1024


@triton.jit
def _add_pair(a_m, a_n, b_m, b_n):
    return a_m + b_m, a_n + b_n


@triton.jit
def _partials_kernel(x_ptr, q_ptr, g_ptr, n_ptr, V, NB: tl.constexpr, CHUNK: tl.constexpr, MODE: tl.constexpr):
    c = tl.program_id(0)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    z = tl.load(x_ptr + cols, mask=cols < V, other=-float("inf"))
    M = tl.load(q_ptr + NB)
    e = tl.where(z > -float("inf"), tl.exp(z - M), 0.0)
    j = tl.arange(0, NB)
    q = tl.load(q_ptr + j)
    if MODE == 0:
        _, g, n = ks._pivot_partials(z, e, tl.load(q_ptr + NB - 2), tl.load(q_ptr), tl.load(q_ptr + NB - 1), NB)
    else:
        g = tl.zeros([NB], tl.float32)
        n = tl.zeros([NB], tl.int32)
        fin = z > -float("inf")
        for jj in tl.static_range(NB):
            qj = tl.load(q_ptr + jj)
            ge = (z >= qj) & fin
            if MODE == 1:
                gj = tl.sum(tl.where(ge, e, 0.0), axis=0)
                nj = tl.sum(ge.to(tl.int32), axis=0)
            else:
                gj, nj = tl.reduce((tl.where(ge, e, 0.0), ge.to(tl.int32)), 0, _add_pair)
            g = tl.where(j == jj, gj, g)
            n = tl.where(j == jj, nj, n)
    tl.store(g_ptr + c * NB + j, g)
    tl.store(n_ptr + c * NB + j, n)


def main(path: str | None = None) -> dict:
    P = triton.cdiv(V, CHUNK)
    xs = [torch.randn(V, device="cuda") * 4 for _ in range(_timing.copies_to_exceed_l2(4 * V))]
    res = {"partials": {}, "sampler": {}}
    for NB in (4, 8, 16):
        x = xs[0]
        M = x.max()
        # the kernel's pivots (``_pivot``): M down to M - 12, the last one repeated; M after them
        q = torch.cat([M - 12 * torch.arange(NB, device="cuda") / (NB - 2), M.view(1)])
        q[NB - 1] = q[NB - 2]
        q = q.contiguous()
        ref_g = torch.stack([(torch.exp(x - M) * (x >= qq)).view(-1)[:V].sum() for qq in q[:NB]])
        for mode, name in ((0, "2d"), (1, "loop"), (2, "tuple")):
            g = torch.empty(P, NB, device="cuda")
            n = torch.empty(P, NB, dtype=torch.int32, device="cuda")
            try:
                h = _partials_kernel[(P,)](x, q, g, n, V, NB=NB, CHUNK=CHUNK, MODE=mode, num_warps=4)
            except Exception as exc:   # reported, not fatal
                res["partials"][f"{name}_nb{NB}"] = repr(exc)[:200]
                continue
            torch.testing.assert_close(g.sum(0), ref_g, rtol=1e-4, atol=1e-4)
            assert torch.equal(n.sum(0).cpu(), torch.stack([(x >= qq).sum() for qq in q[:NB]]).int().cpu())
            us = _timing.graph_time_us([lambda xx=xx: _partials_kernel[(P,)](xx, q, g, n, V, NB=NB, CHUNK=CHUNK,
                                                                             MODE=mode, num_warps=4) for xx in xs])
            res["partials"][f"{name}_nb{NB}"] = {"us": us, "regs": h.n_regs, "spills": h.n_spills}
            print(name, NB, res["partials"][f"{name}_nb{NB}"], flush=True)
    x = xs[0].view(1, V)
    out = torch.empty(1, dtype=torch.int64, device="cuda")
    for NB in (8, 16):
        ks.NUCLEUS_PIVOTS = NB
        ks.sample_one_launch(x, out, 0.7, 0, 0.9, 0.0, 1, 0)
    try:   # every compiled variant of the one-launch sampler: registers and spills
        for dev, caches in ks._sample_one_launch_kernel.device_caches.items():
            for i, ck in enumerate(caches[0].values()):
                res["sampler"][f"{dev}_{i}"] = {"regs": ck.n_regs, "spills": ck.n_spills,
                                                "NB": ck.src.constants.get(("NB",)) if hasattr(ck, "src") else None}
    except Exception as exc:   # the cache layout is Triton-internal
        res["sampler"]["error"] = repr(exc)
    print("sampler", res["sampler"], flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
