"""LFM2-MoE, HF ``model_type`` "lfm2_moe" (LFM2-8B-A1B, LFM2.5-8B-A1B): a hybrid of gated short
convolution blocks and GQA attention blocks (``layer_types``: "conv" / "full_attention"), the first
``num_dense_layers`` with a dense SwiGLU MLP and the rest with a sparse MoE.

* Short conv block: ``B, C, x = in_proj(h).chunk(3)``; ``y = C * conv(B * x)`` with a depthwise causal
  conv of ``conv_L_cache`` taps; ``out_proj(y)``. Its cache is the last ``conv_L_cache - 1`` inputs
  of the conv, ``[B, H, K-1]`` in the model dtype.
* Attention block: q/k RMSNorm per head (``q_layernorm`` / ``k_layernorm``), RoPE, GQA, ``out_proj``:
  the shared ``_common.Attention``.
* MoE routing: ``sigmoid`` of the router logits; top-k selected on ``sigmoid + expert_bias`` (the
  bias steers selection only); the selected sigmoids normalised by ``sum + 1e-6`` when
  ``norm_topk_prob``, then times ``routed_scaling_factor``; experts through ``ember.ops.moe_experts``.
  Routing math is float32 (transformers rounds the sigmoids to the model dtype first).
* Norms: ``operator_norm`` before the mixer, ``ffn_norm`` before the MLP, ``embedding_norm`` at the
  end (it is the final norm, despite its name).

Expert weights are read stacked (``feed_forward.experts.gate_up_proj``) or per expert
(``feed_forward.experts.N.w1/w3/w2.weight``, what checkpoints on disk hold).

Example:
    >>> net = ember.models.lfm2_moe.build(src, cfg, fp8=False, max_seq_len=4096)
    >>> caches = net.allocate_caches(1, 4096)
"""
from __future__ import annotations

import re

import torch
from torch import nn

import ember.ops
from ember.models import _common, _hybrid, qwen3_moe
from ember.ops.moe import moe_experts, moe_route_hidden  # the submodule: ember.ops.moe also names a function

MODEL_TYPE = "lfm2_moe"
LAYER_TYPES = ("conv", "full_attention")


class ShortConv(nn.Module):
    """The LFM2 gated short convolution, with the prefill / decode interface of an attention block.

    The gates b and c run inside the conv kernel (``causal_conv1d(gate_in=, gate_out=)``: one launch
    instead of three per block, each product rounded as the torch ops round it). H200, LFM2-8B-A1B
    bf16 decode: 781 -> 828 tok/s (bench/results/h200/moe_hybrid.json)."""

    recurrent = True  # its cache is a state each step rewrites, not an append-only KV cache

    def __init__(self, in_proj: nn.Module, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                 out_proj: nn.Module):
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv_weight = nn.Parameter(conv_weight, requires_grad=False)   # [H, K]
        self.conv_bias = None if conv_bias is None else nn.Parameter(conv_bias, requires_grad=False)

    @property
    def channels(self) -> int:
        return self.conv_weight.shape[0]

    @property
    def kernel_size(self) -> int:
        return self.conv_weight.shape[1]

    def cache_spec(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype):
        return (((max_batch_size, self.channels, self.kernel_size - 1), dtype),)

    def prefill(self, h: torch.Tensor, cos, sin, cache: tuple[torch.Tensor] | None = None,
                start: int = 0, last_index: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, H] at positions start..start+T-1 -> [B, T, H]; leaves the last K-1 conv inputs in the
        cache (``start`` > 0: a later chunk, continuing from the inputs the cache holds). ``last_index``
        (int64 [1], on the device): the chunk's real tokens end there and padding follows, which the
        state leaves out."""
        b, c, x = self.in_proj(h).chunk(3, dim=-1)                          # each [B, T, H]
        state = before = None
        if cache is not None:
            state = cache[0][: h.shape[0]]
            if not start:
                state.zero_()  # a fresh sequence: the conv sees zeros before position 0
            if last_index is not None:
                before = state.clone()
        y = ember.ops.causal_conv1d(x.transpose(1, 2), self.conv_weight, self.conv_bias, conv_state=state,
                                    gate_in=b.transpose(1, 2), gate_out=c.transpose(1, 2), channels_last=True)
        if before is not None:  # the conv inputs are b * x in the model dtype, as the op rounds them
            state.copy_(_hybrid.conv_state_at(before, (b * x).transpose(1, 2), last_index))
        return self.out_proj(y.transpose(1, 2))

    def decode(self, h: torch.Tensor, positions, seq_lens, cos, sin, cache: tuple[torch.Tensor]) -> torch.Tensor:
        """h [B, H], one token per row -> [B, H]; rolls the conv state."""
        b, c, x = self.in_proj(h).chunk(3, dim=-1)                          # each [B, H]
        y = ember.ops.causal_conv1d(x[:, :, None], self.conv_weight, self.conv_bias,
                                    conv_state=cache[0][: h.shape[0]], gate_in=b[:, :, None], gate_out=c[:, :, None])
        return self.out_proj(y[:, :, 0])


class Lfm2SparseMoe(nn.Module):
    """Sigmoid routing with a selection-only expert bias, then the fused expert MLPs."""

    def __init__(self, router: torch.Tensor, expert_bias: torch.Tensor | None, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, top_k: int, normalize: bool, scaling: float,
                 gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)              # [E, H]
        self.expert_bias = None if expert_bias is None else nn.Parameter(expert_bias, requires_grad=False)  # [E] fp32
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=False)        # [E, 2I, H]
        self.w_down = nn.Parameter(w_down, requires_grad=False)              # [E, H, I]
        self.gate_up_scale = None if gate_up_scale is None else nn.Parameter(gate_up_scale, requires_grad=False)
        self.down_scale = None if down_scale is None else nn.Parameter(down_scale, requires_grad=False)
        self.top_k, self.normalize, self.scaling = top_k, normalize, float(scaling)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights float32 [T, k], expert ids int32 [T, k]).

        One launch on the GPU for up to 64 tokens (router GEMV + sigmoid + biased top-k + normalise +
        scale): the torch sequence it replaces is ~11 launches per MoE layer. The kernel design is the
        Qwen3 router's, which measured faster than cuBLAS + one route kernel on the H200; the LFM2
        bf16 decode row went from 504 to 677 tok/s in the first run with it on."""
        return moe_route_hidden(x, self.router, self.top_k, renormalize=self.normalize, scoring="sigmoid",
                                expert_bias=self.expert_bias, scaling=self.scaling)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        weights, ids = self.route(x)
        y = moe_experts(x, self.w_gate_up, self.w_down, weights, ids, gate_up_scale=self.gate_up_scale,
                                down_scale=self.down_scale, check=False)  # ids come from topk: in range
        return y.reshape(h.shape)

    def add_norm_forward(self, a: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float):
        """``forward(add_rmsnorm(a, residual))`` with the norm folded into the router launch (decode)."""
        return qwen3_moe.add_norm_route_experts(self, a, residual, norm_weight, eps, renormalize=self.normalize,
                                                scoring="sigmoid", expert_bias=self.expert_bias, scaling=self.scaling)


# ----------------------------------------------------------------------------- building
_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_RE = re.compile(r"^(.*\.feed_forward\.experts\.\d+\.)(w1|w2|w3)(\.weight(?:_scale_inv)?)$")


def _qwen_expert_names(name: str) -> str:
    """Per-expert w1/w3/w2 -> gate/up/down_proj, so qwen3_moe's expert stacking reads LFM2 checkpoints."""
    m = _EXPERT_RE.match(name)
    return f"{m.group(1)}{_EXPERT_NAMES[m.group(2)]}{m.group(3)}" if m else name


def _layer_types(cfg: dict) -> list[str]:
    default = None
    if cfg.get("layer_types") is None and cfg.get("full_attn_idxs") is not None:  # older LFM2 configs
        idxs = set(cfg["full_attn_idxs"])
        default = ["full_attention" if i in idxs else "conv" for i in range(cfg["num_hidden_layers"])]
    return _hybrid.layer_types(cfg, LAYER_TYPES, default)


def _int(cfg: dict, key: str, default=None, minimum: int = 1) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"config.json: expected an integer {key} >= {minimum}, got {v!r}")
    return v


def _build_moe(src: _common.TensorSource, cfg: dict, prefix: str, *, fp8: bool) -> Lfm2SparseMoe:
    from ember.models._weights import fp8_experts
    E, H, I = _int(cfg, "num_experts"), cfg["hidden_size"], _int(cfg, "moe_intermediate_size")
    top_k = cfg.get("num_experts_per_tok")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"config.json: expected num_experts_per_tok in [1, {E}], got {top_k!r}")
    router = src.get(f"{prefix}.gate.weight", (E, H))
    bias = src.get(f"{prefix}.expert_bias", (E,), dtype=torch.float32) if cfg.get("use_expert_bias", True) else None
    gate_up, down, s_gu, s_d = qwen3_moe._expert_weights(src, prefix, E, H, I)
    args = (top_k, bool(cfg.get("norm_topk_prob", True)), float(cfg.get("routed_scaling_factor", 1.0)))
    if s_gu is not None or fp8:
        gate_up, down, s_gu, s_d = fp8_experts(src, gate_up, down, s_gu, s_d)
        return Lfm2SparseMoe(router, bias, gate_up, down, *args, gate_up_scale=s_gu, down_scale=s_d)
    return Lfm2SparseMoe(router, bias, gate_up.to(src.device, src.dtype), down.to(src.device, src.dtype), *args)


def _build_conv(src: _common.TensorSource, cfg: dict, prefix: str, *, fp8: bool) -> ShortConv:
    H, K, bias = cfg["hidden_size"], _int(cfg, "conv_L_cache", 3), bool(cfg.get("conv_bias", False))
    w_name = f"{prefix}.conv.weight"
    shape = _hybrid.raw_shape(src, w_name)
    if len(shape) != 3 or shape[1] != 1:
        raise ValueError(f"checkpoint tensor {w_name}: expected a depthwise conv weight [H, 1, K], got {shape}")
    _hybrid.check_dim("hidden_size", H, w_name, shape, 0)
    _hybrid.check_dim("conv_L_cache", K, w_name, shape, 2)
    conv_w = src.get(w_name, (H, 1, K))[:, 0].contiguous()
    conv_b = src.get(f"{prefix}.conv.bias", (H,)) if bias else None
    in_proj = _common.make_linear(src, f"{prefix}.in_proj", 3 * H, H, fp8=fp8, bias=bias)
    out_proj = _common.make_linear(src, f"{prefix}.out_proj", H, H, fp8=fp8, bias=bias)
    return ShortConv(in_proj, conv_w, conv_b, out_proj)


def _attention_config(cfg: dict) -> _common.AttentionConfig:
    _common.check_default_rope(cfg)
    rope = cfg.get("rope_parameters") or {}
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if H % nh:
        raise ValueError(f"config.json: hidden_size={H} is not a multiple of num_attention_heads={nh}")
    kvh = _int(cfg, "num_key_value_heads", nh)
    if nh % kvh:
        raise ValueError(f"config.json: num_attention_heads={nh} is not a multiple of num_key_value_heads={kvh}")
    return _common.AttentionConfig(hidden_size=H, num_heads=nh, num_kv_heads=kvh, head_dim=cfg.get("head_dim") or H // nh,
                                   rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1000000.0))),
                                   rms_norm_eps=float(cfg.get("norm_eps", 1e-5)))


@_common.missing_as_value_error
def build(src: _common.TensorSource, cfg: dict, *, fp8: bool, max_seq_len: int) -> _hybrid.HybridLM:
    _common.check_positive(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    types = _layer_types(cfg)
    attn = _attention_config(cfg)
    H, V, eps = attn.hidden_size, cfg["vocab_size"], attn.rms_norm_eps
    n_dense = _int(cfg, "num_dense_layers", 2, minimum=0)
    src = _hybrid.renamed(src, _qwen_expert_names)
    embed = src.get("model.embed_tokens.weight", (V, H))
    layers = []
    for i, kind in enumerate(types):
        p = f"model.layers.{i}"
        if kind == "conv":
            mixer = _build_conv(src, cfg, f"{p}.conv", fp8=fp8)
        else:
            a = f"{p}.self_attn"
            c = attn
            qkv = _common.concat_linear(src, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"],
                                        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                         c.num_kv_heads * c.head_dim], H, fp8=fp8)
            o = _common.make_linear(src, f"{a}.out_proj", H, c.num_heads * c.head_dim, fp8=fp8)
            mixer = _common.Attention(c, qkv, o, src.get(f"{a}.q_layernorm.weight", (c.head_dim,)),
                                      src.get(f"{a}.k_layernorm.weight", (c.head_dim,)))
        f = f"{p}.feed_forward"
        if i < n_dense:
            I = _int(cfg, "intermediate_size")
            mlp = _common.DenseMLP(_common.concat_linear(src, [f"{f}.w1", f"{f}.w3"], [I, I], H, fp8=fp8),
                                   _common.make_linear(src, f"{f}.w2", H, I, fp8=fp8))
        else:
            mlp = _build_moe(src, cfg, f, fp8=fp8)
        layers.append(_common.DecoderLayer(mixer, mlp, src.get(f"{p}.operator_norm.weight", (H,)),
                                           src.get(f"{p}.ffn_norm.weight", (H,)), eps))
    norm = src.get("model.embedding_norm.weight", (H,))
    tied = cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))
    if tied:
        if src.has("lm_head.weight"):  # a tied checkpoint may still carry the copy; transformers ignores it
            src.raw("lm_head.weight", (V, H))
        lm_head = _common.Linear(embed)  # shares storage with the embedding
    elif src.has("lm_head.weight"):
        lm_head = _common.Linear(src.get("lm_head.weight", (V, H)))
    else:
        raise _common.missing_error(["lm_head.weight"])
    return _hybrid.HybridLM(embed, layers, norm, lm_head, attn, max_seq_len)
