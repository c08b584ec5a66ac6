"""SwiGLU: ``silu(gate) * up`` of a fused ``[..., 2I]`` projection holding the gate half then the up
half (ember's MoE ``w_gate_up`` rows and HF's Qwen3 MLP ``gate_proj`` / ``up_proj`` concatenated in
that order), with a backward. Float32 math, each result rounded once to the input dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import _dispatch
from ember.ops import _checks


def _validate(gate_up):
    _checks.tensor("gate_up", gate_up, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    n = gate_up.shape[-1]
    if n % 2:
        raise ValueError(f"gate_up: expected an even last dim (gate half then up half), got shape {tuple(gate_up.shape)}")


# ----------------------------------------------------------------------------- reference
def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The executable spec: float32 ``silu(gate) * up``, rounded to gate_up's dtype."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gate_up.dtype)


def swiglu_backward_reference(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The spec of the backward: the [..., 2I] gradient of gate_up (float32 math, gate_up's dtype)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    dy = grad.float()
    sig = torch.sigmoid(g)
    return torch.cat([dy * u * sig * (1 + g * (1 - sig)), dy * g * sig], dim=-1).to(gate_up.dtype)


# ----------------------------------------------------------------------------- implementation
def _impl(gate_up):
    if not _dispatch.use_triton(gate_up):
        return swiglu_reference(gate_up)
    I = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _dispatch.prepare_triton()
        from ember.kernels import swiglu as k
        k.swiglu(_checks.rows_2d(gate_up), out.view(-1, I))
    return out


def _backward_impl(grad, gate_up):
    if not _dispatch.use_triton(gate_up):
        return swiglu_backward_reference(grad, gate_up)
    out = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _dispatch.prepare_triton()
        from ember.kernels import swiglu as k
        k.swiglu_backward(_checks.rows_2d(grad), _checks.rows_2d(gate_up), out.view(-1, gate_up.shape[-1]))
    return out


# ----------------------------------------------------------------------------- registration
@torch.library.custom_op("ember::swiglu", mutates_args=())
def _swiglu_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _impl(gate_up)


@_swiglu_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("ember::swiglu_backward", mutates_args=())
def _swiglu_backward_op(grad: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return _backward_impl(grad, gate_up)


@_swiglu_backward_op.register_fake
def _(grad, gate_up):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _grad(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_backward_op(grad, gate_up)


_swiglu_op.register_autograd(_grad, setup_context=_setup)


# ----------------------------------------------------------------------------- public API
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)``: [..., 2I] -> [..., I].

    bf16 / fp16 / fp32, any leading shape, float32 math rounded once to the input dtype (HF's
    ``act_fn(gate_proj(x)) * up_proj(x)`` in bf16 rounds twice). Differentiable.

    Example:
        >>> h = ember.ops.swiglu(torch.randn(4, 2 * 768))   # [4, 768]
    """
    _validate(gate_up)
    if _dispatch.compiling() or (torch.is_grad_enabled() and gate_up.requires_grad):
        return _swiglu_op(gate_up)
    return _impl(gate_up)
