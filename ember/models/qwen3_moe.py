"""Qwen3-MoE, HF ``model_type`` "qwen3_moe" (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder
with a sparse MoE block in place of the MLP (router: fp32 softmax over E experts, top-k,
renormalised when ``norm_topk_prob``; experts: down(silu(gate) * up)).

Layers listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid keep a dense MLP.
Expert weights are stacked per layer ([E, 2I, H] gate rows first, [E, H, I]) whatever the checkpoint
holds: transformers 5.17's stacked ``mlp.experts.gate_up_proj`` / ``down_proj`` or per-expert
``mlp.experts.N.{gate,up,down}_proj.weight`` (what save_pretrained writes and HF FP8 checkpoints use).

Example:
    >>> model = ember.load("path/to/Qwen3-30B-A3B", fp8=True)
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from ember.models import _common

# the module, not the lazily exported function ember.ops.moe
moe_ops = importlib.import_module("ember.ops.moe")

MODEL_TYPE = "qwen3_moe"


class SparseMoe(nn.Module):
    """Router GEMV, then ember.ops.moe (routing fused into the expert dispatch)."""

    def __init__(self, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
                 renormalize: bool, gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)              # [E, H]
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=False)        # [E, 2I, H]
        self.w_down = nn.Parameter(w_down, requires_grad=False)              # [E, H, I]
        self.gate_up_scale = None if gate_up_scale is None else nn.Parameter(gate_up_scale, requires_grad=False)
        self.down_scale = None if down_scale is None else nn.Parameter(down_scale, requires_grad=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])                                       # [T, H]
        if x.shape[0] <= moe_ops.DECODE_MAX_TOKENS:
            # decode: router GEMV + routing in one launch (H200 step 2.734-2.743 ms vs 2.804-2.807 for
            # cuBLAS + the route kernel, bench/results/h200/step_variants_pdl.json)
            w, ids = moe_ops.moe_route_hidden(x, self.router, self.top_k, renormalize=self.renormalize)
            y = moe_ops.moe_experts(x, self.w_gate_up, self.w_down, w, ids, gate_up_scale=self.gate_up_scale,
                                    down_scale=self.down_scale, check=False)
        else:
            logits = F.linear(x, self.router)                                # [T, E]
            y = moe_ops.moe(x, logits, self.w_gate_up, self.w_down, self.top_k, renormalize=self.renormalize,
                            gate_up_scale=self.gate_up_scale, down_scale=self.down_scale)
        return y.reshape(h.shape)

    def add_norm_forward(self, a: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float):
        """``forward(add_rmsnorm(a, residual))`` with the norm folded into the router launch (decode)."""
        return add_norm_route_experts(self, a, residual, norm_weight, eps, renormalize=self.renormalize)

    def add_norm_forward_prescaled(self, a: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                                   eps: float, next_norm_weight: torch.Tensor):
        """:meth:`add_norm_forward` returning (h, h * next_norm_weight) for the next layer's deferred
        pre-attention norm (``CausalLM._run``), or None where that does not apply."""
        return add_norm_route_experts(self, a, residual, norm_weight, eps, next_norm_weight,
                                      renormalize=self.renormalize)


def add_norm_route_experts(moe: nn.Module, a: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                           eps: float, next_norm_weight: torch.Tensor | None = None,
                           **route) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``moe``'s decode forward of ``add_rmsnorm(a, residual, norm_weight)``, the norm in the router's
    launch (``ember.ops.add_rmsnorm_route_hidden``, ``route`` its routing arguments), then the experts.

    Returns ``(out, new_residual)``, or None where the fold does not apply (more than
    DECODE_MAX_TOKENS tokens): the caller then runs the norm and ``moe.forward``. Saves one launch
    per layer (H200 step 2.607 -> 2.593 ms at batch 1, 7.88 -> 7.67 at batch 8; ARCHITECTURE.md).
    With ``next_norm_weight``: the experts' last launch writes the next residual h = out +
    new_residual and h * next_norm_weight instead (``ember.ops.moe_experts_add_scale``: the next
    layer's pre-attention norm without its 1 / rms), and this returns ``(h, scaled)``.
    """
    x = a.reshape(-1, a.shape[-1])
    if x.shape[0] > moe_ops.DECODE_MAX_TOKENS:
        return None
    normed, new_res, w, ids = moe_ops.add_rmsnorm_route_hidden(x, residual.reshape(x.shape), norm_weight, moe.router,
                                                               moe.top_k, eps=eps, **route)
    scales = dict(gate_up_scale=moe.gate_up_scale, down_scale=moe.down_scale, check=False)  # ids: in range
    if next_norm_weight is not None:
        h, scaled = moe_ops.moe_experts_add_scale(normed, moe.w_gate_up, moe.w_down, w, ids, new_res,
                                                  next_norm_weight, **scales)
        return h.reshape(a.shape), scaled.reshape(a.shape)
    y = moe_ops.moe_experts(normed, moe.w_gate_up, moe.w_down, w, ids, **scales)
    return y.reshape(a.shape), new_res.reshape(a.shape)


def _num_experts(cfg: dict) -> int:
    e = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not isinstance(e, int) or e <= 0:
        raise ValueError(f"config.json: expected a positive integer num_experts, got {e!r}")
    return e


def _expert_weights(src: _common.TensorSource, prefix: str, E: int, H: int, I: int):
    """Stacked (w_gate_up [E, 2I, H], w_down [E, H, I], gate_up_scale_inv, down_scale_inv) as stored
    (scales None unless the checkpoint is FP8: per-expert 128x128 block scales, stacked)."""
    stacked = f"{prefix}.experts.gate_up_proj"
    if src.has(stacked):
        return src.raw(stacked, (E, 2 * I, H)), src.raw(f"{prefix}.experts.down_proj", (E, H, I)), None, None
    names = [f"{prefix}.experts.{e}.{p}.weight" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")]
    missing = [n for n in names if not src.has(n)]
    if missing:
        raise _common.missing_error(missing + ([stacked] if len(missing) == len(names) else []))
    gate = [src.raw(f"{prefix}.experts.{e}.gate_proj.weight", (I, H)) for e in range(E)]
    up = [src.raw(f"{prefix}.experts.{e}.up_proj.weight", (I, H)) for e in range(E)]
    down = torch.stack([src.raw(f"{prefix}.experts.{e}.down_proj.weight", (H, I)) for e in range(E)])
    gate_up = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up)])
    if not src.has(f"{prefix}.experts.0.gate_proj.weight_scale_inv"):
        return gate_up, down, None, None
    b = moe_ops.SCALE_BLOCK
    cdiv = lambda a, n: -(-a // n)  # noqa: E731
    sg = [src.raw(f"{prefix}.experts.{e}.gate_proj.weight_scale_inv", (cdiv(I, b), cdiv(H, b))) for e in range(E)]
    su = [src.raw(f"{prefix}.experts.{e}.up_proj.weight_scale_inv", (cdiv(I, b), cdiv(H, b))) for e in range(E)]
    sd = torch.stack([src.raw(f"{prefix}.experts.{e}.down_proj.weight_scale_inv", (cdiv(H, b), cdiv(I, b)))
                      for e in range(E)])
    return gate_up, down, torch.stack([torch.cat([g, u], 0) for g, u in zip(sg, su)]), sd


def build_moe(src: _common.TensorSource, cfg: dict, prefix: str, *, fp8: bool) -> SparseMoe:
    from ember.models._weights import fp8_experts
    E, H, I = _num_experts(cfg), cfg["hidden_size"], cfg["moe_intermediate_size"]
    top_k = cfg.get("num_experts_per_tok")
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"config.json: expected num_experts_per_tok in [1, {E}], got {top_k!r}")
    router = src.get(f"{prefix}.gate.weight", (E, H))
    gate_up, down, s_gu, s_d = _expert_weights(src, prefix, E, H, I)
    renorm = bool(cfg.get("norm_topk_prob", False))
    if s_gu is not None or fp8:
        gate_up, down, s_gu, s_d = fp8_experts(src, gate_up, down, s_gu, s_d)
        return SparseMoe(router, gate_up, down, top_k, renorm, s_gu, s_d)
    return SparseMoe(router, gate_up.to(src.device, src.dtype), down.to(src.device, src.dtype), top_k, renorm)


@_common.missing_as_value_error
def build(src: _common.TensorSource, cfg: dict, *, fp8: bool, max_seq_len: int) -> _common.CausalLM:
    _common.check_positive(cfg, "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "moe_intermediate_size")
    attn = _common.AttentionConfig.from_hf(cfg)
    E = _num_experts(cfg)
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_layers = set(cfg.get("mlp_only_layers") or [])

    def make_mlp(i: int, prefix: str):
        if i not in dense_layers and E > 0 and (i + 1) % step == 0:
            return build_moe(src, cfg, prefix, fp8=fp8)
        return _common.build_dense_mlp(src, prefix, attn.hidden_size, cfg["intermediate_size"], fp8=fp8)

    return _common.build_causal_lm(src, cfg, attn, make_mlp, fp8=fp8, max_seq_len=max_seq_len)
