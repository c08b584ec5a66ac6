"""Blocks shared by the model files where the logic is identical: linear layers (bf16 or FP8), the
Qwen3 attention block (q/k RMSNorm, RoPE, GQA) with its prefill and decode paths, the dense SwiGLU
MLP, the RoPE table and the decoder-only skeleton (embedding, layers, final norm, lm_head).

A model file (``qwen3.py``, ``qwen3_moe.py``) supplies its config parsing, its MLP and the map from
checkpoint tensor names to the tensors it needs; everything else is here.

Shapes: B rows, T tokens, H hidden, NH query heads, KVH key/value heads, D head dim, S cache length.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib

import torch
import torch.nn.functional as F
from torch import nn

import ember.ops
attn_ops = importlib.import_module("ember.ops.attention")
from ember.models._weights import TensorSource, fp8_concat_linear, fp8_linear, missing_error  # noqa: E402


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass
class AttentionConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> "AttentionConfig":
        check_default_rope(cfg)
        rope = cfg.get("rope_parameters") or {}
        if cfg.get("use_sliding_window"):
            raise ValueError("config.json: use_sliding_window=true is not supported")
        nh = cfg["num_attention_heads"]
        return cls(hidden_size=cfg["hidden_size"], num_heads=nh, num_kv_heads=cfg.get("num_key_value_heads", nh),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // nh,
                   rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   attention_bias=bool(cfg.get("attention_bias", False)))


def rope_types(cfg: dict) -> list[str]:
    """The RoPE variants a config names: in ``rope_parameters`` (transformers 5) and in the legacy
    ``rope_scaling``, each as ``rope_type`` or, in older configs, ``type``; empty when none does."""
    kinds = []
    for key in ("rope_parameters", "rope_scaling"):
        rope = cfg.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ValueError(f"config.json: expected {key} to be an object, got {rope!r}")
        kinds += [rope[k] for k in ("rope_type", "type") if rope.get(k) is not None]
    return kinds


def check_default_rope(cfg: dict) -> None:
    """A ValueError naming the RoPE variant unless every one the config names is "default" (the only
    one ember implements: no YaRN, linear or dynamic scaling)."""
    for kind in rope_types(cfg):
        if kind != "default":
            raise ValueError(f"config.json: rope_type {kind!r} is not supported (ember implements 'default')")


def rope_tables(head_dim: int, theta: float, max_seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim // 2] in float32, computed as transformers does (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D] rotated by cos/sin [..., T, D/2] (rotate-half convention), in x.dtype.

    Like transformers, cos/sin are rounded to x.dtype and the products taken in x.dtype.
    """
    cos, sin = cos.to(x.dtype).unsqueeze(-2), sin.to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ----------------------------------------------------------------------------- linear layers
class Linear(nn.Module):
    """y = x W^T (+ b); the bf16/fp16/fp32 counterpart of ember.nn.Fp8Linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a one-row x on CUDA (batch-1 decode) takes ember's GEMV; everything else is F.linear
        return ember.ops.linear(x, self.weight, self.bias)


def weight_and_row_scale(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [N, K], per-row fp32 scale or None) of an unbiased Linear or row-scaled weight-only
    Fp8Linear, what kernels that stream a projection's weight themselves take; else None."""
    from ember.nn.fp8_linear import Fp8Linear
    if type(linear) is Linear and linear.bias is None:
        return linear.weight, None
    if (isinstance(linear, Fp8Linear) and linear.bias is None and linear.granularity == "row"
            and linear.activations is None):
        return linear.weight, linear.weight_scale.reshape(-1)
    return None


# ----------------------------------------------------------------------------- attention
class Attention(nn.Module):
    """Qwen3 attention: one fused qkv projection, RMSNorm on q and k per head, RoPE, GQA, o-proj."""

    def __init__(self, cfg: AttentionConfig, qkv: nn.Module, o: nn.Module, q_norm: torch.Tensor, k_norm: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.qkv, self.o = qkv, o
        self.q_norm = nn.Parameter(q_norm, requires_grad=False)
        self.k_norm = nn.Parameter(k_norm, requires_grad=False)
        self.scale = cfg.head_dim ** -0.5

    def _split(self, qkv: torch.Tensor):
        c = self.cfg
        return qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)

    def prefill(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0) -> torch.Tensor:
        """h [B, T, H] at positions start..start+T-1 -> [B, T, H]; writes k, v into cache [B, KVH, >=start+T, D]
        if given. ``start`` > 0 (a later chunk of a prompt, cache required) attends over the cached
        positions 0..start-1 too."""
        c = self.cfg
        B, T, _ = h.shape
        qkv = self.qkv(h)
        if cache is not None:  # norms, RoPE and the cache write in one launch; k, v then read from the cache
            # (H200, Qwen3-30B-A3B prefill of 2048 tokens: 40.9 vs 48.2 ms for ~20 launches a layer,
            # measured with the earlier atomic MoE combine; 43.7 ms with the fixed-order one)
            # A chunk at ``start``: the op writes positions 0..T-1 of the views shifted by start (cache
            # and RoPE table alike), so the kernel is the whole-prompt one, unchanged.
            q = attn_ops.prefill_qk_norm_rope_cache(qkv, self.q_norm, self.k_norm, cos[start:], sin[start:],
                                                    cache[0][:, :, start:], cache[1][:, :, start:],
                                                    num_heads=c.num_heads, eps=c.rms_norm_eps)
            q, k, v = q.transpose(1, 2), cache[0][:B, :, :start + T], cache[1][:B, :, :start + T]
            if start:
                return self.o(_attend_after_prefix(q, k, v, start, self.scale).transpose(1, 2)
                              .reshape(B, T, c.num_heads * c.head_dim))
        else:
            if start:
                raise ValueError(f"start: a prefill from position {start} needs the cache holding 0..{start - 1}")
            q, k, v = self._split(qkv)
            q = ember.ops.rmsnorm(q.reshape(B, T, c.num_heads, c.head_dim), self.q_norm, c.rms_norm_eps)
            k = ember.ops.rmsnorm(k.reshape(B, T, c.num_kv_heads, c.head_dim), self.k_norm, c.rms_norm_eps)
            q, k = apply_rope(q, cos[:T], sin[:T]), apply_rope(k, cos[:T], sin[:T])
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=c.num_heads != c.num_kv_heads)
        return self.o(out.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))

    def decode(self, h: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h [B, H], one token per row at ``positions`` [B] -> [B, H]; appends k, v to the cache."""
        return self._decode_from_qkv(self.qkv(h), positions, seq_lens, cos, sin, cache)

    def decode_prescaled(self, scaled: torch.Tensor, h: torch.Tensor, eps: float, positions: torch.Tensor,
                         seq_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``decode(add_rmsnorm's normed h)`` given ``scaled = h * norm_weight`` (the previous layer's
        ``moe_experts_add_scale``): the 1 / rms(h) is applied after the qkv projection, in the q/k
        norm + RoPE launch (``prenorm``), so the norm has no launch of its own (H200 Qwen3-30B-A3B
        decode step: bf16 2.311 vs 2.396 ms, fp8 2.159 vs 2.248)."""
        return self._decode_from_qkv(self.qkv(scaled), positions, seq_lens, cos, sin, cache, prenorm=(h, eps))

    def _decode_from_qkv(self, qkv: torch.Tensor, positions, seq_lens, cos, sin, cache,
                         prenorm: tuple | None = None) -> torch.Tensor:
        """q/k norm + RoPE + cache write, decode attention, output projection."""
        c = self.cfg
        q = attn_ops.qk_norm_rope_cache(qkv, self.q_norm, self.k_norm, cos, sin, positions, cache[0], cache[1],
                                        num_heads=c.num_heads, eps=c.rms_norm_eps, prenorm=prenorm)
        out = attn_ops.decode_attention(q, cache[0], cache[1], seq_lens, scale=self.scale)  # [B, NH * D]
        return self.o(out)


def _attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of T queries at positions start..start+T-1 over k, v [B, KVH, start+T, D]:
    query i sees keys 0..start+i, the causal mask aligned bottom-right (SDPA's ``is_causal`` aligns it
    top-left). ``causal_lower_right`` keeps the flash kernel, where an explicit boolean mask took the
    masked kernels (H200, Qwen3-30B-A3B, ``ember bench serve`` with the mask: an 8,192-token prompt in
    two 4,096-token chunks reached its first token in 1,009 ms, and the row peaked 8 GB above the
    others; not yet re-measured with this). kv heads are repeated, as that kernel takes no GQA flag."""
    from torch.nn.attention.bias import causal_lower_right
    T, S = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S), scale=scale)


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [2I, H] projection (gate rows first)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


# ----------------------------------------------------------------------------- decoder skeleton
class DecoderLayer(nn.Module):
    def __init__(self, attn: Attention, mlp: nn.Module, ln1: torch.Tensor, ln2: torch.Tensor, eps: float):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.ln1 = nn.Parameter(ln1, requires_grad=False)
        self.ln2 = nn.Parameter(ln2, requires_grad=False)
        self.eps = eps


class CausalLM(nn.Module):
    """Embedding -> layers (pre-norm attention and MLP, residual stream) -> final norm -> lm_head.

    ``prefill`` handles whole prompts (SDPA, outside CUDA graphs); ``decode`` one token per row
    against the static KV cache, written so that it can be captured in a CUDA graph (no host syncs,
    fixed shapes, positions and lengths read from device tensors).
    """

    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: torch.Tensor, lm_head: nn.Module,
                 attn_cfg: AttentionConfig, max_seq_len: int):
        super().__init__()
        self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.attn_cfg = attn_cfg
        self.eps = attn_cfg.rms_norm_eps
        cos, sin = rope_tables(attn_cfg.head_dim, attn_cfg.rope_theta, max_seq_len, embed.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    def cache_specs(self, max_batch_size: int, max_seq_len: int,
                    dtype: torch.dtype) -> list[tuple[tuple[tuple[int, ...], torch.dtype], ...]]:
        """One tuple of ``(shape, dtype)`` per layer, batch first: (k, v) [B, KVH, S, D] for attention;
        a mixer with its own ``cache_spec`` (short conv, DeltaNet, gated attention) describes its state."""
        if max_seq_len > self.cos.shape[0]:
            raise ValueError(f"max_seq_len: expected at most {self.cos.shape[0]} (the RoPE table the model was "
                             f"built with), got {max_seq_len}")
        specs = []
        for layer in self.layers:
            mixer = layer.attn
            if hasattr(mixer, "cache_spec"):
                specs.append(mixer.cache_spec(max_batch_size, max_seq_len, dtype))
            else:
                kv = ((max_batch_size, mixer.cfg.num_kv_heads, max_seq_len, mixer.cfg.head_dim), dtype)
                specs.append((kv, kv))
        return specs

    def allocate_caches(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None,
                        device=None) -> list[tuple[torch.Tensor, ...]]:
        """Zeroed caches laid out as :meth:`cache_specs` says (what the engine allocates once)."""
        dtype = dtype or self.embed.dtype
        device = device or self.embed.device
        return [tuple(torch.zeros(shape, dtype=dt, device=device) for shape, dt in layer)
                for layer in self.cache_specs(max_batch_size, max_seq_len, dtype)]

    def _run(self, x: torch.Tensor, attend, last_only: bool = False,
             last_index: torch.Tensor | None = None, attend_prescaled=None) -> torch.Tensor:
        """The decoder stack. ``attend(i, attn, normed)`` runs layer i's mixer; ``attend_prescaled(i,
        attn, scaled, h)`` (decode) runs layer i's mixer on ``add_rmsnorm``'s output given h (the new
        residual) and h * norm_weight, which the previous layer's MLP wrote instead of its output where
        both layers can (the MLP's ``add_norm_forward_prescaled``, the next mixer's
        ``decode_prescaled``): the pre-attention norm then has no launch of its own."""
        normed, residual = ember.ops.rmsnorm(x, self.layers[0].ln1, self.eps), x
        prescaled = None  # (h, h * ln1) from the previous layer's MLP
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1] if i + 1 < len(self.layers) else None
            fold_next = getattr(layer.mlp, "add_norm_forward_prescaled", None)
            can_prescale = (attend_prescaled is not None and fold_next is not None and nxt is not None
                            and hasattr(nxt.attn, "decode_prescaled"))
            if prescaled is not None:
                residual, scaled = prescaled
                a = attend_prescaled(i, layer.attn, scaled, residual)
            else:
                if i > 0:
                    normed, residual = ember.ops.add_rmsnorm(m, residual, layer.ln1, self.eps)
                a = attend(i, layer.attn, normed)
            prescaled = None
            if can_prescale:
                prescaled = fold_next(a, residual, layer.ln2, self.eps, nxt.ln1)
                if prescaled is not None:
                    continue
            # an MLP that can fold the post-attention norm into its first launch (the MoE router) does
            fused = getattr(layer.mlp, "add_norm_forward", None)
            folded = fused(a, residual, layer.ln2, self.eps) if fused is not None else None
            if folded is not None:
                m, residual = folded
            else:
                normed, residual = ember.ops.add_rmsnorm(a, residual, layer.ln2, self.eps)
                m = layer.mlp(normed)
        if last_index is not None:  # a padded prompt (prefill graphs): its last real position
            m, residual = m.index_select(1, last_index).squeeze(1), residual.index_select(1, last_index).squeeze(1)
        elif last_only:  # every layer needs all positions; the final norm and lm_head only the last
            m, residual = m[:, -1], residual[:, -1]
        normed, _ = ember.ops.add_rmsnorm(m, residual, self.norm, self.eps)
        return self.lm_head(normed)

    def prefill(self, input_ids: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                last_only: bool = False, last_index: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """input_ids [B, T] (positions start..start+T-1) -> logits [B, T, V] ([B, V] with last_only, or
        at index ``last_index`` (int64 [1], on the device) of every row).

        ``start`` > 0 continues a prompt whose positions 0..start-1 the caches already hold (chunked
        prefill): attention reads that prefix, conv / recurrent mixers continue from their state.

        Example:
            >>> first = net.prefill(ids[:, :512], caches, last_only=True)
            >>> logits = net.prefill(ids[:, 512:], caches, last_only=True, start=512)
        """
        T = input_ids.shape[1]
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start: expected an int >= 0, got {start!r}")
        if start + T > self.cos.shape[0]:
            raise ValueError(f"input_ids: expected at most {self.cos.shape[0]} tokens (max_seq_len) from position "
                             f"{start}, got {T}")
        if start and caches is None:
            raise ValueError(f"start: a prefill from position {start} needs the caches holding 0..{start - 1}")
        x = F.embedding(input_ids, self.embed)

        def attend(i, attn, h):
            cache = None if caches is None else caches[i]
            # start passed only when non-zero: a mixer wrapped by another module keeps the 4-argument call
            kw = {"start": start} if start else {}
            if last_index is not None and getattr(attn, "recurrent", False):
                kw["last_index"] = last_index  # a state must not run through the padding (attention is causal)
            return attn.prefill(h, self.cos, self.sin, cache, **kw)
        return self._run(x, attend, last_only, last_index)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
               caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """tokens [B] at positions [B] (seq_lens = positions + 1, int32) -> logits [B, V]."""
        x = F.embedding(tokens, self.embed)

        def attend_prescaled(i, attn, scaled, h):
            return attn.decode_prescaled(scaled, h, self.eps, positions, seq_lens, self.cos, self.sin, caches[i])

        def attend(i, attn, h):
            return attn.decode(h, positions, seq_lens, self.cos, self.sin, caches[i])
        return self._run(x, attend, attend_prescaled=attend_prescaled)


def make_linear(src: TensorSource, prefix: str, out_features: int, in_features: int, *, fp8: bool,
                bias: bool = False) -> nn.Module:
    """A Linear from ``{prefix}.weight`` (and ``.bias``); FP8 when the checkpoint is FP8 (weight +
    ``weight_scale_inv``) or when ``fp8`` asks to quantize on load."""
    w_name = f"{prefix}.weight"
    if w_name not in src.names:
        raise missing_error([w_name])
    b = src.get(f"{prefix}.bias", (out_features,)) if bias else None
    if src.has(f"{prefix}.weight_scale_inv") or fp8:
        return fp8_linear(src, prefix, out_features, in_features, bias=b)
    return Linear(src.get(w_name, (out_features, in_features)), b)


def concat_linear(src: TensorSource, prefixes: list[str], outs: list[int], in_features: int, *, fp8: bool,
                  bias: bool = False) -> nn.Module:
    """One Linear whose output rows are the concatenation of several checkpoint linears (q,k,v / gate,up)."""
    if any(src.has(f"{p}.weight_scale_inv") for p in prefixes) or fp8:
        return fp8_concat_linear(src, prefixes, outs, in_features, bias=bias)
    ws = [src.get(f"{p}.weight", (o, in_features)) for p, o in zip(prefixes, outs)]
    bs = [src.get(f"{p}.bias", (o,)) for p, o in zip(prefixes, outs)] if bias else None
    return Linear(torch.cat(ws, 0), None if bs is None else torch.cat(bs, 0))


def build_attention(src: TensorSource, cfg: AttentionConfig, prefix: str, *, fp8: bool) -> Attention:
    c = cfg
    qkv = concat_linear(src, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
                        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
                        c.hidden_size, fp8=fp8, bias=c.attention_bias)
    o = make_linear(src, f"{prefix}.o_proj", c.hidden_size, c.num_heads * c.head_dim, fp8=fp8, bias=c.attention_bias)
    return Attention(c, qkv, o, src.get(f"{prefix}.q_norm.weight", (c.head_dim,)),
                     src.get(f"{prefix}.k_norm.weight", (c.head_dim,)))


def build_dense_mlp(src: TensorSource, prefix: str, hidden: int, inter: int, *, fp8: bool) -> DenseMLP:
    gate_up = concat_linear(src, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], [inter, inter], hidden, fp8=fp8)
    return DenseMLP(gate_up, make_linear(src, f"{prefix}.down_proj", hidden, inter, fp8=fp8))


def build_causal_lm(src: TensorSource, cfg: dict, attn_cfg: AttentionConfig, make_mlp, *, fp8: bool,
                    max_seq_len: int) -> CausalLM:
    """The shared skeleton; ``make_mlp(layer_idx, prefix)`` builds each layer's MLP."""
    H, V = attn_cfg.hidden_size, cfg["vocab_size"]
    embed = src.get("model.embed_tokens.weight", (V, H))
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        layers.append(DecoderLayer(build_attention(src, attn_cfg, f"{p}.self_attn", fp8=fp8),
                                   make_mlp(i, f"{p}.mlp"),
                                   src.get(f"{p}.input_layernorm.weight", (H,)),
                                   src.get(f"{p}.post_attention_layernorm.weight", (H,)), attn_cfg.rms_norm_eps))
    norm = src.get("model.norm.weight", (H,))
    if cfg.get("tie_word_embeddings", False) and not src.has("lm_head.weight"):
        lm_head = Linear(embed)  # shares storage with the embedding
    else:
        # The lm_head stays in the model dtype even with --fp8: it is 10% of the bytes and sets the logits.
        lm_head = Linear(src.get("lm_head.weight", (V, H)))
    return CausalLM(embed, layers, norm, lm_head, attn_cfg, max_seq_len)


def missing_as_value_error(build):
    """A model file's ``build``: a config key it reads that config.json lacks (a KeyError) becomes a
    ValueError naming it. (A missing tensor is already one: ``TensorSource`` raises it.)"""
    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        try:
            return build(*args, **kwargs)
        except KeyError as e:
            name = str(e.args[0]) if e.args else "?"
            if "." in name:  # tensor names have dots, config keys do not
                raise missing_error([name]) from None
            raise ValueError(f"config.json: missing required key {name!r}") from None
    return wrapper


def check_positive(cfg: dict, *keys: str) -> None:
    for k in keys:
        v = cfg.get(k)
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"config.json: expected a positive integer {k}, got {v!r}")


