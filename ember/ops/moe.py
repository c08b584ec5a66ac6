"""Fused mixture-of-experts: routing and the expert MLPs of a Qwen3-MoE layer.

* ``moe_route(router_logits, top_k)`` -> ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``:
  softmax over the E experts in float32, the k largest (ties go to the lower expert index), divided
  by their sum when ``renormalize`` (Qwen3-MoE's ``norm_topk_prob``).
* ``moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids)`` -> ``[T, H]`` in ``x.dtype``:
  ``out[t] = sum_j topk_weights[t, j] * w_down[e] @ (silu(g) * u)`` with ``[g; u] = w_gate_up[e] @ x[t]``,
  ``e = topk_ids[t, j]`` (transformers' Qwen3MoeExperts layout: gate_up_proj ``[E, 2I, H]`` with the
  gate rows first, down_proj ``[E, H, I]``).
* ``moe(x, router_logits, w_gate_up, w_down, top_k)``: both, routing fused into dispatch; what a
  model calls per MoE layer.
* ``moe_route_hidden(x, router_weight, top_k)``: ``moe_route(F.linear(x, router_weight), top_k)``, or
  with ``scoring="sigmoid"`` LFM2's routing (biased sigmoid selection, see the function),
  with the router GEMV and the routing in one launch on CUDA (up to 64 tokens): what a decode step
  calls before ``moe_experts``. The logits are rounded to ``x.dtype`` first, as F.linear returns them.
* ``add_rmsnorm_route_hidden(x, residual, norm_weight, router_weight, top_k)``: the decoder's
  post-attention ``add_rmsnorm`` and ``moe_route_hidden`` of its output, one launch on CUDA.
* ``moe_experts_add_scale(x, ..., residual, norm_weight)`` (decode, <= 16 tokens): ``h = moe_experts(x, ...) +
  residual`` and ``h * norm_weight``, i.e. the next layer's pre-attention ``add_rmsnorm`` without its
  1 / rms (which needs the whole row; ``qk_norm_rope_cache(prenorm=...)`` applies it), written by the
  down GEMV's (T=1) or the combine's epilogue on CUDA: the decode step's per-layer norm launch folded away.

Numerics (the spec the kernels are tested against): float32 math throughout, except that the
activation ``silu(g) * u`` is rounded once to ``x.dtype`` before the down projection (as every bf16
MoE implementation, transformers' included, does at that point; it lets the down projection run on
tensor cores), and the weighted sum over the k experts is accumulated in float32 and rounded once.

Weights are bf16 / fp16 / fp32 (the same dtype as ``x``) or float8_e4m3fn with decode scales,
``w ~= q.float() * scale``, either per output row (``gate_up_scale [E, 2I]``, ``down_scale [E, H]``) or
per 128x128 block as HF fine-grained FP8 checkpoints ship them (``gate_up_scale [E, ceil(2I/128),
ceil(H/128)]``, ``down_scale [E, ceil(H/128), ceil(I/128)]``); the scale's rank says which.

Paths on CUDA: T <= 16 tokens take the decode kernels (each selected expert's weights read once;
GEMVs with SiLU*up and the routing-weight combine fused); more tokens take the prefill kernels (pairs
sorted by expert on the device, grouped GEMM over the sorted blocks). Both are CUDA-graph capturable:
no host syncs, shapes depend only on T, k, E.

``check=True`` (default) also verifies, with a device sync, that every id is in ``[0, E)``; it is
skipped during CUDA-graph capture.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import _dispatch
from ember.ops import _checks
from ember.ops import norm as norm_ops

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # HF fine-grained FP8 checkpoints quantise in 128 x 128 blocks
DECODE_MAX_TOKENS = 16
MAX_EXPERTS = 1024
ID_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- validation
def _validate_route(router_logits, top_k, renormalize) -> int:
    _checks.tensor("router_logits", router_logits, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    return _validate_top_k(top_k, router_logits.shape[1], renormalize, "router_logits", "router_logits.shape[1]")


def _validate_top_k(top_k, E: int, renormalize, name: str, e_from: str) -> int:
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{name}: expected 1..{MAX_EXPERTS} experts, got {E}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: expected 1 <= top_k <= {E} ({e_from}), got {top_k}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    return top_k


SCORINGS = ("softmax", "sigmoid")


def _validate_route_hidden(x, router_weight, top_k, renormalize, scoring="softmax", expert_bias=None,
                           scaling=1.0, shared_expert_gate=False) -> int:
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    _checks.tensor("router_weight", router_weight, dtypes=(x.dtype,), ndim=2)
    _checks.same_device(x=x, router_weight=router_weight)
    if router_weight.shape[1] != x.shape[1]:
        raise ValueError(f"router_weight: expected shape [E, {x.shape[1]}] (x.shape[1] columns), "
                         f"got {tuple(router_weight.shape)}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    E = router_weight.shape[0]
    if expert_bias is not None:
        if scoring != "sigmoid":
            raise ValueError("expert_bias: only sigmoid scoring takes an expert bias")
        _checks.tensor("expert_bias", expert_bias, dtypes=_checks.FLOAT_DTYPES, ndim=1)
        _checks.same_device(x=x, expert_bias=expert_bias)
        if expert_bias.shape[0] != E:
            raise ValueError(f"expert_bias: expected shape [{E}] (router_weight.shape[0]), got {tuple(expert_bias.shape)}")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling < float("inf"):
        raise ValueError(f"scaling: expected a finite number > 0, got {scaling!r}")
    if scoring == "softmax" and scaling != 1.0:
        raise ValueError("scaling: only sigmoid scoring takes a routed scaling factor")
    if not isinstance(shared_expert_gate, bool):
        raise TypeError(f"shared_expert_gate: expected a bool, got {type(shared_expert_gate).__name__}")
    if shared_expert_gate:
        if scoring != "softmax":
            raise ValueError("shared_expert_gate: only softmax scoring has a shared expert gate row")
        if E < 2:
            raise ValueError(f"router_weight: expected >= 2 rows (experts, then the shared expert's gate), got {E}")
        return _validate_top_k(top_k, E - 1, renormalize, "router_weight", "router_weight.shape[0] - 1")
    return _validate_top_k(top_k, E, renormalize, "router_weight", "router_weight.shape[0]")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _validate_scale(name: str, scale, weight_name: str, weight: torch.Tensor) -> None:
    E, N, K = weight.shape
    if weight.dtype != FP8:
        if scale is not None:
            raise ValueError(f"{name}: expected None for {str(weight.dtype).replace('torch.', '')} {weight_name} "
                             "(scales are for float8_e4m3fn weights)")
        return
    if scale is None:
        raise ValueError(f"{name}: expected a scale tensor for float8_e4m3fn {weight_name}, got None")
    _checks.tensor(name, scale, dtypes=_checks.FLOAT_DTYPES)
    row, block = (E, N), (E, _ceil(N, SCALE_BLOCK), _ceil(K, SCALE_BLOCK))
    if tuple(scale.shape) not in (row, block):
        raise ValueError(f"{name}: expected shape {row} (per output row) or {block} (per 128x128 block) for "
                         f"{weight_name} of shape {tuple(weight.shape)}, got {tuple(scale.shape)}")


def _validate_weights(x, w_gate_up, w_down, gate_up_scale, down_scale) -> None:
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    _checks.tensor("w_gate_up", w_gate_up, dtypes=(x.dtype, FP8), ndim=3)
    _checks.tensor("w_down", w_down, dtypes=(w_gate_up.dtype,), ndim=3)
    _checks.same_device(x=x, w_gate_up=w_gate_up, w_down=w_down, gate_up_scale=gate_up_scale, down_scale=down_scale)
    H = x.shape[1]
    E, two_i, h_gu = w_gate_up.shape
    if h_gu != H:
        raise ValueError(f"w_gate_up: expected shape [E, 2I, {H}] (H = x.shape[1]), got {tuple(w_gate_up.shape)}")
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w_gate_up: expected an even, non-zero dim 1 (gate rows then up rows), got {tuple(w_gate_up.shape)}")
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"w_gate_up: expected 1..{MAX_EXPERTS} experts (shape[0]), got {E}")
    I = two_i // 2
    if tuple(w_down.shape) != (E, H, I):
        raise ValueError(f"w_down: expected shape {(E, H, I)} ([E, H, I] from w_gate_up {tuple(w_gate_up.shape)}), "
                         f"got {tuple(w_down.shape)}")
    _validate_scale("gate_up_scale", gate_up_scale, "w_gate_up", w_gate_up)
    _validate_scale("down_scale", down_scale, "w_down", w_down)


def _validate_topk(x, w_gate_up, topk_weights, topk_ids, check) -> None:
    _checks.tensor("topk_weights", topk_weights, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    _checks.tensor("topk_ids", topk_ids, dtypes=ID_DTYPES, ndim=2)
    _checks.same_device(x=x, topk_weights=topk_weights, topk_ids=topk_ids)
    T, E = x.shape[0], w_gate_up.shape[0]
    if topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids: expected {T} rows (x.shape[0]), got shape {tuple(topk_ids.shape)}")
    _checks.same_shape(topk_ids=topk_ids, topk_weights=topk_weights)
    if not 1 <= topk_ids.shape[1] <= E:
        raise ValueError(f"topk_ids: expected 1..{E} columns (E = w_gate_up.shape[0]), got shape {tuple(topk_ids.shape)}")
    if check and not _checks.capturing() and topk_ids.numel() and topk_ids.device.type != "meta":
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"topk_ids: expected ids in [0, {E}) (E = w_gate_up.shape[0]), got values in [{lo}, {hi}]")


# ----------------------------------------------------------------------------- reference
def moe_route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """The executable spec of routing: float32 softmax, stable top-k (ties -> lower index), renormalise."""
    probs = router_logits.float().softmax(dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = sorted_probs[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """One expert's weight ``[N, K]`` in float32: ``q.float() * scale`` (row or 128x128 block scale)."""
    if scale is None:
        return w.float()
    if scale.dim() == 1:
        return w.float() * scale.float()[:, None]
    N, K = w.shape
    full = scale.float().repeat_interleave(SCALE_BLOCK, 0)[:N].repeat_interleave(SCALE_BLOCK, 1)[:, :K]
    return w.float() * full


def moe_experts_reference(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale=None, down_scale=None):
    """The executable spec of the expert MLPs: one expert at a time over the tokens routed to it."""
    T, H = x.shape
    I = w_down.shape[2]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        wgu = dequantize_expert(w_gate_up[e], None if gate_up_scale is None else gate_up_scale[e])
        gu = xf[tok] @ wgu.T
        h = (F.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype).float()  # rounded once, as the module docstring says
        y = h @ dequantize_expert(w_down[e], None if down_scale is None else down_scale[e]).T
        out.index_add_(0, tok, topk_weights[tok, slot].float()[:, None] * y)
    return out.to(x.dtype)


def moe_experts_add_scale_reference(x, w_gate_up, w_down, topk_weights, topk_ids, residual, norm_weight,
                                    gate_up_scale=None, down_scale=None):
    """Spec: ``h = add_rmsnorm``'s residual sum of the experts' output (rounded to x.dtype) and
    ``residual`` (rounded again), and ``h * norm_weight`` in float32 rounded to x.dtype."""
    y = moe_experts_reference(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)
    h = (y.float() + residual.float()).to(x.dtype)
    return h, (h.float() * norm_weight.float()).to(x.dtype)


def moe_reference(x, router_logits, w_gate_up, w_down, top_k, renormalize=True, gate_up_scale=None, down_scale=None):
    w, ids = moe_route_reference(router_logits, top_k, renormalize)
    return moe_experts_reference(x, w_gate_up, w_down, w, ids, gate_up_scale, down_scale)


# ----------------------------------------------------------------------------- implementation
def _kernels():
    """ember.kernels.moe, imported on first use (after the interpreter is switched on where forced)."""
    _dispatch.prepare_triton()
    from ember.kernels import moe
    return moe


def _route_impl(router_logits, top_k, renormalize):
    if not _dispatch.use_triton(router_logits):
        return moe_route_reference(router_logits, top_k, renormalize)
    return _kernels().route(router_logits, top_k, renormalize)


def moe_route_hidden_reference(x, router_weight, top_k: int, renormalize: bool = True, scoring: str = "softmax",
                               expert_bias: torch.Tensor | None = None, scaling: float = 1.0,
                               shared_expert_gate: bool = False):
    """The spec of :func:`moe_route_hidden`: F.linear (logits in x.dtype), then moe_route_reference,
    or for sigmoid scoring: float32 sigmoid scores, the k largest of scores + bias (ties -> lower
    index), their unbiased scores / (sum + 1e-6) when ``renormalize``, times ``scaling``."""
    if scoring == "sigmoid":
        scores = F.linear(x, router_weight).float().sigmoid()
        choose = scores if expert_bias is None else scores + expert_bias.float()
        ids = torch.sort(choose, dim=-1, descending=True, stable=True).indices[:, :top_k]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return (weights * scaling).contiguous(), ids.to(torch.int32).contiguous()
    if shared_expert_gate:  # the last row gates a shared expert: id E - 1, weight sigmoid(logit), float32
        logits = F.linear(x, router_weight)
        w, ids = moe_route_reference(logits[:, :-1], top_k, renormalize)
        gate = logits[:, -1:].float().sigmoid()
        shared = torch.full_like(ids[:, :1], router_weight.shape[0] - 1)
        return torch.cat([w, gate], 1).contiguous(), torch.cat([ids, shared], 1).contiguous()
    return moe_route_reference(F.linear(x, router_weight), top_k, renormalize)


def _route_hidden_impl(x, router_weight, top_k, renormalize, scoring="softmax", expert_bias=None, scaling=1.0,
                       shared_expert_gate=False):
    plain = scoring == "softmax" and not shared_expert_gate
    if not _dispatch.use_triton(x) or (not plain and x.shape[0] > 64):
        return moe_route_hidden_reference(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling,
                                          shared_expert_gate)
    kmod = _kernels()
    if x.shape[0] > kmod.ROUTER_MAX_TOKENS:  # prefill: cuBLAS for the GEMM, then the route kernel
        return kmod.route(F.linear(x, router_weight), top_k, renormalize)
    return kmod.route_hidden(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling, shared_expert_gate)


def add_rmsnorm_route_hidden_reference(x, residual, norm_weight, router_weight, top_k: int, eps: float = 1e-6,
                                       renormalize: bool = True, scoring: str = "softmax",
                                       expert_bias: torch.Tensor | None = None, scaling: float = 1.0,
                                       shared_expert_gate: bool = False):
    """The spec of :func:`add_rmsnorm_route_hidden`: ``add_rmsnorm``, then ``moe_route_hidden`` of its output."""
    normed, new_residual = norm_ops.add_rmsnorm_reference(x, residual, norm_weight, eps)
    w, ids = moe_route_hidden_reference(normed, router_weight, top_k, renormalize, scoring, expert_bias, scaling,
                                        shared_expert_gate)
    return normed, new_residual, w, ids


def _add_norm_route_impl(x, residual, norm_weight, router_weight, top_k, eps, renormalize, scoring="softmax",
                         expert_bias=None, scaling=1.0, shared_expert_gate=False):
    kmod = _kernels() if _dispatch.use_triton(x) else None
    if kmod is None or x.shape[0] > kmod.ROUTER_MAX_TOKENS or x.shape[1] > kmod.ADD_NORM_MAX_HIDDEN:
        normed, new_residual = norm_ops.add_rmsnorm(x, residual, norm_weight, eps)
        w, ids = _route_hidden_impl(normed, router_weight, top_k, renormalize, scoring, expert_bias, scaling,
                                    shared_expert_gate)
        return normed, new_residual, w, ids
    x, residual = x.contiguous(), residual.contiguous()
    normed, new_residual = torch.empty_like(x), torch.empty_like(x)
    w, ids = kmod.route_hidden(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling, shared_expert_gate,
                               add_norm=(residual, norm_weight.contiguous(), eps, normed, new_residual))
    return normed, new_residual, w, ids


def _experts_impl(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale):
    if not _dispatch.use_triton(x):
        return moe_experts_reference(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)
    return _kernels().experts(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)


def _experts_add_scale_impl(x, w_gate_up, w_down, topk_weights, topk_ids, residual, norm_weight, gate_up_scale,
                            down_scale):
    if not _dispatch.use_triton(x):
        return moe_experts_add_scale_reference(x, w_gate_up, w_down, topk_weights, topk_ids, residual, norm_weight,
                                               gate_up_scale, down_scale)
    return _kernels().experts_add_scale(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale,
                                                      down_scale, residual, norm_weight)


def _moe_impl(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale):
    if not _dispatch.use_triton(x):
        return moe_reference(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale)
    return _kernels().moe(x, router_logits, w_gate_up, w_down, top_k, renormalize,
                                        gate_up_scale, down_scale)


# ----------------------------------------------------------------------------- registration
# As in ember.ops.norm: the registered ops are what torch.compile traces; eager calls go straight to
# the implementation (the custom-op wrapper costs host time per call).
@torch.library.custom_op("ember::moe_route", mutates_args=())
def _moe_route_op(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = _route_impl(router_logits, top_k, renormalize)
    return w, ids


@_moe_route_op.register_fake
def _(router_logits, top_k, renormalize):
    T = router_logits.shape[0]
    return (router_logits.new_empty((T, top_k), dtype=torch.float32),
            router_logits.new_empty((T, top_k), dtype=torch.int32))


@torch.library.custom_op("ember::moe_route_hidden", mutates_args=())
def _moe_route_hidden_op(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool, scoring: str,
                         expert_bias: torch.Tensor | None, scaling: float,
                         shared_expert_gate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = _route_hidden_impl(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling, shared_expert_gate)
    return w, ids


@_moe_route_hidden_op.register_fake
def _(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling, shared_expert_gate):
    T, top_k = x.shape[0], top_k + int(shared_expert_gate)
    return x.new_empty((T, top_k), dtype=torch.float32), x.new_empty((T, top_k), dtype=torch.int32)


@torch.library.custom_op("ember::add_rmsnorm_route_hidden", mutates_args=())
def _add_norm_route_op(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor,
                       top_k: int, eps: float, renormalize: bool, scoring: str, expert_bias: torch.Tensor | None,
                       scaling: float, shared_expert_gate: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    normed, new_residual, w, ids = _add_norm_route_impl(x, residual, norm_weight, router_weight, top_k, eps,
                                                        renormalize, scoring, expert_bias, scaling, shared_expert_gate)
    return normed, new_residual, w, ids


@_add_norm_route_op.register_fake
def _(x, residual, norm_weight, router_weight, top_k, eps, renormalize, scoring, expert_bias, scaling,
      shared_expert_gate):
    T, top_k = x.shape[0], top_k + int(shared_expert_gate)
    return (torch.empty_like(x), torch.empty_like(x), x.new_empty((T, top_k), dtype=torch.float32),
            x.new_empty((T, top_k), dtype=torch.int32))


@torch.library.custom_op("ember::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, gate_up_scale: torch.Tensor | None,
                    down_scale: torch.Tensor | None) -> torch.Tensor:
    return _experts_impl(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)


@_moe_experts_op.register_fake
def _(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale):
    return torch.empty_like(x)


@torch.library.custom_op("ember::moe_experts_add_scale", mutates_args=())
def _moe_experts_add_scale_op(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                              topk_weights: torch.Tensor, topk_ids: torch.Tensor, residual: torch.Tensor,
                              norm_weight: torch.Tensor, gate_up_scale: torch.Tensor | None,
                              down_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    h, scaled = _experts_add_scale_impl(x, w_gate_up, w_down, topk_weights, topk_ids, residual, norm_weight,
                                        gate_up_scale, down_scale)
    return h, scaled


@_moe_experts_add_scale_op.register_fake
def _(x, w_gate_up, w_down, topk_weights, topk_ids, residual, norm_weight, gate_up_scale, down_scale):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("ember::moe", mutates_args=())
def _moe_op(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
            renormalize: bool, gate_up_scale: torch.Tensor | None, down_scale: torch.Tensor | None) -> torch.Tensor:
    return _moe_impl(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale)


@_moe_op.register_fake
def _(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- public API
def moe_route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool = True):
    """Qwen3-MoE routing: float32 softmax over experts, top-k (ties -> lower index), renormalised.

    Returns ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``.

    Example:
        >>> w, ids = ember.ops.moe_route(torch.randn(4, 128), 8)
        >>> w.sum(-1)  # ones when renormalize=True
    """
    top_k = _validate_route(router_logits, top_k, renormalize)
    if _dispatch.compiling():
        return _moe_route_op(router_logits, top_k, renormalize)
    return _route_impl(router_logits, top_k, renormalize)


def moe_route_hidden(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, *, renormalize: bool = True,
                     scoring: str = "softmax", expert_bias: torch.Tensor | None = None, scaling: float = 1.0,
                     shared_expert_gate: bool = False):
    """``moe_route(F.linear(x, router_weight), top_k)``: routing from hidden states ``x [T, H]``.

    ``router_weight [E, H]`` has x's dtype; the logits are rounded to it (as F.linear returns them)
    before the float32 math. ``scoring="softmax"``: Qwen3 (softmax, top-k, renormalise).
    ``scoring="sigmoid"``: LFM2-MoE (sigmoid scores; the k largest of ``scores + expert_bias`` are
    chosen, the bias steering selection only; their scores divided by ``sum + 1e-6`` when
    ``renormalize``; times ``scaling``, the routed scaling factor). Ties go to the lower expert index.
    ``shared_expert_gate=True`` (softmax only): the last row of ``router_weight`` is a shared expert's
    gate; routing runs over the other E - 1 rows and expert E - 1 is appended to every token with
    weight ``sigmoid(logit)`` in float32, so the outputs have ``top_k + 1`` columns (Qwen3.5's shared
    expert folded into the routed experts).
    On CUDA, up to 64 tokens take one launch for the router GEMV and the routing together. Returns
    ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``.

    Example:
        >>> w, ids = ember.ops.moe_route_hidden(torch.randn(1, 64), torch.randn(8, 64), 2)
        >>> w, ids = ember.ops.moe_route_hidden(torch.randn(1, 64), torch.randn(8, 64), 2, scoring="sigmoid",
        ...                                     expert_bias=torch.zeros(8), scaling=2.5)
    """
    top_k = _validate_route_hidden(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling,
                                   shared_expert_gate)
    scaling = float(scaling)
    if _dispatch.compiling():
        return _moe_route_hidden_op(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling,
                                    shared_expert_gate)
    return _route_hidden_impl(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling, shared_expert_gate)


def add_rmsnorm_route_hidden(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                             router_weight: torch.Tensor, top_k: int, *, eps: float = 1e-6, renormalize: bool = True,
                             scoring: str = "softmax", expert_bias: torch.Tensor | None = None, scaling: float = 1.0,
                             shared_expert_gate: bool = False):
    """``add_rmsnorm(x, residual, norm_weight, eps)``, then ``moe_route_hidden`` of the normalised rows.

    A decoder layer's post-attention norm and its MoE router in one launch on CUDA (up to 64 tokens,
    hidden size up to 4096; otherwise the two ops). Arguments as in ``ember.ops.add_rmsnorm`` and
    :func:`moe_route_hidden`. Returns ``(normed, new_residual, topk_weights, topk_ids)``.

    Example:
        >>> x, res = torch.randn(1, 64), torch.randn(1, 64)
        >>> normed, res, w, ids = ember.ops.add_rmsnorm_route_hidden(x, res, torch.ones(64), torch.randn(8, 64), 2)
    """
    top_k = _validate_route_hidden(x, router_weight, top_k, renormalize, scoring, expert_bias, scaling,
                                   shared_expert_gate)
    _checks.tensor("residual", residual)
    eps = norm_ops._validate(x, residual, norm_weight, eps)
    scaling = float(scaling)
    args = (x, residual, norm_weight, router_weight, top_k, float(eps), renormalize, scoring, expert_bias, scaling,
            shared_expert_gate)
    if _dispatch.compiling():
        return _add_norm_route_op(*args)
    return _add_norm_route_impl(*args)


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Routed SwiGLU experts: ``sum_j topk_weights[t, j] * down[e](silu(gate[e] x) * up[e] x)``.

    ``x [T, H]``, ``w_gate_up [E, 2I, H]`` (gate rows, then up rows), ``w_down [E, H, I]``,
    ``topk_weights [T, k]``, ``topk_ids [T, k]`` (int32/int64). FP8 weights take ``gate_up_scale`` and
    ``down_scale`` (per row or per 128x128 block; see the module docstring). ``check=False`` skips
    the syncing id-range check (it is skipped during CUDA-graph capture anyway).

    Example:
        >>> x = torch.randn(3, 64)
        >>> w, ids = ember.ops.moe_route(torch.randn(3, 8), 2)
        >>> y = ember.ops.moe_experts(x, torch.randn(8, 64, 64), torch.randn(8, 64, 32), w, ids)
    """
    _validate_weights(x, w_gate_up, w_down, gate_up_scale, down_scale)
    _validate_topk(x, w_gate_up, topk_weights, topk_ids, check)
    if _dispatch.compiling():
        return _moe_experts_op(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)
    return _experts_impl(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)


def moe_experts_add_scale(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, *, gate_up_scale: torch.Tensor | None = None,
                          down_scale: torch.Tensor | None = None,
                          check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's experts added to the residual stream, and that sum times the next norm's weight.

    Returns ``(h, scaled)``: ``h = moe_experts(x, ...) + residual`` (each rounded to x.dtype, as
    ``add_rmsnorm`` forms its residual output) and ``scaled = h * norm_weight``; the decode step's
    next pre-attention ``add_rmsnorm(...)`` equals ``scaled / rms(h)``, and the kernel after the
    qkv projection applies the ``1 / rms(h)`` (``qk_norm_rope_cache(..., prenorm=(h, eps))``), so the
    norm needs no launch of its own. ``x``, ``residual``: ``[T, H]``, 1 <= T <= 16; ``norm_weight``:
    ``[H]``. On CUDA: the epilogue of the T=1 down GEMV, or of the decode path's combine kernel.

    Example:
        >>> x, res = torch.randn(1, 64), torch.randn(1, 64)
        >>> w, ids = ember.ops.moe_route(torch.randn(1, 8), 2)
        >>> h, scaled = ember.ops.moe_experts_add_scale(x, torch.randn(8, 64, 64), torch.randn(8, 64, 32), w, ids,
        ...                                             res, torch.ones(64))
    """
    _validate_weights(x, w_gate_up, w_down, gate_up_scale, down_scale)
    _validate_topk(x, w_gate_up, topk_weights, topk_ids, check)
    if not 1 <= x.shape[0] <= DECODE_MAX_TOKENS:
        raise ValueError(f"x: moe_experts_add_scale takes 1 to {DECODE_MAX_TOKENS} tokens (decode), got {x.shape[0]}")
    _checks.tensor("residual", residual)
    _checks.tensor("norm_weight", norm_weight, ndim=1)
    _checks.same_device(x=x, residual=residual, norm_weight=norm_weight)
    _checks.same_dtype(x=x, residual=residual)
    _checks.same_shape(x=x, residual=residual)
    if norm_weight.shape[0] != x.shape[1]:
        raise ValueError(f"norm_weight: expected length {x.shape[1]} (x.shape[-1]), got {norm_weight.shape[0]}")
    if _dispatch.compiling():
        return _moe_experts_add_scale_op(x, w_gate_up, w_down, topk_weights, topk_ids, residual, norm_weight,
                                         gate_up_scale, down_scale)
    return _experts_add_scale_impl(x, w_gate_up, w_down, topk_weights, topk_ids, residual, norm_weight,
                                   gate_up_scale, down_scale)


def moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, *,
        renormalize: bool = True, gate_up_scale: torch.Tensor | None = None,
        down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One MoE layer's experts with routing fused in: ``moe_experts(x, ..., *moe_route(router_logits, top_k))``.

    Example:
        >>> x, logits = torch.randn(1, 64), torch.randn(1, 8)
        >>> y = moe(x, logits, torch.randn(8, 64, 64), torch.randn(8, 64, 32), top_k=2)
    """
    top_k = _validate_route(router_logits, top_k, renormalize)
    _validate_weights(x, w_gate_up, w_down, gate_up_scale, down_scale)
    _checks.same_device(x=x, router_logits=router_logits)
    if router_logits.shape[0] != x.shape[0]:
        raise ValueError(f"router_logits: expected {x.shape[0]} rows (x.shape[0]), got shape {tuple(router_logits.shape)}")
    if router_logits.shape[1] != w_gate_up.shape[0]:
        raise ValueError(f"router_logits: expected {w_gate_up.shape[0]} columns (E = w_gate_up.shape[0]), "
                         f"got shape {tuple(router_logits.shape)}")
    if _dispatch.compiling():
        return _moe_op(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale)
    return _moe_impl(x, router_logits, w_gate_up, w_down, top_k, renormalize, gate_up_scale, down_scale)
