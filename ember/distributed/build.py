"""One rank's Qwen3-MoE: the model's own blocks (``ember.models._common``, ``qwen3_moe``) built from
this rank's slices (a :class:`~ember.distributed.source.ShardSource`), with the sums and gathers of
:mod:`ember.distributed.layers` where a block's output is split.

Per layer: qkv holds this rank's query / KV heads (attention runs unchanged on them), o_proj its
columns (``RowParallel``: one all-reduce), the MoE block this rank's experts (``ShardedMoe``: one
all-reduce); dense MLP layers split their intermediate size (one all-reduce). Then the replicated
final norm and the vocabulary-split lm_head (one all-gather). Two all-reduces a layer in all.

Example:
    >>> net = build(src, cfg, fp8=False, max_seq_len=4096)     # src: a ShardSource for this rank
"""
from __future__ import annotations

import importlib

from ember.distributed.layers import RowParallel, ShardedMoe, VocabParallelHead
from ember.distributed.source import ShardSource
from ember.models import _common
from ember.models._weights import fp8_experts

qwen3_moe = importlib.import_module("ember.models.qwen3_moe")

SUPPORTED = ("qwen3_moe",)


def check_model_type(cfg: dict) -> None:
    if cfg.get("model_type") not in SUPPORTED:
        raise ValueError(f"tensor_parallel: config.json model_type {cfg.get('model_type')!r} is not supported "
                         f"across GPUs; ember splits {', '.join(SUPPORTED)}")


def build_moe(src: ShardSource, cfg: dict, prefix: str, *, fp8: bool) -> ShardedMoe:
    plan = src.plan
    E, H, I = plan.num_experts, cfg["hidden_size"], cfg["moe_intermediate_size"]
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"config.json: expected num_experts_per_tok in [1, {E}], got {top_k!r}")
    e0, e1 = plan.experts
    router = src.get(f"{prefix}.gate.weight", (E, H))
    # local expert indices 0..E/N-1: the source maps them to the checkpoint's e0.. (or slices the stack)
    gate_up, down, s_gu, s_d = qwen3_moe._expert_weights(src, prefix, e1 - e0, H, I)
    renorm = bool(cfg.get("norm_topk_prob", False))
    if s_gu is not None or fp8:
        gate_up, down, s_gu, s_d = fp8_experts(src, gate_up, down, s_gu, s_d)
        return ShardedMoe(router, gate_up, down, top_k, renorm, e0, s_gu, s_d)
    return ShardedMoe(router, gate_up.to(src.device, src.dtype), down.to(src.device, src.dtype), top_k, renorm, e0)


@_common.missing_as_value_error
def build(src: ShardSource, cfg: dict, *, fp8: bool, max_seq_len: int) -> _common.CausalLM:
    """This rank's net (a ``CausalLM`` whose forward includes the collectives)."""
    check_model_type(cfg)
    _common.check_positive(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "moe_intermediate_size")
    plan = src.plan
    attn_cfg = _common.AttentionConfig.from_hf(plan.local_config(cfg))
    if attn_cfg.attention_bias and plan.world_size > 1:
        raise ValueError("config.json: attention_bias=true is not supported with tensor_parallel > 1")
    H, V = attn_cfg.hidden_size, plan.vocab_size
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        attn = _common.build_attention(src, attn_cfg, f"{p}.self_attn", fp8=fp8)
        attn.o = RowParallel(attn.o)
        if i not in dense and (i + 1) % step == 0:
            mlp = build_moe(src, cfg, f"{p}.mlp", fp8=fp8)
        else:
            a, b = plan.intermediate
            mlp = _common.build_dense_mlp(src, f"{p}.mlp", H, b - a, fp8=fp8)
            mlp.down = RowParallel(mlp.down)
        layers.append(_common.DecoderLayer(attn, mlp, src.get(f"{p}.input_layernorm.weight", (H,)),
                                           src.get(f"{p}.post_attention_layernorm.weight", (H,)),
                                           attn_cfg.rms_norm_eps))
    embed = src.get("model.embed_tokens.weight", (V, H))  # replicated: a decode step reads one row
    norm = src.get("model.norm.weight", (H,))
    v0, v1 = plan.vocab
    if cfg.get("tie_word_embeddings", False) and not src.has("lm_head.weight"):
        head = _common.Linear(embed[v0:v1])  # a view of the replicated embedding: no copy
    else:
        head = _common.Linear(src.get("lm_head.weight", (v1 - v0, H)))
    src.mark_foreign_used()
    return _common.CausalLM(embed, layers, norm, VocabParallelHead(head, v0), attn_cfg, max_seq_len)
