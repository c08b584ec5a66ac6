"""Probe: how much of the Qwen3-30B-A3B batch-1 decode step would removing a launch save, at most?

Each variant captures the decode step with one small kernel per layer replaced by nothing (the
result is wrong; only the time counts), on the same weights and prompt as bench/step_variants.py:
  * ``no_qk_norm``: the q/k RMSNorm + RoPE + cache-write launch before decode attention (what folding
    it into the attention kernel could save at most);
  * ``no_pre_norm``: the pre-attention add_rmsnorm launch (what folding it into the previous MoE
    block's down GEMV could save at most);
  * ``no_both``: both;
  * ``no_router``: the post-attention add_rmsnorm + router + routing launch (fixed, distinct experts
    per layer: what folding the routing into the o_proj GEMV could save at most).
A fold saves less than its variant: the folded kernel still does the work. Writes a JSON.

    python bench/launch_removal_probe.py OUT_JSON [--fp8] [--names default,no_router,...]

Measured (H200, cache 400): no_router fp8 1.816 -> 1.606 ms, bf16 2.249 -> 2.018
(bench/results/h200/launch_removal_fp8.json, launch_removal_bf16.json: the first run of this variant,
with the fixed ids made inside the capture, added launches and measured 2.31 ms; not kept).
"""
import argparse
import json

import torch

import ember
from ember.bench import moe as moe_bench
from ember.models import qwen3_moe
from ember.ops import attention as attn_ops

NAMES = ("default", "no_qk_norm", "no_pre_norm", "no_both", "no_router", "default_again")


def main(path: str, fp8: bool = False, names: tuple[str, ...] = NAMES) -> None:
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    em = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=400, table_len=4096)
    ids = torch.randint(100, 1000, (1, 128))
    real_rope, real_norm = attn_ops.qk_norm_rope_cache, ember.ops.add_rmsnorm
    q_buf = {}

    def no_rope(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, *, num_heads, eps=1e-6):
        shape = (qkv.shape[0], num_heads, k_cache.shape[3])
        if shape not in q_buf:
            q_buf[shape] = torch.zeros(shape, dtype=qkv.dtype, device=qkv.device)
        return q_buf[shape]

    def no_norm(x, residual, weight, eps=1e-6):  # bounded stand-in: the residual stream only
        return residual, residual

    real_route = qwen3_moe.moe_ops.add_rmsnorm_route_hidden

    # made before the capture: a stand-in that made them inside it would add launches of its own
    fixed = [(torch.full((1, cfg.num_experts_per_tok), 1.0 / cfg.num_experts_per_tok, device="cuda"),
              torch.randperm(cfg.num_experts, device="cuda")[:cfg.num_experts_per_tok].to(torch.int32)[None])
             for _ in range(cfg.num_hidden_layers)]
    calls = []

    def no_route(x, residual, norm_weight, router, top_k, eps=1e-6, **route):
        """Fixed routing (distinct random experts per layer, equal weights); the residual stream as is."""
        w, ids = fixed[len(calls) % len(fixed)]
        calls.append(1)
        return residual, residual, w, ids

    m = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=400, net=em.net)
    moe_bench.ember_decode(m, [ids[0].tolist()], 8)  # real prefill, cache and graph
    steps = {}
    for name in names:
        # only the capture sees the stand-ins; replays then run the captured kernels
        attn_ops.qk_norm_rope_cache = no_rope if name in ("no_qk_norm", "no_both") else real_rope
        ember.ops.add_rmsnorm = no_norm if name in ("no_pre_norm", "no_both") else real_norm
        qwen3_moe.moe_ops.add_rmsnorm_route_hidden = no_route if name == "no_router" else real_route
        saved = m._greedy
        try:
            m._greedy = True
            with torch.no_grad():
                m._graphs[(1, True)] = m._capture(1)
        except Exception as e:  # recorded, not fatal
            steps[name] = repr(e)[:300]
        finally:
            attn_ops.qk_norm_rope_cache, ember.ops.add_rmsnorm = real_rope, real_norm
            qwen3_moe.moe_ops.add_rmsnorm_route_hidden = real_route
            m._greedy = saved
        if name not in steps:
            steps[name] = [round(moe_bench.graph_step_ms(m, 1), 4) for _ in range(3)]
        print(name, steps[name], flush=True)
    with open(path, "w") as f:
        json.dump({"graph_step_ms": steps, "cache": 400, "fp8": fp8}, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--names", default=",".join(NAMES))
    a = ap.parse_args()
    main(a.out, a.fp8, tuple(a.names.split(",")))
