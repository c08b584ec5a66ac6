"""Model families, one self-contained file per Hugging Face ``model_type``.

Each module defines ``MODEL_TYPE`` and ``build(src, cfg, *, fp8, max_seq_len) -> CausalLM`` where
``src`` is a :class:`ember.models._weights.TensorSource` over the checkpoint's tensors. A config
key or tensor the family needs and the checkpoint lacks is a ValueError naming it.

Example:
    >>> from ember.models import SUPPORTED
    >>> sorted(SUPPORTED)
    ['lfm2_moe', 'qwen3', 'qwen3_5_moe', 'qwen3_5_moe_text', 'qwen3_moe']
"""
import importlib

# model_type -> module
SUPPORTED = {
    "qwen3": "ember.models.qwen3",
    "qwen3_moe": "ember.models.qwen3_moe",
    "lfm2_moe": "ember.models.lfm2_moe",
    "qwen3_5_moe": "ember.models.qwen3_5_moe", "qwen3_5_moe_text": "ember.models.qwen3_5_moe",
}


def module_for(model_type):
    if model_type not in SUPPORTED:
        raise ValueError(f"config.json: model_type {model_type!r} is not supported; ember supports "
                         f"{', '.join(sorted(SUPPORTED))}")
    return importlib.import_module(SUPPORTED[model_type])
