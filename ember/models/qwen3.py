"""Qwen3 (dense), HF ``model_type`` "qwen3": pre-norm decoder, GQA attention with per-head q/k
RMSNorm and RoPE, SwiGLU MLP. The blocks are the shared ones in ``_common``; this file maps the
checkpoint onto them.

Example:
    >>> model = ember.load("path/to/Qwen3-0.6B")
"""
from __future__ import annotations

from ember.models import _common

MODEL_TYPE = "qwen3"


@_common.missing_as_value_error
def build(src: _common.TensorSource, cfg: dict, *, fp8: bool, max_seq_len: int) -> _common.CausalLM:
    for key in ("num_experts", "num_local_experts"):  # transformers 4 / 5 spellings
        experts = cfg.get(key)
        if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0:
            raise ValueError(f"config.json: model_type 'qwen3' is the dense model, but the config has {key}="
                             f"{experts} (a Qwen3 MoE checkpoint is model_type 'qwen3_moe')")
    _common.check_positive(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size")
    attn = _common.AttentionConfig.from_hf(cfg)
    H, inter = attn.hidden_size, cfg["intermediate_size"]

    def make_mlp(layer_idx: int, prefix: str):
        return _common.build_dense_mlp(src, prefix, H, inter, fp8=fp8)

    return _common.build_causal_lm(src, cfg, attn, make_mlp, fp8=fp8, max_seq_len=max_seq_len)
