"""A/B of decode-step kernels on the Qwen3-30B-A3B shape (48 layers, random weights): bf16 GEMV
tiles for the attention projections (swept first, F.linear in the same run), then the CUDA-graph
decode step time of each variant on the same weights and prompt. (The run recorded in
bench/results/h200/step_variants.json made the tuned tiles the default: "default" and
"gemv_tuned_oproj" now time the same kernels.)

    python bench/step_variants.py OUT_JSON
"""
import json
import os
import sys

import torch

from ember import _dispatch
from ember.bench import env_vars, moe as moe_bench
from ember.bench.linear import sweep
# H200 sweep (this script, first run): o_proj 2048x4096 best (8, 4, 256, 4) 7.17 us (F.linear 9.7,
# default rule (8, 1, 256, 4) slower than F.linear); qkv 5120x2048 best (16, 2, 256, 8) 7.12 us
MEASURED_BEST = {(2048, 4096): (8, 4, 256, 4), (5120, 2048): (16, 2, 256, 8)}


def main(path: str, resweep: bool = True) -> None:
    gemv = _dispatch.kernels("gemv")
    tables = sweep(None, budget_s=60, shapes=[(2048, 4096), (5120, 2048)]) if resweep else {}
    best = {nk: dict(GEMV=True, BLOCK_N=c[0], CHUNKS=c[1], KW=c[2], num_warps=c[3]) for nk, c in MEASURED_BEST.items()}
    for key, table in tables.items():
        n, k = (int(v[1:]) for v in key.split("_")[2:4])
        cfgs = [c for t, c in table if c != "F.linear" and len(c) == 4]
        if cfgs:
            best[(n, k)] = dict(GEMV=True, BLOCK_N=cfgs[0][0], CHUNKS=cfgs[0][1], KW=cfgs[0][2], num_warps=cfgs[0][3])
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    em = moe_bench.ember_from_hf(hf, cfg, max_seq_len=400)
    ids = torch.randint(100, 1000, (1, 128))
    default_config = gemv.gemv_config
    default_limit = gemv.MAX_ROW_BYTES_UNSWEPT

    def tuned(N, K, elsize, k_blocked=False):
        return dict(best[(N, K)]) if (N, K) in best and elsize == 2 and not k_blocked else default_config(N, K, elsize, k_blocked)

    variants = {"default": ({}, False), "attn_one_launch": ({"EMBER_ATTN_ONE_LAUNCH": "1"}, False),
                "gemv_tuned_oproj": ({}, True), "both": ({"EMBER_ATTN_ONE_LAUNCH": "1"}, True)}
    only = os.environ.get("STEP_VARIANTS")  # e.g. "default": time only these (comma-separated)
    if only:
        variants = {k: v for k, v in variants.items() if k in only.split(",")}
    steps = {}
    for name, (env, tune) in variants.items():
        gemv.gemv_config = tuned if tune else default_config
        gemv.MAX_ROW_BYTES_UNSWEPT = 8192 if tune else default_limit
        try:
            with env_vars(env):
                m = moe_bench.ember_from_hf(hf, cfg, max_seq_len=400, net=em.net)
                moe_bench.ember_decode(m, [ids[0].tolist()], 32)
                steps[name] = [moe_bench.graph_step_ms(m, 1) for _ in range(3)]
        except Exception as e:
            steps[name] = repr(e)[:300]
        finally:
            gemv.gemv_config, gemv.MAX_ROW_BYTES_UNSWEPT = default_config, default_limit
        print(name, steps[name], flush=True)
    with open(path, "w") as f:
        json.dump({"gemv_sweep": tables, "best": {f"{n}x{k}": c for (n, k), c in best.items()},
                   "graph_step_ms": steps}, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], resweep="--no-sweep" not in sys.argv)
