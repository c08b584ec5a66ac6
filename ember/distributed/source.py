"""Shard-aware checkpoint sources: a :class:`ShardSource` hands the model builder this rank's slice
of every tensor (by the :class:`~ember.distributed.plan.ShardPlan`), read from the safetensors with
``get_slice`` so a rank never reads another rank's rows; :func:`random_source` makes the same slices
out of random numbers on the rank's own device (full-size benchmarks without a checkpoint).

Example:
    >>> src = ShardSource(plan, names, fetch_slice, device, torch.bfloat16)
    >>> src.get("model.layers.0.self_attn.q_proj.weight", (32 * 128, 4096))   # rank's 32 heads
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ember.distributed.plan import BLOCK, ShardPlan, Slice
from ember.models._weights import TensorSource, missing_error

FetchSlice = Callable[[str, "Slice | None"], torch.Tensor]


class ShardSource(TensorSource):
    """A :class:`TensorSource` over this rank's slices. The builder asks for local shapes (per-rank
    heads, local expert indices); the source maps each request to the checkpoint tensor and slice,
    checks the checkpoint's full size along the split dimension, and records the checkpoint name as
    used. Tensors of experts other ranks hold are accounted for by :meth:`mark_foreign_used`."""

    def __init__(self, plan: ShardPlan, names: set[str], fetch_slice: FetchSlice, device, dtype):
        super().__init__(names, None, device, dtype)
        self.plan, self._fetch_slice = plan, fetch_slice

    def _global(self, name: str) -> str:
        return self.plan.local_expert(name) or name

    def has(self, name: str) -> bool:
        return self._global(name) in self.names

    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        name = self._global(name)
        if name not in self.names:
            raise missing_error([name])
        s = self.plan.slice_for(name)
        t = self._fetch_slice(name, s)
        if shape is not None and tuple(t.shape) != tuple(shape):
            what = "" if s is None else f" (rank {self.plan.rank}'s rows [{s.start}, {s.stop}) of dim {s.dim})"
            raise ValueError(f"checkpoint tensor {name}{what}: expected shape {tuple(shape)} from config.json, "
                             f"got {tuple(t.shape)}")
        self.used.add(name)
        return t

    def mark_foreign_used(self) -> None:
        """Count other ranks' per-expert tensors as used (they hold them), so the loader's check for
        unused tensors still finds a wrong model_type but not the experts of other shards."""
        self.used |= {n for n in self.names if self.plan.owns_expert(n) is False}


def take(t, s: Slice | None, full_shape: tuple[int, ...], name: str):
    """``t[s]`` for a safetensors slice handle or a tensor (only those rows are read), after checking
    the full size along the split dimension."""
    if s is None:
        return t[:] if not isinstance(t, torch.Tensor) else t
    if full_shape[s.dim] != s.full:
        raise ValueError(f"checkpoint tensor {name}: expected {s.full} along dim {s.dim} (config.json), got "
                         f"shape {tuple(full_shape)}")
    index = (slice(None),) * s.dim + (slice(s.start, s.stop),)
    return t[index]


# ----------------------------------------------------------------------------- random full-size shards
def checkpoint_shapes(cfg: dict, *, fp8: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor a Qwen3-MoE checkpoint of ``cfg`` holds: name -> (full shape, stored dtype; None:
    the model dtype). ``fp8``: HF fine-grained FP8 layout (float8_e4m3fn linears and experts, 128x128
    block ``weight_scale_inv``; router, norms, embedding and lm_head in the model dtype)."""
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads", nh)
    d = cfg.get("head_dim") or H // nh
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}

    def linear(prefix: str, n: int, k: int) -> None:
        out[f"{prefix}.weight"] = ((n, k), torch.float8_e4m3fn if fp8 else None)
        if fp8:
            out[f"{prefix}.weight_scale_inv"] = ((-(-n // BLOCK), -(-k // BLOCK)), torch.float32)

    for i in range(L):
        p = f"model.layers.{i}"
        for name, n, k in (("q_proj", nh * d, H), ("k_proj", kvh * d, H), ("v_proj", kvh * d, H), ("o_proj", H, nh * d)):
            linear(f"{p}.self_attn.{name}", n, k)
        for name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            out[f"{p}.{name}"] = ((d,), None)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[f"{p}.{name}"] = ((H,), None)
        if i not in dense and (i + 1) % step == 0:
            out[f"{p}.mlp.gate.weight"] = ((E, H), None)
            for e in range(E):
                for name, n, k in (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I)):
                    linear(f"{p}.mlp.experts.{e}.{name}", n, k)
        else:
            inter = cfg["intermediate_size"]
            for name, n, k in (("gate_proj", inter, H), ("up_proj", inter, H), ("down_proj", H, inter)):
                linear(f"{p}.mlp.{name}", n, k)
    out["model.embed_tokens.weight"] = ((V, H), None)
    out["model.norm.weight"] = ((H,), None)
    out["lm_head.weight"] = ((V, H), None)
    return out


def random_fetch(shapes: dict, device, dtype: torch.dtype, seed: int = 0) -> FetchSlice:
    """``fetch_slice`` making each requested slice out of random numbers on ``device``: linears and
    the router N(0, 0.02^2) (FP8: N(0, 1) codes with block scales 0.02), norms 1 + N(0, 0.1^2). The
    generator is seeded per tensor name, so a slice is the same whichever rank makes it."""
    import zlib

    def fetch(name: str, s: Slice | None) -> torch.Tensor:
        full, stored = shapes[name]
        shape = list(full)
        if s is not None:
            shape[s.dim] = s.stop - s.start
        g = torch.Generator(device=device)
        g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()) + (0 if s is None else s.start))
        if name.endswith("weight_scale_inv"):
            return torch.full(shape, 0.02, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)
        if stored == torch.float8_e4m3fn:
            return torch.randn(shape, generator=g, device=device, dtype=dtype).clamp_(-8, 8).to(stored)
        return (0.02 * torch.randn(shape, generator=g, device=device, dtype=torch.float32)).to(dtype)
    return fetch
