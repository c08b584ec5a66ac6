"""The MoE experts for training: ``moe_experts_train``, ``ember.ops.moe_experts`` with autograd.

``moe_experts_train(x, w_gate_up, w_down, topk_weights, topk_ids)`` -> ``[T, H]`` in ``x.dtype``, the
same function and layouts as ``ember.ops.moe_experts`` (x ``[T, H]``, w_gate_up ``[E, 2I, H]`` gate rows
then up rows, w_down ``[E, H, I]``, topk_weights / topk_ids ``[T, k]``), differentiable in x, both
weights and topk_weights:

* ``dx[t] = sum_j W_gu[e]^T dgu[t, j]``, ``dW_gu[e] = sum dgu x^T``, ``dW_d[e] = sum tw * grad_out h^T``
  over the pairs routed to e, with ``dgu = SwiGLU'(g, u) * tw * W_d[e]^T grad_out``;
* ``grad_topk_weights[t, j] = <grad_out[t], W_d[e] h[t, j]>`` (the expert's unweighted output),
  computed as ``<W_d[e]^T grad_out[t], h[t, j]>`` so that output is never stored.

Numerics: as ``moe_experts`` (float32 accumulation; the activation ``h = silu(g) * u`` rounded to x.dtype
before the down projection; a token's k weighted rows summed in float32). The backward keeps the same
roundings: each intermediate (dgu, the per-pair rows of dx) is rounded once to x.dtype, weight grads
are accumulated in float32 and rounded once to the weight dtype; grad_topk_weights is float32 math
returned in topk_weights' dtype.

Paths: CUDA (and CPU under ``EMBER_FORCE_TRITON=1``): grouped GEMMs over the pairs sorted by expert
(``ember.kernels.moe_train``; no per-token copy of expert weights). Elsewhere: the plain-PyTorch
reference, and its autograd for the backward. The forward saves x, the weights, the routing and the
pre-activation ``[g; u]`` of every pair ([T*k, 2I] in x.dtype); h is recomputed from it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import _dispatch
from ember.ops import _checks
# the module's validators (ember.ops.moe the attribute is the public function of that name)
from ember.ops.moe import _validate_topk, _validate_weights


# ----------------------------------------------------------------------------- validation
def _validate(x, w_gate_up, w_down, topk_weights, topk_ids, check) -> None:
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    # training weights share x's dtype: float8 expert weights are an inference format
    _checks.tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=3)
    _validate_weights(x, w_gate_up, w_down, None, None)
    _validate_topk(x, w_gate_up, topk_weights, topk_ids, check)


# ----------------------------------------------------------------------------- reference
def moe_experts_train_reference(x, w_gate_up, w_down, topk_weights, topk_ids, *, return_gate_up: bool = False):
    """The executable spec, differentiable by torch autograd: one expert at a time over its pairs,
    float32 math (float64 for float64 inputs), h rounded to x.dtype before the down projection.
    With ``return_gate_up`` also the pairs' pre-activations ``[g; u]`` ([T*k, 2I], in x.dtype)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    I = w_down.shape[2]
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.new_zeros((T, H), dtype=acc)
    gu_pairs = x.new_zeros((T * k, 2 * I), dtype=x.dtype) if return_gate_up else None
    xa = x.to(acc)
    flat = topk_ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        pair = (flat == e).nonzero(as_tuple=True)[0]
        tok = pair // k
        gu = xa[tok] @ w_gate_up[e].to(acc).T
        if gu_pairs is not None:
            gu_pairs[pair] = gu.detach().to(x.dtype)
        h = (F.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype).to(acc)
        y = h @ w_down[e].to(acc).T
        out = out.index_add(0, tok, topk_weights.reshape(-1)[pair].to(acc)[:, None] * y)
    out = out.to(x.dtype)
    return (out, gu_pairs) if return_gate_up else out


def moe_experts_train_backward_reference(grad_out, x, w_gate_up, w_down, topk_weights, topk_ids):
    """The backward written out in plain PyTorch (no autograd; tested against autograd of
    :func:`moe_experts_train_reference` in float64): ``(dx, dw_gate_up, dw_down, dtopk_weights)``."""
    k = topk_ids.shape[1]
    I = w_down.shape[2]
    acc = torch.promote_types(x.dtype, torch.float32)
    dx = torch.zeros(x.shape, dtype=acc, device=x.device)
    dwgu = torch.zeros_like(w_gate_up, dtype=acc)
    dwd = torch.zeros_like(w_down, dtype=acc)
    dtw = torch.zeros(topk_ids.numel(), dtype=acc, device=x.device)
    flat, tw = topk_ids.reshape(-1), topk_weights.reshape(-1).to(acc)
    for e in torch.unique(flat).tolist():
        pair = (flat == e).nonzero(as_tuple=True)[0]
        tok = pair // k
        xe, go, w = x[tok].to(acc), grad_out[tok].to(acc), tw[pair][:, None]
        wgu = w_gate_up[e].to(acc)
        gu = xe @ wgu.T
        g, u = gu[:, :I], gu[:, I:]
        sig = torch.sigmoid(g)
        h = (g * sig * u).to(x.dtype).to(acc)
        gh = go @ w_down[e].to(acc)  # d out / d h, before the routing weight
        dtw[pair] = (gh * h).sum(1)
        dwd[e] = (go * w).T @ h
        dh = gh * w
        dgu = torch.cat([dh * u * sig * (1 + g * (1 - sig)), dh * g * sig], 1)
        dwgu[e] = dgu.T @ xe
        dx.index_add_(0, tok, dgu @ wgu)
    return (dx.to(x.dtype), dwgu.to(w_gate_up.dtype), dwd.to(w_down.dtype),
            dtw.view(topk_ids.shape).to(topk_weights.dtype))


# ----------------------------------------------------------------------------- implementation
def _kernels():
    _dispatch.prepare_triton()
    from ember.kernels import moe_train
    return moe_train


def _forward_impl(x, w_gate_up, w_down, topk_weights, topk_ids):
    if x.shape[0] == 0:
        return torch.zeros_like(x), x.new_empty((0, w_gate_up.shape[1]))
    if not _dispatch.use_triton(x):
        return moe_experts_train_reference(x, w_gate_up, w_down, topk_weights, topk_ids, return_gate_up=True)
    return _kernels().forward(_rows(x), w_gate_up, w_down, topk_weights.float().contiguous(),
                              topk_ids.contiguous())


def _backward_impl(grad_out, x, w_gate_up, w_down, topk_weights, topk_ids, gu):
    if x.shape[0] == 0:
        return (torch.zeros_like(x), torch.zeros_like(w_gate_up), torch.zeros_like(w_down),
                torch.zeros_like(topk_weights))
    if not _dispatch.use_triton(x):
        return moe_experts_train_backward_reference(grad_out, x, w_gate_up, w_down, topk_weights, topk_ids)
    dx, dwgu, dwd, dtw = _kernels().backward(grad_out, _rows(x), w_gate_up, w_down,
                                             topk_weights.float().contiguous(), topk_ids.contiguous(), gu)
    return dx, dwgu, dwd, dtw.to(topk_weights.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# ----------------------------------------------------------------------------- registration
# Always through the custom op (eager too): its register_autograd is the backward, and the
# wrapper's host cost (~14 us) is small against a training step's expert GEMMs.
@torch.library.custom_op("ember::moe_experts_train", mutates_args=())
def _train_op(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(x, w_gate_up, w_down, topk_weights, topk_ids)


@_train_op.register_fake
def _(x, w_gate_up, w_down, topk_weights, topk_ids):
    return torch.empty_like(x), x.new_empty((topk_ids.numel(), w_gate_up.shape[1]))


@torch.library.custom_op("ember::moe_experts_train_backward", mutates_args=())
def _train_backward_op(grad_out: torch.Tensor, x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(grad_out, x, w_gate_up, w_down, topk_weights, topk_ids, gu)


@_train_backward_op.register_fake
def _(grad_out, x, w_gate_up, w_down, topk_weights, topk_ids, gu):
    return torch.empty_like(x), torch.empty_like(w_gate_up), torch.empty_like(w_down), torch.empty_like(topk_weights)


def _setup_context(ctx, inputs, output):
    x, w_gate_up, w_down, topk_weights, topk_ids = inputs
    ctx.save_for_backward(x, w_gate_up, w_down, topk_weights, topk_ids, output[1])


def _backward(ctx, grad_out, _grad_gu):
    x, w_gate_up, w_down, topk_weights, topk_ids, gu = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    dx, dwgu, dwd, dtw = _train_backward_op(grad_out, x, w_gate_up, w_down, topk_weights, topk_ids, gu)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, dwgu if need[1] else None, dwd if need[2] else None,
            dtw if need[3] else None, None)


_train_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public
def moe_experts_train(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Routed SwiGLU experts with a backward: ``ember.ops.moe_experts`` for training.

    ``out[t] = sum_j topk_weights[t, j] * W_d[e] (silu(g) * u)``, ``[g; u] = W_gu[e] x[t]``,
    ``e = topk_ids[t, j]``; gradients flow to x, w_gate_up ``[E, 2I, H]``, w_down ``[E, H, I]`` and
    topk_weights ``[T, k]`` (so the router trains). Weights share x's dtype (bf16 / fp16 / fp32).
    ``check=False`` skips the syncing id-range check.

    Example:
        >>> x = torch.randn(6, 64, requires_grad=True)
        >>> wgu = torch.randn(8, 64, 64, requires_grad=True); wd = torch.randn(8, 64, 32, requires_grad=True)
        >>> w, ids = ember.ops.moe_route(torch.randn(6, 8), 2)
        >>> ember.ops.moe_experts_train(x, wgu, wd, w, ids).square().sum().backward()
    """
    _validate(x, w_gate_up, w_down, topk_weights, topk_ids, check)
    return _train_op(x, w_gate_up, w_down, topk_weights, topk_ids)[0]
