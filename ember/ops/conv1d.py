"""Depthwise causal conv1d with a rolling state: the short convolution of LFM2 conv blocks and the
conv in front of Qwen3.5's gated DeltaNet.

``y[b, c, t] = act(bias[c] + sum_j weight[c, j] * xin[b, c, t - (K-1) + j])`` where ``xin`` is the
input preceded by the state (the previous inputs; zeros when no state is given). When ``conv_state``
[B, C, S] (S >= K-1) is given it is updated in place to hold the last S inputs, so a prefill followed by
one-token decode steps equals one long causal convolution.

``channels_last=True`` returns y as the [B, C, T] transpose of a contiguous [B, T, C] tensor (the
kernel writes that layout directly), so a model working in [B, T, C] gets ``y.transpose(1, 2)``
contiguous without a copy launch. The values are the same.

``gate_in`` / ``gate_out`` [B, C, T] (LFM2's gated short conv, ``gate_out * conv(gate_in * x)``):
the conv runs over ``gate_in * x`` (that product is what ``conv_state`` keeps) and y is multiplied
by ``gate_out``; each product is rounded to x's dtype, as the separate torch ops round them, so the
one launch equals the three.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import _dispatch
from ember.ops import _checks


def _validate(x, weight, bias, conv_state, activation, gate_in=None, gate_out=None):
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, ndim=3)
    _checks.tensor("weight", weight, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    B, C, T = x.shape
    if weight.shape[0] != C:
        raise ValueError(f"weight: expected shape [{C}, K] (C = x.shape[1]), got {tuple(weight.shape)}")
    K = weight.shape[1]
    if bias is not None:
        _checks.tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != C:
            raise ValueError(f"bias: expected length {C}, got {bias.shape[0]}")
    if conv_state is not None:
        _checks.tensor("conv_state", conv_state, dtypes=_checks.FLOAT_DTYPES, ndim=3)
        if conv_state.shape[:2] != (B, C) or conv_state.shape[2] < K - 1:
            raise ValueError(f"conv_state: expected shape [{B}, {C}, S] with S >= {K - 1} (kernel size - 1), "
                             f"got {tuple(conv_state.shape)}")
        if conv_state.shape[2] > 64:
            raise ValueError(f"conv_state: expected at most 64 cached steps, got {conv_state.shape[2]}")
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")
    for name, g in (("gate_in", gate_in), ("gate_out", gate_out)):
        if g is not None:
            _checks.tensor(name, g, dtypes=(x.dtype,), ndim=3)
            if g.shape != x.shape:
                raise ValueError(f"{name}: expected shape {tuple(x.shape)} (x's), got {tuple(g.shape)}")
    _checks.same_device(x=x, weight=weight, bias=bias, conv_state=conv_state, gate_in=gate_in, gate_out=gate_out)


def _empty_out(x, channels_last):
    B, C, T = x.shape
    if channels_last:
        return torch.empty(B, T, C, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def causal_conv1d_reference(x, weight, bias=None, conv_state=None, activation=None, channels_last=False,
                            gate_in=None, gate_out=None):
    """The spec in float32 math; updates ``conv_state`` in place like the op."""
    if gate_in is not None:
        x = gate_in * x  # rounded to x's dtype, as the op specifies
    if gate_out is not None:
        y = causal_conv1d_reference(x, weight, bias, conv_state, activation)
        y = gate_out * y
        return _empty_out(x, True).copy_(y) if channels_last else y
    B, C, T = x.shape
    K = weight.shape[1]
    prev = conv_state.float() if conv_state is not None else x.new_zeros(B, C, K - 1, dtype=torch.float32)
    xin = torch.cat([prev, x.float()], dim=-1)
    y = F.conv1d(xin, weight.float().unsqueeze(1), bias.float() if bias is not None else None, groups=C)
    y = y[..., -T:]
    if activation == "silu":
        y = F.silu(y)
    if conv_state is not None:
        conv_state.copy_(xin[..., -conv_state.shape[2]:].to(conv_state.dtype))
    if channels_last:
        return _empty_out(x, True).copy_(y)
    return y.to(x.dtype)


def _impl(x, weight, bias, conv_state, activation, channels_last=False, gate_in=None, gate_out=None):
    if not _dispatch.use_triton(x):
        return causal_conv1d_reference(x, weight, bias, conv_state, activation, channels_last, gate_in, gate_out)
    y = _empty_out(x, channels_last)  # the kernel takes y's strides: either layout costs the same
    _dispatch.prepare_triton()
    from ember.kernels import conv1d as kernels
    kernels.causal_conv1d(x, weight, bias, conv_state, y, activation == "silu", gate_in, gate_out)
    return y


@torch.library.custom_op("ember::causal_conv1d", mutates_args=("conv_state",))
def _causal_conv1d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      conv_state: torch.Tensor | None, activation: str | None, channels_last: bool,
                      gate_in: torch.Tensor | None, gate_out: torch.Tensor | None) -> torch.Tensor:
    return _impl(x, weight, bias, conv_state, activation, channels_last, gate_in, gate_out)


@_causal_conv1d_op.register_fake
def _(x, weight, bias, conv_state, activation, channels_last, gate_in, gate_out):
    return _empty_out(x, channels_last)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  conv_state: torch.Tensor | None = None, activation: str | None = None,
                  channels_last: bool = False, gate_in: torch.Tensor | None = None,
                  gate_out: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv1d over ``x`` [B, C, T] with ``weight`` [C, K]; updates ``conv_state``.

    ``channels_last``: return y [B, C, T] as the transpose of a contiguous [B, T, C] tensor.

    Example:
        >>> x, w = torch.randn(1, 8, 5), torch.randn(8, 4)
        >>> state = torch.zeros(1, 8, 3)
        >>> y = ember.ops.causal_conv1d(x, w, conv_state=state, activation="silu")  # prefill
        >>> y1 = ember.ops.causal_conv1d(torch.randn(1, 8, 1), w, conv_state=state, activation="silu")  # one step
        >>> y_btc = ember.ops.causal_conv1d(x, w, channels_last=True).transpose(1, 2)  # [1, 5, 8], contiguous
        >>> b, c = torch.randn(1, 8, 5), torch.randn(1, 8, 5)
        >>> y_lfm2 = ember.ops.causal_conv1d(x, w, gate_in=b, gate_out=c)  # c * conv(b * x)
    """
    _validate(x, weight, bias, conv_state, activation, gate_in, gate_out)
    if not isinstance(channels_last, bool):
        raise TypeError(f"channels_last: expected a bool, got {type(channels_last).__name__}")
    if _dispatch.compiling():
        return _causal_conv1d_op(x, weight, bias, conv_state, activation, channels_last, gate_in, gate_out)
    return _impl(x, weight, bias, conv_state, activation, channels_last, gate_in, gate_out)
