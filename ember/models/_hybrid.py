"""Pieces shared by the hybrid model files (``lfm2_moe.py``: short convolutions + attention;
``qwen3_5_moe.py``: gated DeltaNet + gated attention): the decoder skeleton (per-layer cache specs
live in ``_common.CausalLM``), a renamed view of a checkpoint, and linears built from a float weight the model file
rearranged (bf16 or FP8).

The skeleton is ``_common.CausalLM``: each layer's mixer (``layer.attn``) only needs
``prefill(h, cos, sin, cache)`` and ``decode(h, positions, seq_lens, cos, sin, cache)``, so a conv
or DeltaNet block sits where attention sits in Qwen3. Caches are per-layer tuples of batch-first
tensors whose layout :meth:`HybridLM.cache_specs` describes; prefill writes a row's whole state
(it never reads what a previous request left there).

Example:
    >>> specs = net.cache_specs(max_batch_size=1, max_seq_len=4096, dtype=torch.bfloat16)
    >>> caches = [tuple(torch.zeros(s, dtype=d) for s, d in layer) for layer in specs]
"""
from __future__ import annotations

import torch
from torch import nn

from ember.models import _common

CacheSpec = tuple[tuple[int, ...], torch.dtype]


class HybridLM(_common.CausalLM):
    """``_common.CausalLM`` whose layers hold different mixers and so different caches.

    ``rope`` replaces the RoPE tables (cos, sin [max_seq_len, head_dim / 2] float32) when the
    model's rotary layout is not the plain one (Qwen3.5's partial rotary).
    """

    def __init__(self, embed, layers, norm, lm_head, attn_cfg: _common.AttentionConfig, max_seq_len: int,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__(embed, layers, norm, lm_head, attn_cfg, max_seq_len)
        if rope is not None:
            cos, sin = rope
            if cos.shape != self.cos.shape or sin.shape != self.sin.shape:
                raise ValueError(f"rope: expected cos/sin of shape {tuple(self.cos.shape)}, got "
                                 f"{tuple(cos.shape)} / {tuple(sin.shape)}")
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    @property
    def max_seq_len(self) -> int:
        return self.cos.shape[0]


def kv_cache_spec(max_batch_size: int, max_seq_len: int, dtype: torch.dtype, num_kv_heads: int,
                  head_dim: int) -> tuple[CacheSpec, CacheSpec]:
    kv = ((max_batch_size, num_kv_heads, max_seq_len, head_dim), dtype)
    return kv, kv


def conv_state_at(before: torch.Tensor, inputs: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """The conv state a chunk leaves when its real tokens end at ``last_index`` (int64 [1], on the
    device) and padding follows: the K-1 conv inputs up to and including that position.

    ``before`` [B, C, K-1]: the state before the chunk; ``inputs`` [B, C, T]: the chunk's conv inputs.
    A device-side gather (no host sync), so a padded prefill captured in a CUDA graph keeps the state
    an exact-length prefill would leave.

    Example:
        >>> before, x = torch.zeros(1, 4, 2), torch.randn(1, 4, 8)
        >>> conv_state_at(before, x, torch.tensor([4])).equal(x[:, :, 3:5])
        True
    """
    keep = before.shape[2]
    index = last_index + 1 + torch.arange(keep, device=inputs.device)
    return torch.cat([before, inputs], dim=2).index_select(2, index)


# ----------------------------------------------------------------------------- checkpoint helpers
def renamed(src: _common.TensorSource, rename) -> _common.TensorSource:
    """A view of ``src`` under the names ``rename(checkpoint_name)`` gives (None hides a tensor).

    Reads go through ``src``, so the loader's unused-tensor check still sees what was consumed.
    """
    back: dict[str, str] = {}
    for name in src.names:
        new = rename(name)
        if new is not None:
            back[new] = name
    return _common.TensorSource(set(back), lambda n: src.raw(back[n]), src.device, src.dtype)


def mark_unused_ok(src: _common.TensorSource, prefixes: tuple[str, ...]) -> list[str]:
    """Declare tensors under ``prefixes`` (parts of the checkpoint the text model has no use for,
    e.g. a vision tower) as handled; returns their names."""
    names = sorted(n for n in src.names if n.startswith(prefixes))
    src.used.update(names)
    return names


def float_weight(src: _common.TensorSource, prefix: str, out_features: int, in_features: int) -> torch.Tensor:
    """``{prefix}.weight`` as a float tensor in ``src.dtype`` on ``src.device``, dequantised when the
    checkpoint stores it in FP8 with a 128x128 block ``weight_scale_inv``."""
    from ember.ops import fp8 as fp8_ops
    name = f"{prefix}.weight"
    if not src.has(name):
        raise _common.missing_error([name])
    scale_name = f"{prefix}.weight_scale_inv"
    if not src.has(scale_name):
        return src.get(name, (out_features, in_features))
    w = src.raw(name, (out_features, in_features)).to(src.device)
    cdiv = lambda a, n: -(-a // n)  # noqa: E731
    s = src.raw(scale_name, (cdiv(out_features, 128), cdiv(in_features, 128))).to(src.device, torch.float32)
    return fp8_ops.dequantize_fp8(w, s, torch.float32).to(src.dtype)


def linear_from_weight(w: torch.Tensor, *, fp8: bool) -> nn.Module:
    """A linear over a weight the model file assembled: kept as is, or quantised to FP8 per output
    row (one rounding more than the checkpoint's blocks when it came from an FP8 checkpoint)."""
    if not fp8:
        return _common.Linear(w)
    from ember.nn import Fp8Linear
    from ember.ops import fp8 as fp8_ops
    q, s = fp8_ops.quantize_fp8(w, "row")
    return Fp8Linear.from_fp8(q, s, None, dtype=w.dtype, check=False)


def is_fp8_checkpoint(src: _common.TensorSource) -> bool:
    return any(n.endswith(".weight_scale_inv") for n in src.names)


# ----------------------------------------------------------------------------- config helpers
def layer_types(cfg: dict, allowed: tuple[str, ...], default=None) -> list[str]:
    """``cfg["layer_types"]`` checked against ``num_hidden_layers`` and the allowed names."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        types = default
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"config.json: expected layer_types to be a list of strings, got {types!r}")
    if len(types) != n:
        raise ValueError(f"config.json: layer_types has {len(types)} entries but num_hidden_layers is {n}")
    bad = sorted({t for t in types if t not in allowed})
    if bad:
        raise ValueError(f"config.json: layer_types entries must be in {list(allowed)}, got {bad}")
    return types


def check_dim(key: str, value: int, tensor: str, shape: tuple[int, ...], axis: int, expected: int | None = None) -> None:
    """A config dimension must agree with the checkpoint tensor that carries it: a clear error naming both."""
    got = shape[axis]
    want = value if expected is None else expected
    if got != want:
        raise ValueError(f"config.json: {key}={value} does not match checkpoint tensor {tensor} of shape "
                         f"{tuple(shape)} (expected {want} along dim {axis})")


def raw_shape(src: _common.TensorSource, name: str) -> tuple[int, ...]:
    if not src.has(name):
        raise _common.missing_error([name])
    return tuple(src._fetch(name).shape)
