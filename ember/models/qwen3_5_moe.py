"""Qwen3.5-MoE / Qwen3.6-MoE text model, HF ``model_type`` "qwen3_5_moe" (the released
image-text checkpoints: text weights under ``model.language_model.``, the vision tower and the
multi-token-prediction head ignored) and "qwen3_5_moe_text" (``Qwen3_5MoeForCausalLM``).

Layers follow ``layer_types`` (default: every ``full_attention_interval``-th layer is attention,
the rest gated DeltaNet); every layer has a sparse MoE with a shared expert.

* Gated DeltaNet: one fused projection for ``in_proj_qkv | in_proj_z | in_proj_b | in_proj_a``; a
  depthwise causal conv (``linear_conv_kernel_dim`` taps, SiLU) over q|k|v; the gated delta rule
  (``ember.ops.gated_delta_rule``: q, k L2-normalised, ``beta = sigmoid(b)``, log decay
  ``g = -exp(A_log) * softplus(a + dt_bias)``); then ``RMSNorm(o) * weight * silu(z)`` per value
  head (plain weight) and ``out_proj``. Cache: conv state [B, conv_dim, K-1] in the model dtype and
  recurrent state [B, HV, DK, DV] float32.
* Gated attention: ``q_proj`` yields, per head, the query then a gate; ``o_proj(attn * sigmoid(gate))``.
  q/k RMSNorm with the ``(1 + weight)`` convention; RoPE on the first ``partial_rotary_factor *
  head_dim`` dims of each head only.
* MoE: softmax top-k (always renormalised) through ``ember.ops.moe``, plus a shared SwiGLU expert
  scaled by ``sigmoid(shared_expert_gate(h))``. Where it can (float or fp8 weights, shared width =
  expert width, matching scale layouts) the build stores the shared expert as expert E and its gate as
  router row E, so one routing launch and the two expert GEMVs do it all (``FoldedSharedMoe``).
* Norms (input, post-attention, final, q/k): ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` in float32;
  ember stores ``1 + weight`` in float32 so its RMSNorm computes exactly that.

Partial rotary with ember's fused decode kernel (full rotate-half RoPE): the q and k head dims are
permuted at load to ``[rot_a, pass_a, rot_b, pass_b]`` (q_norm / k_norm likewise) and the RoPE table
is ``cos = [cos_rot, 1]``, ``sin = [sin_rot, 0]``; a full rotate-half over that layout rotates the
pairs transformers rotates and passes the rest through unchanged, and q.k is unchanged by a
permutation applied to both.

Example:
    >>> model = ember.load("path/to/Qwen3.6-35B-A3B")
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ember.ops
from ember.models import _common, _hybrid, qwen3_moe
from ember.models.qwen3_moe import moe_ops

MODEL_TYPE = "qwen3_5_moe"
LAYER_TYPES = ("linear_attention", "full_attention")
_IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")


# ----------------------------------------------------------------------------- gated DeltaNet
class GatedDeltaNet(nn.Module):
    recurrent = True  # its caches are states each step rewrites, not an append-only KV cache

    def __init__(self, proj: nn.Module, proj_ba: nn.Module, conv_weight: torch.Tensor, a_log: torch.Tensor,
                 dt_bias: torch.Tensor, norm: torch.Tensor, out_proj: nn.Module, *, num_k_heads: int,
                 num_v_heads: int, k_dim: int, v_dim: int, eps: float):
        super().__init__()
        self.proj, self.proj_ba, self.out_proj = proj, proj_ba, out_proj  # [qkv | z], [b | a]
        self.conv_weight = nn.Parameter(conv_weight, requires_grad=False)             # [conv_dim, K]
        # float32 as transformers computes them (A_log.float().exp(), a.float() + dt_bias)
        self.neg_a = nn.Parameter(-a_log.float().exp(), requires_grad=False)           # [HV]
        self.dt_bias = nn.Parameter(dt_bias.float(), requires_grad=False)              # [HV]
        self.norm = nn.Parameter(norm, requires_grad=False)                            # [DV]
        self.hk, self.hv, self.dk, self.dv, self.eps = num_k_heads, num_v_heads, k_dim, v_dim, eps
        kd, vd = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * kd + vd
        self.split = [self.conv_dim, vd]                                               # qkv | z

    def cache_spec(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype):
        K = self.conv_weight.shape[1]
        return (((max_batch_size, self.conv_dim, K - 1), dtype),
                ((max_batch_size, self.hv, self.dk, self.dv), torch.float32))

    def _mix(self, h: torch.Tensor, conv_state, state, last_index: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, H] -> [B, T, H], continuing from (and updating) the given states (None: zeros).

        Six launches at T = 1 (3 GEMVs, conv, delta rule, gated norm; counted by
        tests/models/test_qwen3_5_moe.py): the delta-rule kernel computes ``g`` and ``beta`` from the
        raw ``a`` / ``b`` projections, one gated RMSNorm launch does the norm and the ``silu(z)`` gate,
        and the conv writes [B, T, C] directly. The torch composition of the same math is 16 launches;
        on the H200 this took Qwen3.5-35B-A3B bf16 decode from 326 to 397 tok/s with the folded shared
        expert (bench/results/h200/moe_hybrid.json), bit for bit the same values (libdevice expf /
        log1pf and IEEE division, as torch's CUDA kernels compute them).
        """
        B, T, _ = h.shape
        qkv, z = self.proj(h).split(self.split, dim=-1)
        b, a = self.proj_ba(h).split([self.hv, self.hv], dim=-1)
        before = None
        if last_index is not None:
            # padding after the real tokens leaves the recurrent state as it was: decay exp(0) = 1
            # (softplus(-inf) = 0) and beta = sigmoid(-inf) = 0, exactly, in the kernel and in torch
            pad = (torch.arange(T, device=h.device) > last_index)[None, :, None]
            a, b = a.masked_fill(pad, float("-inf")), b.masked_fill(pad, float("-inf"))
            before = conv_state.clone()
        conv_in = qkv.transpose(1, 2)
        qkv = ember.ops.causal_conv1d(conv_in, self.conv_weight, conv_state=conv_state,
                                      activation="silu", channels_last=True).transpose(1, 2)  # [B, T, conv_dim]
        if before is not None:
            conv_state.copy_(_hybrid.conv_state_at(before, conv_in, last_index))
        kd = self.hk * self.dk
        q, k, v = qkv.split([kd, kd, self.hv * self.dv], dim=-1)
        o = ember.ops.gated_delta_rule(q.reshape(B, T, self.hk, self.dk), k.reshape(B, T, self.hk, self.dk),
                                       v.reshape(B, T, self.hv, self.dv), state=state, a=a, dt_bias=self.dt_bias,
                                       neg_a=self.neg_a, b=b)
        o = ember.ops.norm.rmsnorm_gated(o, z.reshape(B, T, self.hv, self.dv), self.norm, self.eps)
        return self.out_proj(o.reshape(B, T, self.hv * self.dv))

    def prefill(self, h: torch.Tensor, cos, sin, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                start: int = 0, last_index: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, T, H] at positions start..start+T-1; writes the final conv and recurrent states into the
        cache (``start`` > 0: a later chunk, continuing from the states the cache holds). ``last_index``
        (int64 [1], on the device): the chunk's real tokens end there and padding follows, which the
        states leave out."""
        if cache is None:
            return self._mix(h, None, None)
        conv_state, state = cache[0][: h.shape[0]], cache[1][: h.shape[0]]
        if not start:
            conv_state.zero_()  # a fresh sequence: whatever a previous request left is discarded
            state.zero_()
        return self._mix(h, conv_state, state, last_index)

    def decode(self, h: torch.Tensor, positions, seq_lens, cos, sin, cache) -> torch.Tensor:
        """h [B, H], one token per row -> [B, H]; advances both states in place."""
        B = h.shape[0]
        return self._mix(h[:, None], cache[0][:B], cache[1][:B])[:, 0]


# ----------------------------------------------------------------------------- gated attention
class GatedAttention(nn.Module):
    """One projection for [q | k | v | gate]; the shared ``_common.Attention`` (with identity
    projections) does q/k norm, RoPE, the cache and attention; output ``o(attn * sigmoid(gate))``."""

    def __init__(self, cfg: _common.AttentionConfig, proj: nn.Module, o: nn.Module, q_norm: torch.Tensor,
                 k_norm: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.proj, self.o = proj, o
        self.core = _common.Attention(cfg, nn.Identity(), nn.Identity(), q_norm, k_norm)
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.split = [qkv, cfg.num_heads * cfg.head_dim]

    def cache_spec(self, max_batch_size: int, max_seq_len: int, dtype: torch.dtype):
        return _hybrid.kv_cache_spec(max_batch_size, max_seq_len, dtype, self.cfg.num_kv_heads, self.cfg.head_dim)

    def prefill(self, h: torch.Tensor, cos, sin, cache=None, start: int = 0) -> torch.Tensor:
        qkv, gate = self.proj(h).split(self.split, dim=-1)
        return self.o(self.core.prefill(qkv, cos, sin, cache, start) * torch.sigmoid(gate))

    def decode(self, h: torch.Tensor, positions, seq_lens, cos, sin, cache) -> torch.Tensor:
        qkv, gate = self.proj(h).split(self.split, dim=-1)
        return self.o(self.core.decode(qkv, positions, seq_lens, cos, sin, cache) * torch.sigmoid(gate))


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """New position -> old position of a head's dims: [rot_a, pass_a, rot_b, pass_b] (see module doc)."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(r), rotary_dim + torch.arange(p), r + torch.arange(r),
                      rotary_dim + p + torch.arange(p)])


def rope_tables(head_dim: int, rotary_dim: int, theta: float, max_seq_len: int, device):
    """cos, sin [max_seq_len, head_dim / 2] float32 for the permuted layout: the rotary frequencies of
    transformers' partial RoPE, then cos = 1, sin = 0 over the pass-through half."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    rest = (head_dim - rotary_dim) // 2
    cos = torch.cat([freqs.cos(), torch.ones(max_seq_len, rest)], 1)
    sin = torch.cat([freqs.sin(), torch.zeros(max_seq_len, rest)], 1)
    return cos.to(device), sin.to(device)


# ----------------------------------------------------------------------------- MoE with shared expert
class SharedExpertMoe(nn.Module):
    def __init__(self, routed: qwen3_moe.SparseMoe, shared: _common.DenseMLP, shared_gate: torch.Tensor):
        super().__init__()
        self.routed, self.shared = routed, shared
        self.shared_gate = nn.Parameter(shared_gate, requires_grad=False)             # [1, H]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.routed(h) + torch.sigmoid(F.linear(h, self.shared_gate)) * self.shared(h)


class FoldedSharedMoe(nn.Module):
    """The shared expert folded into the routed ones: expert E of ``w_gate_up`` / ``w_down`` and row E
    of ``router`` (its gate). ``moe_route_hidden(shared_expert_gate=True)`` appends it to every token
    with weight sigmoid(gate logit); ``moe_experts`` then runs top_k + 1 experts.

    Why: at decode the unfolded block is ~11 launches (route, 2 expert GEMVs, gate GEMV, sigmoid,
    shared gate_up, SiLU, multiply, down, multiply, add); folded it is 3. Numerics: the shared
    expert's output joins the float32 sum over experts and its gate stays float32, where the
    unfolded path rounds gate, product and sum to the model dtype (same value up to that rounding).
    H200, Qwen3.5-35B-A3B bf16 decode: 303 -> 397 tok/s (bench/results/h200/moe_hybrid.json).
    """

    def __init__(self, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
                 gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)              # [E + 1, H]
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=False)        # [E + 1, 2I, H]
        self.w_down = nn.Parameter(w_down, requires_grad=False)              # [E + 1, H, I]
        # fp8 experts: row scales [E + 1, 2I] / [E + 1, H] or 128-block scales, as ember.ops.moe takes them
        self.gate_up_scale = None if gate_up_scale is None else nn.Parameter(gate_up_scale, requires_grad=False)
        self.down_scale = None if down_scale is None else nn.Parameter(down_scale, requires_grad=False)
        self.top_k = top_k
        self.experts_read = top_k + 1  # per token: the routed ones and the shared one

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])
        w, ids = moe_ops.moe_route_hidden(x, self.router, self.top_k, renormalize=True, shared_expert_gate=True)
        y = moe_ops.moe_experts(x, self.w_gate_up, self.w_down, w, ids, gate_up_scale=self.gate_up_scale,
                                down_scale=self.down_scale, check=False)
        return y.reshape(h.shape)

    def add_norm_forward(self, a: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float):
        """``forward(add_rmsnorm(a, residual))`` with the norm folded into the router launch (decode)."""
        return qwen3_moe.add_norm_route_experts(self, a, residual, norm_weight, eps, renormalize=True,
                                                shared_expert_gate=True)


def fold_shared_expert(moe: SharedExpertMoe) -> FoldedSharedMoe | None:
    """The folded form of ``moe``, or None when it does not apply (a shared expert of another width,
    biases, activation quantization, or fp8 scales of another granularity than the routed experts')."""
    r, sh = moe.routed, moe.shared
    if r.gate_up_scale is None:
        if type(sh.gate_up) is not _common.Linear or type(sh.down) is not _common.Linear:
            return None
        scales = None
    else:
        scales = _shared_fp8_scales(r, sh)
        if scales is None:
            return None
    gu, dn = sh.gate_up.weight, sh.down.weight
    if sh.gate_up.bias is not None or sh.down.bias is not None or gu.shape != r.w_gate_up.shape[1:] \
            or dn.shape != r.w_down.shape[1:] or gu.dtype != r.w_gate_up.dtype or dn.dtype != r.w_down.dtype:
        return None
    gate_up_scale = down_scale = None
    if scales is not None:
        gate_up_scale = torch.cat([r.gate_up_scale, scales[0][None]])
        down_scale = torch.cat([r.down_scale, scales[1][None]])
    return FoldedSharedMoe(torch.cat([r.router, moe.shared_gate.to(r.router.dtype)]),
                           torch.cat([r.w_gate_up, gu[None]]), torch.cat([r.w_down, dn[None]]), r.top_k,
                           gate_up_scale, down_scale)


def _shared_fp8_scales(routed: qwen3_moe.SparseMoe, shared: _common.DenseMLP):
    """The shared expert's fp8 weight scales in the routed experts' per-expert layout (row: [2I], [H];
    128-block: [2I/128, H/128], [H/128, I/128]), or None when they do not match."""
    from ember.nn import Fp8Linear
    out = []
    for lin, ref in ((shared.gate_up, routed.gate_up_scale), (shared.down, routed.down_scale)):
        if type(lin) is not Fp8Linear or lin.activations is not None:
            return None
        s = lin.weight_scale
        if ref.dim() == 2:  # per row
            if lin.granularity != "row":
                return None
            s = s.reshape(-1)
        elif lin.granularity != "block":
            return None
        if s.shape != ref.shape[1:]:
            return None
        out.append(s.to(ref.dtype))
    return out


# ----------------------------------------------------------------------------- config
def text_config(cfg: dict) -> dict:
    """The text model's config: ``text_config`` of an image-text checkpoint, else the config itself."""
    if cfg.get("model_type") == "qwen3_5_moe" or "text_config" in cfg:
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise ValueError("config.json: model_type 'qwen3_5_moe' expects a 'text_config' object")
        return tc
    return cfg


def _int(cfg: dict, key: str, default=None, minimum: int = 1) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"config.json: expected an integer {key} >= {minimum}, got {v!r}")
    return v


def _layer_types(cfg: dict) -> list[str]:
    n = cfg["num_hidden_layers"]
    interval = _int(cfg, "full_attention_interval", 4)
    default = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return _hybrid.layer_types(cfg, LAYER_TYPES, default)


def attention_config(cfg: dict) -> tuple[_common.AttentionConfig, int]:
    """(attention config, rotary dims per head) from the text config."""
    _common.check_default_rope(cfg)
    rope = cfg.get("rope_parameters") or {}
    if cfg.get("attention_bias", False):
        raise ValueError("config.json: attention_bias=true is not supported for qwen3_5_moe")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (expected 'silu')")
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    kvh = _int(cfg, "num_key_value_heads", nh)
    if nh % kvh:
        raise ValueError(f"config.json: num_attention_heads={nh} is not a multiple of num_key_value_heads={kvh}")
    D = _int(cfg, "head_dim", 256)
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    rot = int(D * factor)
    if not 0 < rot <= D or rot % 2 or (D - rot) % 2:
        raise ValueError(f"config.json: partial_rotary_factor={factor} gives {rot} rotary dims of head_dim={D}; "
                         "expected an even number in (0, head_dim] with an even remainder")
    attn = _common.AttentionConfig(hidden_size=H, num_heads=nh, num_kv_heads=kvh, head_dim=D,
                                   rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000000.0))),
                                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)))
    return attn, rot


# ----------------------------------------------------------------------------- building
def _one_plus(src: _common.TensorSource, name: str, n: int) -> torch.Tensor:
    """A ``(1 + weight)`` norm weight in float32, as transformers applies it."""
    return 1.0 + src.get(name, (n,), dtype=torch.float32)


def _build_deltanet(src: _common.TensorSource, cfg: dict, prefix: str, *, fp8: bool, eps: float) -> GatedDeltaNet:
    H = cfg["hidden_size"]
    hk, hv = _int(cfg, "linear_num_key_heads", 16), _int(cfg, "linear_num_value_heads", 32)
    dk, dv = _int(cfg, "linear_key_head_dim", 128), _int(cfg, "linear_value_head_dim", 128)
    K = _int(cfg, "linear_conv_kernel_dim", 4)
    if hv % hk:
        raise ValueError(f"config.json: linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
    conv_dim = 2 * hk * dk + hv * dv
    w_name = f"{prefix}.conv1d.weight"
    shape = _hybrid.raw_shape(src, w_name)
    if len(shape) != 3 or shape[1] != 1:
        raise ValueError(f"checkpoint tensor {w_name}: expected a depthwise conv weight [C, 1, K], got {shape}")
    _hybrid.check_dim("linear_num_key_heads * linear_key_head_dim * 2 + linear_num_value_heads * "
                      "linear_value_head_dim", conv_dim, w_name, shape, 0)
    _hybrid.check_dim("linear_conv_kernel_dim", K, w_name, shape, 2)
    a_shape = _hybrid.raw_shape(src, f"{prefix}.A_log")
    _hybrid.check_dim("linear_num_value_heads", hv, f"{prefix}.A_log", a_shape, 0)
    n_shape = _hybrid.raw_shape(src, f"{prefix}.norm.weight")
    _hybrid.check_dim("linear_value_head_dim", dv, f"{prefix}.norm.weight", n_shape, 0)
    proj = _common.concat_linear(src, [f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z"], [conv_dim, hv * dv], H,
                                 fp8=fp8)
    # The beta / decay projections ([HV, H] each, 2 x 32 rows in the released models) never fill a
    # 128-row FP8 block: fused with qkv|z they forced the loader to requantise the whole projection
    # per row (one more rounding than the checkpoint). Apart, qkv|z keeps its checkpoint blocks and
    # these tiny rows stay in the model dtype (dequantised exactly from an FP8 checkpoint).
    proj_ba = _common.Linear(torch.cat([_hybrid.float_weight(src, f"{prefix}.in_proj_b", hv, H),
                                        _hybrid.float_weight(src, f"{prefix}.in_proj_a", hv, H)]))
    out = _common.make_linear(src, f"{prefix}.out_proj", H, hv * dv, fp8=fp8)
    return GatedDeltaNet(proj, proj_ba, src.get(w_name, (conv_dim, 1, K))[:, 0].contiguous(), src.get(f"{prefix}.A_log", (hv,)),
                         src.get(f"{prefix}.dt_bias", (hv,)), src.get(f"{prefix}.norm.weight", (dv,)), out,
                         num_k_heads=hk, num_v_heads=hv, k_dim=dk, v_dim=dv, eps=eps)


def _build_attention(src: _common.TensorSource, c: _common.AttentionConfig, rot: int, prefix: str, *,
                     fp8: bool) -> GatedAttention:
    H, nh, kvh, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    perm = rotary_permutation(D, rot).to(src.device)
    qg = _hybrid.float_weight(src, f"{prefix}.q_proj", 2 * nh * D, H).view(nh, 2 * D, H)
    q, gate = qg[:, :D][:, perm], qg[:, D:]
    k = _hybrid.float_weight(src, f"{prefix}.k_proj", kvh * D, H).view(kvh, D, H)[:, perm]
    v = _hybrid.float_weight(src, f"{prefix}.v_proj", kvh * D, H)
    fused = torch.cat([q.reshape(nh * D, H), k.reshape(kvh * D, H), v, gate.reshape(nh * D, H)])
    o = _common.make_linear(src, f"{prefix}.o_proj", H, nh * D, fp8=fp8)
    return GatedAttention(c, _hybrid.linear_from_weight(fused, fp8=fp8), o,
                          _one_plus(src, f"{prefix}.q_norm.weight", D)[perm], _one_plus(src, f"{prefix}.k_norm.weight", D)[perm])


def _build_moe(src: _common.TensorSource, cfg: dict, prefix: str, *, fp8: bool) -> SharedExpertMoe:
    H = cfg["hidden_size"]
    # transformers' Qwen3.5 router always renormalises the top-k probabilities
    routed = qwen3_moe.build_moe(src, {**cfg, "norm_topk_prob": True}, prefix, fp8=fp8)
    Is = _int(cfg, "shared_expert_intermediate_size")
    shared = _common.build_dense_mlp(src, f"{prefix}.shared_expert", H, Is, fp8=fp8)
    moe = SharedExpertMoe(routed, shared, src.get(f"{prefix}.shared_expert_gate.weight", (1, H)))
    return fold_shared_expert(moe) or moe


def _text_names(src: _common.TensorSource) -> _common.TensorSource:
    """Image-text checkpoints keep the text model under model.language_model.; drop that level."""
    if not any(n.startswith("model.language_model.") for n in src.names):
        return src
    return _hybrid.renamed(src, lambda n: "model." + n[len("model.language_model."):]
                           if n.startswith("model.language_model.") else n)


@_common.missing_as_value_error
def build(src: _common.TensorSource, cfg: dict, *, fp8: bool, max_seq_len: int) -> _hybrid.HybridLM:
    tc = text_config(cfg)
    _common.check_positive(tc, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "moe_intermediate_size")
    types = _layer_types(tc)
    attn, rot = attention_config(tc)
    H, V, eps = attn.hidden_size, tc["vocab_size"], attn.rms_norm_eps
    _hybrid.mark_unused_ok(src, _IGNORED_PREFIXES)
    src = _text_names(src)
    embed = src.get("model.embed_tokens.weight", (V, H))
    layers = []
    for i, kind in enumerate(types):
        p = f"model.layers.{i}"
        if kind == "linear_attention":
            mixer = _build_deltanet(src, tc, f"{p}.linear_attn", fp8=fp8, eps=eps)
        else:
            mixer = _build_attention(src, attn, rot, f"{p}.self_attn", fp8=fp8)
        layers.append(_common.DecoderLayer(mixer, _build_moe(src, tc, f"{p}.mlp", fp8=fp8),
                                           _one_plus(src, f"{p}.input_layernorm.weight", H),
                                           _one_plus(src, f"{p}.post_attention_layernorm.weight", H), eps))
    norm = _one_plus(src, "model.norm.weight", H)
    tied = tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    if src.has("lm_head.weight") and not tied:
        lm_head = _common.Linear(src.get("lm_head.weight", (V, H)))
    elif tied:
        if src.has("lm_head.weight"):
            src.raw("lm_head.weight", (V, H))
        lm_head = _common.Linear(embed)
    else:
        raise _common.missing_error(["lm_head.weight"])
    return _hybrid.HybridLM(embed, layers, norm, lm_head, attn, max_seq_len,
                            rope=rope_tables(attn.head_dim, rot, attn.rope_theta, max_seq_len, embed.device))
