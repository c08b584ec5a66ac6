"""Triton kernels for the fused MoE ops (routing, SwiGLU experts); launch helpers take validated tensors.

Three paths, picked by the token count T (all capturable: no host syncs, shapes fixed by T, k, E):

* T == 1, the decode step of one sequence: the route kernel (``routing``), then a gate_up GEMV (SiLU*up
  fused) and a down GEMV that applies the routing weights (no atomics, no combine kernel): the v1
  kernels (``gemv_v1``) or the v2 kernels (``gemv_v2``: no shared-memory layout conversion in the K
  loop), chosen per weight dtype by the entry "t1". H200, Qwen3-30B-A3B: fp8 takes v2 (us per layer:
  row scales 20.6 vs 29.2, 128-blocks 21.2 vs ~29); bf16 v1: v2 won alone (27.6 vs 28.4 us) and in
  the decode step without dependent launch (2.934 vs 2.953 ms), but with it v1 does
  (bench/step_variants.py: 2.705 vs 2.734 ms at max_seq_len 400, 2.745 vs 2.777 at 4096).
* 2 <= T <= 16 (batched decode) and T > 16 (prefill): the grouped kernels (``grouped``; prefill sorts
  the pairs by expert first, ``align``).

FP8 weights are converted to the activation dtype in registers (exact for e4m3 in bf16/fp16/fp32);
row scales multiply the accumulator at the end, 128x128 block scales each 128-wide K slice.

Tiles are tuning data, family "moe" (``ember.tuning.lookup("moe", key, device)``; the H200's in
``ember/tuning/data/sm_90-nvidia-h200/moe.json``, other GPUs ``generic/moe.json``; CPU tensors take
``config.CPU_CONFIG``). Keys, each a complete entry (``config.tiles(key, device)`` returns the one in
use, for sweeps built on it with ``ember.tuning.override("moe", {key: entry})``):

* ``"t1"``: ``{"GEMV": "v1"|"v2", "GEMV_FP8": "v1"|"v2"}``, the T=1 kernels for 2/4-byte and fp8 weights.
* ``"gemv_gate_up"``, ``"gemv_down"``: the v1 GEMVs' ``BLOCK_N, BLOCK_K, num_warps, UNROLL`` (down also
  ``SPLIT, SPLIT_FP8``: expert groups per row block, ``config.down_split``).
* ``"gemv_v2_gate_up"``, ``"gemv_v2_down"``: ``num_warps, ROWS, ROWS_FP8`` (optional ``LANES``; down also
  ``SPLIT, SPLIT_FP8``), see ``gemv_v2.v2_tiles``.
* ``"grouped_decode"``: ``BLOCK_N, BLOCK_K, num_warps, num_stages`` of the 2..16-token grouped kernels.
* ``"prefill"``, ``"prefill:large_smem"``: ``{"gate_up": tile, "down": tile, "max_block_m": 16..128}`` of
  prefill; the second on GPUs with >= 200 KB of shared memory per block and 2-byte activations.
* ``"router"``: ``{"BLOCK_R", "num_warps"}`` of the router launch; no shipped entry (the rule in
  ``config.router_tile``).
"""
from __future__ import annotations

import torch

from ember.kernels.moe import config
from ember.kernels.moe.config import DECODE_MAX_TOKENS, prefill_configs, t1_variant, tiles
from ember.kernels.moe.gemv_v1 import experts_gemv
from ember.kernels.moe.gemv_v2 import experts_gemv_v2
from ember.kernels.moe.grouped import experts_grouped
from ember.kernels.moe.routing import ADD_NORM_MAX_HIDDEN, ROUTER_MAX_TOKENS, route, route_hidden

__all__ = ["ADD_NORM_MAX_HIDDEN", "DECODE_MAX_TOKENS", "PAIR_ROWS_BYTES", "ROUTER_MAX_TOKENS", "experts",
           "experts_add_scale", "moe", "pair_rows_chunk", "prefill_configs", "route", "route_hidden", "t1_variant",
           "tiles"]

# The grouped path's per-pair rows take up to T * top_k * H * 4 bytes (float32; half that in bf16;
# a 32k-token Qwen3-30B-A3B prompt: 2.1 GB); longer prompts run in token chunks that keep them under
# this (each chunk reads the expert weights again: ~0.3 ms a layer on the H200 for Qwen3-30B-A3B,
# against ~1.6 ms of compute for a 16k-token chunk).
PAIR_ROWS_BYTES = 1 << 30


def pair_rows_chunk(top_k: int, H: int) -> int:
    """Tokens per grouped-path chunk: the pair rows within PAIR_ROWS_BYTES (16384 tokens for top-8 of
    2048-wide rows), never fewer than the decode path's limit + 1."""
    return max(DECODE_MAX_TOKENS + 1, PAIR_ROWS_BYTES // (top_k * H * 4))


def _t1(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out, fold=None):
    if t1_variant(x.device, fp8=w_gate_up.element_size() == 1) == "v2":
        return experts_gemv_v2(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out, fold)
    return experts_gemv(x, w_gate_up, w_down, gs, ds, ids, tw, top_k, out, fold)


def experts(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale):
    x = config.rows_contiguous(x)
    T, H = x.shape
    top_k = topk_ids.shape[1]
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    if T == 0:
        return torch.empty_like(x)
    if T == 1:
        return _t1(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, top_k, torch.empty_like(x))
    rows = pair_rows_chunk(top_k, H)
    if T <= rows:
        return experts_grouped(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, top_k)
    out = torch.empty_like(x)
    for t0 in range(0, T, rows):  # each chunk writes its rows of out (contiguous) directly
        part = slice(t0, t0 + rows)
        experts_grouped(x[part], w_gate_up, w_down, gate_up_scale, down_scale, ids[part], tw[part], top_k, out[part])
    return out


def experts_add_scale(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale, residual,
                      norm_weight):
    """Up to DECODE_MAX_TOKENS tokens: (h, h * norm_weight) with h = experts(x) + residual
    (ops.moe_experts_add_scale): the T=1 down GEMV's epilogue, or the grouped path's combine."""
    x = config.rows_contiguous(x)
    ids = topk_ids.to(torch.int32).contiguous()
    tw = topk_weights.to(torch.float32).contiguous()
    h, scaled = torch.empty_like(x), torch.empty_like(x)
    fold = (residual.contiguous(), norm_weight.contiguous(), scaled)
    if x.shape[0] > 1:
        experts_grouped(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, ids.shape[1], h, fold)
    else:
        _t1(x, w_gate_up, w_down, gate_up_scale, down_scale, ids, tw, ids.shape[1], h, fold)
    return h, scaled


def moe(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale):
    tw, ids = route(router_logits, top_k, renormalize)
    return experts(x, w_gate_up, w_down, tw, ids, gate_up_scale, down_scale)
