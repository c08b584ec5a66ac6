"""The Snake activation of audio codecs and vocoders, in one kernel launch.

``snake(x, alpha)`` is DAC's ``Snake1d`` (transformers' ``DacModel``): ``x + sin(alpha * x)^2 /
(alpha + 1e-9)``. With ``beta`` it is the Snake-Beta form of BigVGAN and Stable Audio's Oobleck VAE
(diffusers' ``AutoencoderOobleck``): ``x + sin(alpha * x)^2 / (beta + 1e-9)``; ``logscale=True`` takes
``alpha`` and ``beta`` as logarithms (``exp`` is applied first), as diffusers' module stores them.

``x`` is channels-first ``[B, C, T]`` in bfloat16, float16 or float32, with any strides; ``alpha`` and
``beta`` hold one value per channel, shaped ``[C]`` or ``[1, C, 1]`` (the modules' parameter shape),
in any of those float dtypes. The math is float32 and the result is rounded once to x's dtype (the
modules, run in bf16, round after every step instead).
"""
from __future__ import annotations

import torch

from ember import _dispatch
from ember.ops import _checks

EPS = 1e-9  # what both modules add to the divisor


# ----------------------------------------------------------------------------- validation
def _per_channel(name: str, p, x: torch.Tensor) -> torch.Tensor:
    """``p`` as a 1-d [C] view (no copy), after checking it against x [B, C, T]."""
    _checks.tensor(name, p, dtypes=_checks.FLOAT_DTYPES)
    C = x.shape[1]
    if not (tuple(p.shape) == (C,) or tuple(p.shape) == (1, C, 1)):
        raise ValueError(f"{name}: expected shape ({C},) or (1, {C}, 1) for x with {C} channels "
                         f"(x shape {tuple(x.shape)}), got {tuple(p.shape)}")
    _checks.same_device(x=x, **{name: p})
    return p.reshape(C) if p.dim() == 1 else p[0, :, 0]


def _validate(x, alpha, beta, out, logscale):
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, ndim=3)
    if not isinstance(logscale, bool):
        raise TypeError(f"logscale: expected a bool, got {type(logscale).__name__}")
    a = _per_channel("alpha", alpha, x)
    b = _per_channel("beta", beta, x) if beta is not None else None
    if out is not None:
        _checks.tensor("out", out)
        _checks.same_device(x=x, out=out)
        _checks.same_dtype(x=x, out=out)
        _checks.same_shape(x=x, out=out)
        # (not while tracing: dynamo cannot trace storage pointers; the custom op checks real tensors)
        if (not _dispatch.compiling() and out.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                and (out.data_ptr() != x.data_ptr() or out.stride() != x.stride())):
            # each element is read and written by the same lane only when out is exactly x
            raise ValueError("out: expected x itself (in place) or memory separate from x, got a tensor "
                             "overlapping x's storage at other offsets or strides")
    return a, b


# ----------------------------------------------------------------------------- reference
def snake_reference(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None = None, *,
                    logscale: bool = False) -> torch.Tensor:
    """The executable spec in float32 math, returned in x's dtype."""
    a, b = _validate(x, alpha, beta, None, logscale)
    a = a.float()
    if logscale:
        a = a.exp()
    d = a if b is None else (b.float().exp() if logscale else b.float())
    xf = x.float()
    y = xf + (d + EPS).reciprocal()[None, :, None] * torch.sin(a[None, :, None] * xf).pow(2)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- implementation
def _impl(x, a, b, out, logscale):
    if out is None:
        out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    if not _dispatch.use_triton(x):
        out.copy_(snake_reference(x, a, b, logscale=logscale))
        return out
    _dispatch.prepare_triton()
    from ember.kernels import snake as k
    k.snake(x, a, b, out, logscale)
    return out


# ----------------------------------------------------------------------------- backward
def _snake_backward(grad, x, alpha, beta, logscale):
    """Gradients of the forward for x, alpha, beta (in their shapes and dtypes), plain torch in float32.

    With s = sin(a x) and inv = 1 / (d + eps): dy/dx = 1 + a inv sin(2 a x), dy/da = inv x sin(2 a x)
    (plus -s^2 inv^2 when d is alpha), dy/dd = -s^2 inv^2; logscale multiplies by a (or d) itself.
    """
    C = x.shape[1]
    a = alpha.float().reshape(1, C, 1)
    if logscale:
        a = a.exp()
    d = a if beta is None else (beta.float().reshape(1, C, 1).exp() if logscale else beta.float().reshape(1, C, 1))
    xf, g = x.float(), grad.float()
    inv = (d + EPS).reciprocal()
    s2, sin2 = torch.sin(a * xf).pow(2), torch.sin(2 * a * xf)
    grad_x = (g * (1 + a * inv * sin2)).to(x.dtype)
    g_d = (g * -s2 * inv * inv).sum(dim=(0, 2), keepdim=True)  # [1, C, 1]
    g_a = (g * inv * xf * sin2).sum(dim=(0, 2), keepdim=True)
    if beta is None:
        g_a = g_a + g_d
    g_a = g_a * a if logscale else g_a
    grad_alpha = g_a.reshape(alpha.shape).to(alpha.dtype)
    grad_beta = None
    if beta is not None:
        grad_beta = (g_d * d if logscale else g_d).reshape(beta.shape).to(beta.dtype)
    return grad_x, grad_alpha, grad_beta


class _SnakeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, beta, logscale):
        ctx.save_for_backward(x, alpha, *([beta] if beta is not None else []))
        ctx.logscale = logscale
        a, b = _validate(x, alpha, beta, None, logscale)
        return _impl(x, a, b, None, logscale)

    @staticmethod
    def backward(ctx, grad):
        x, alpha, *rest = ctx.saved_tensors
        return (*_snake_backward(grad, x, alpha, rest[0] if rest else None, ctx.logscale), None)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


# ----------------------------------------------------------------------------- registration
# torch.compile sees these; eager calls go straight to _impl (no custom-op host overhead).
@torch.library.custom_op("ember::snake", mutates_args=())
def _snake_op(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, logscale: bool) -> torch.Tensor:
    a, b = _validate(x, alpha, beta, None, logscale)
    return _impl(x, a, b, None, logscale)


@_snake_op.register_fake
def _(x, alpha, beta, logscale):
    _validate(x, alpha, beta, None, logscale)
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, alpha, beta, logscale = inputs
    ctx.save_for_backward(x, alpha, *([beta] if beta is not None else []))
    ctx.logscale = logscale


def _op_backward(ctx, grad):
    x, alpha, *rest = ctx.saved_tensors
    return (*_snake_backward(grad, x, alpha, rest[0] if rest else None, ctx.logscale), None)


_snake_op.register_autograd(_op_backward, setup_context=_setup_context)


@torch.library.custom_op("ember::snake_out", mutates_args=("out",))
def _snake_out_op(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, logscale: bool,
                  out: torch.Tensor) -> None:
    a, b = _validate(x, alpha, beta, out, logscale)
    _impl(x, a, b, out, logscale)


@_snake_out_op.register_fake
def _(x, alpha, beta, logscale, out):
    _checks.tensor("out", out)
    _checks.same_shape(x=x, out=out)
    return None


# ----------------------------------------------------------------------------- public API
def snake(x: torch.Tensor, alpha: torch.Tensor, *, beta: torch.Tensor | None = None, logscale: bool = False,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Snake activation ``x + sin(alpha * x)^2 / (d + 1e-9)`` with ``d = beta`` if given, else ``alpha``.

    ``x``: [B, C, T] bfloat16 / float16 / float32, any strides. ``alpha``, ``beta``: [C] or [1, C, 1].
    ``logscale=True`` exponentiates alpha and beta first (diffusers' Oobleck ``Snake1d``). With ``out``
    (same shape and dtype as x, any strides, or x itself for in place) the result is written there.
    Differentiable in x, alpha and beta (the backward is plain torch in float32; not with ``out``).

    Example:
        >>> x = torch.randn(2, 64, 1000, dtype=torch.bfloat16)
        >>> y = ember.ops.snake(x, torch.ones(1, 64, 1))               # DAC's Snake1d
        >>> y = ember.ops.snake(x, torch.zeros(64), beta=torch.zeros(64), logscale=True)  # Oobleck
        >>> y.shape
        torch.Size([2, 64, 1000])
    """
    a, b = _validate(x, alpha, beta, out, logscale)
    if out is not None and _needs_grad(x, alpha, beta):
        raise ValueError("out: expected out=None when gradients are needed (x, alpha or beta requires grad); "
                         "an out= result is not differentiable")
    if _dispatch.compiling():
        if out is None:
            return _snake_op(x, alpha, beta, logscale)
        _snake_out_op(x, alpha, beta, logscale, out)
        return out
    if _needs_grad(x, alpha, beta):
        return _SnakeFunction.apply(x, alpha, beta, logscale)
    return _impl(x, a, b, out, logscale)
