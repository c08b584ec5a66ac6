"""RMSNorm, fused residual-add + RMSNorm, and gated RMSNorm.

``add_rmsnorm(x, residual, weight, eps)`` returns ``(normed, new_residual)`` with
``new_residual = x + residual`` (rounded to the input dtype, as models keep their residual stream)
and ``normed = new_residual / sqrt(mean(new_residual**2) + eps) * weight`` in float32 math, cast to
the input dtype. One pass over memory instead of the four a torch composite makes.

``rmsnorm_silu(x, weight, eps, out=...)`` is ``silu(rmsnorm(x))`` in one pass, written into ``out``
when given (the Wan VAE's norm + SiLU writing straight into a causal conv's input buffer).

``rmsnorm_gated(x, z, weight, eps)`` is the output norm of Qwen3.5's gated DeltaNet:
``(rmsnorm(x, weight, eps).float() * silu(z.float())).to(x.dtype)``, the norm rounded to x.dtype
first exactly as the two-step path stores it; one launch instead of six.

``rmsnorm`` and ``add_rmsnorm`` are differentiable (x, residual, weight): a call that needs a gradient
goes through the registered op, whose backward is one Triton launch (ember/kernels/norm_backward.py)
plus a small reduction of per-program weight-gradient rows; a call that needs none takes the direct
forward path unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import _dispatch
from ember.ops import _checks

MAX_HIDDEN = 16384


# ----------------------------------------------------------------------------- validation
def _validate(x, residual, weight, eps) -> float:
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    _checks.tensor("weight", weight, dtypes=_checks.FLOAT_DTYPES, ndim=1)
    if residual is not None:
        _checks.tensor("residual", residual, dtypes=_checks.FLOAT_DTYPES)
        _checks.same_dtype(x=x, residual=residual)
        _checks.same_shape(x=x, residual=residual)
    _checks.same_device(x=x, residual=residual, weight=weight)
    H = x.shape[-1]
    if weight.shape[0] != H:
        raise ValueError(f"weight: expected length {H} (x.shape[-1]), got {weight.shape[0]}")
    if not 1 <= H <= MAX_HIDDEN:
        raise ValueError(f"x: expected hidden size (last dim) in [1, {MAX_HIDDEN}], got {H}")
    return _checks.positive_float("eps", eps)


# ----------------------------------------------------------------------------- reference
def add_rmsnorm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The executable spec: float32 math, results in x.dtype."""
    new_residual = None
    if residual is not None:
        new_residual = (x.float() + residual.float()).to(x.dtype)
        x = new_residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), new_residual


def rmsnorm_silu_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The executable spec: torch's silu of the norm as ``rmsnorm`` returns it (rounded to x.dtype)."""
    return F.silu(add_rmsnorm_reference(x, None, weight, eps)[0])


def rmsnorm_gated_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The executable spec of the gated norm: the two-step torch path."""
    return (add_rmsnorm_reference(x, None, weight, eps)[0].float() * F.silu(z.float())).to(x.dtype)


def rmsnorm_backward_reference(grad: torch.Tensor, grad_residual: torch.Tensor | None, s: torch.Tensor,
                               weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The executable spec of the backward, float32 math: (grad of the normalised rows ``s`` in
    s.dtype, plus ``grad_residual`` (the new residual's own gradient) when given; grad of weight in
    weight.dtype). ``s`` is x for ``rmsnorm`` and the stored sum for ``add_rmsnorm``."""
    sf, g = s.float(), grad.float()
    inv = torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    gxhat = g * weight.float()
    gs = inv * (gxhat - sf * inv.pow(2) * (gxhat * sf).mean(-1, keepdim=True))
    if grad_residual is not None:
        gs = gs + grad_residual.float()
    gw = (g * sf * inv).reshape(-1, s.shape[-1]).sum(0)
    return gs.to(s.dtype), gw.to(weight.dtype)


# ----------------------------------------------------------------------------- implementation
def _backward_impl(grad, grad_residual, s, weight, eps):
    if not _dispatch.use_triton(s):
        return rmsnorm_backward_reference(grad, grad_residual, s, weight, eps)
    _dispatch.prepare_triton()
    from ember.kernels import norm_backward as kb
    gs = torch.empty(s.shape, dtype=s.dtype, device=s.device)
    H = s.shape[-1]
    gw = kb.rmsnorm_backward(_checks.rows_2d(grad), _checks.rows_2d(grad_residual) if grad_residual is not None else None,
                             _checks.rows_2d(s), weight.contiguous(), eps, gs.view(-1, H))
    return gs, gw.to(weight.dtype)


def _impl(x, residual, weight, eps):
    if not _dispatch.use_triton(x):
        return add_rmsnorm_reference(x, residual, weight, eps)
    _dispatch.prepare_triton()
    from ember.kernels import norm as k
    x2 = _checks.rows_2d(x)
    r2 = _checks.rows_2d(residual) if residual is not None else None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    k.add_rmsnorm(x2, r2, weight.contiguous(), eps, out.view(-1, x.shape[-1]),
                  new_res.view(-1, x.shape[-1]) if new_res is not None else None)
    return out, new_res


def _groups_3d(t: torch.Tensor) -> torch.Tensor:
    """An [M, G, n] view of ``t`` (G = the second-to-last dim) with unit stride in n; copies only when
    the leading dims cannot merge (a head-split slice of a fused projection merges, so it never does)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    G = t.shape[-2] if t.dim() >= 2 else 1
    try:
        return t.view(-1, G, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, G, t.shape[-1]).contiguous()


def _gated_impl(x, z, weight, eps):
    if not _dispatch.use_triton(x):
        return rmsnorm_gated_reference(x, z, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _dispatch.prepare_triton()
        from ember.kernels import norm as kernels
        kernels.rmsnorm_gated(_groups_3d(x), _groups_3d(z), weight.contiguous(), eps, _groups_3d(out))
    return out


# ----------------------------------------------------------------------------- registration
# Registered ops are what torch.compile sees (fullgraph=True traces through them). In eager mode we
# call _impl directly: the custom-op wrapper costs host time per call (ARCHITECTURE.md has the
# figure measured on the H200), which a decode step of ~100 norms cannot afford.
@torch.library.custom_op("ember::add_rmsnorm", mutates_args=())
def _add_rmsnorm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, new_res = _impl(x, residual, weight, eps)
    return out, new_res


@_add_rmsnorm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("ember::rmsnorm", mutates_args=())
def _rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl(x, None, weight, eps)[0]


@_rmsnorm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("ember::rmsnorm_backward", mutates_args=())
def _rmsnorm_backward_op(grad: torch.Tensor, grad_residual: torch.Tensor | None, s: torch.Tensor,
                         weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_impl(grad, grad_residual, s, weight, eps)


@_rmsnorm_backward_op.register_fake
def _(grad, grad_residual, s, weight, eps):
    return torch.empty_like(s), torch.empty_like(weight)


# Autograd: the forward saves the normalised rows (x, or the stored sum: an output already) and the
# weight; the backward recomputes 1/rms from them (one row read it does anyway) instead of storing it.
def _rmsnorm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rmsnorm_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = _rmsnorm_backward_op(grad, None, x, weight, ctx.eps)
    return gx, gw, None


def _add_rmsnorm_setup(ctx, inputs, output):
    x, residual, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps


def _add_rmsnorm_grad(ctx, grad, grad_residual):
    s, weight = ctx.saved_tensors
    gs, gw = _rmsnorm_backward_op(grad, grad_residual, s, weight, ctx.eps)
    return gs, gs, gw, None  # d(x + residual): the same gradient for both


_rmsnorm_op.register_autograd(_rmsnorm_grad, setup_context=_rmsnorm_setup)
_add_rmsnorm_op.register_autograd(_add_rmsnorm_grad, setup_context=_add_rmsnorm_setup)


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


@torch.library.custom_op("ember::rmsnorm_gated", mutates_args=())
def _rmsnorm_gated_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _gated_impl(x, z, weight, eps)


@_rmsnorm_gated_op.register_fake
def _(x, z, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- public API
def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``residual + x`` then RMSNorm; returns ``(normed, new_residual)``.

    Works on any leading shape with hidden size (last dim) up to 16384; bf16, fp16 or fp32 I/O with
    float32 math. ``x`` and ``residual`` must match in shape and dtype (no broadcasting).
    Differentiable in x, residual and weight (the sum's rounding passes gradients straight through).

    Example:
        >>> x, res = torch.randn(2, 8), torch.randn(2, 8)
        >>> normed, res = ember.ops.add_rmsnorm(x, res, torch.ones(8), eps=1e-6)
    """
    _checks.tensor("residual", residual)
    eps = _validate(x, residual, weight, eps)
    if _dispatch.compiling() or _needs_grad(x, residual, weight):  # the registered op carries autograd
        return _add_rmsnorm_op(x, residual, weight, eps)
    return _impl(x, residual, weight, eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension in float32 math, returned in ``x.dtype``; differentiable in x
    and weight.

    Example:
        >>> y = ember.ops.rmsnorm(torch.randn(3, 16), torch.ones(16), eps=1e-6)
    """
    eps = _validate(x, None, weight, eps)
    if _dispatch.compiling() or _needs_grad(x, weight):
        return _rmsnorm_op(x, weight, eps)
    return _impl(x, None, weight, eps)[0]


def rmsnorm_silu(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                 out: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(rmsnorm(x, weight, eps))`` in one pass (the norm rounded to ``x.dtype`` first, as the
    two-step path stores it); returns ``out`` when given, which must have x's shape and dtype and a
    contiguous last dim (a strided view, such as a slice of a larger buffer, is fine).

    ``bias`` (one value per column, x's dtype): normalise ``x + bias`` (rounded to x.dtype, as a
    separate add stores it) without storing the sum: the previous convolution's bias, folded in
    (the Wan VAE's conv -> norm -> SiLU chain; one pass over the activation fewer).

    Example:
        >>> buf = torch.empty(4, 2, 16)
        >>> y = ember.ops.norm.rmsnorm_silu(torch.randn(4, 16), torch.ones(16), out=buf[:, 1])
    """
    eps = _validate(x, None, weight, eps)
    if bias is not None:
        _checks.tensor("bias", bias, dtypes=(x.dtype,), ndim=1)
        _checks.same_device(x=x, bias=bias)
        if bias.shape[0] != x.shape[-1]:
            raise ValueError(f"bias: expected length {x.shape[-1]} (x.shape[-1]), got {bias.shape[0]}")
    if out is not None:
        _checks.tensor("out", out, dtypes=(x.dtype,))
        _checks.same_shape(x=x, out=out)
        _checks.same_device(x=x, out=out)
        if out.shape[-1] > 1 and out.stride(-1) != 1:
            raise ValueError(f"out: expected a contiguous last dimension, got strides {tuple(out.stride())}")
    if _dispatch.compiling() or not _dispatch.use_triton(x):  # the two-step path (rmsnorm picks its own)
        y = F.silu(rmsnorm(x if bias is None else x + bias, weight, eps))
        return y if out is None else out.copy_(y)
    target = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        try:
            out2 = target.view(-1, x.shape[-1])
        except RuntimeError:
            out2 = None
        if out2 is None:  # rows of out that do not merge into one 2-d view: through a temporary
            target.copy_(rmsnorm_silu(x, weight, eps, bias=bias))
        else:
            _dispatch.prepare_triton()
            from ember.kernels import norm as kernels
            kernels.rmsnorm_silu(_checks.rows_2d(x), weight.contiguous(), eps, out2,
                                 bias=None if bias is None else bias.contiguous())
    return target


def rmsnorm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gated RMSNorm: ``(rmsnorm(x, weight, eps).float() * silu(z.float())).to(x.dtype)`` in one launch.

    The norm is rounded to ``x.dtype`` before the gate, as the two-step path stores it; on the GPU the
    result equals that path bit for bit (same reduction as ``rmsnorm``, torch's silu formula with
    CUDA's expf and IEEE division). ``z`` has x's shape (no broadcasting), any float dtype, and may
    be a strided view (a slice of a fused projection) as long as its last dim is contiguous.

    Example:
        >>> o, z = torch.randn(1, 1, 32, 128), torch.randn(1, 1, 32, 128)
        >>> y = ember.ops.norm.rmsnorm_gated(o, z, torch.ones(128), eps=1e-6)
    """
    eps = _validate(x, None, weight, eps)
    _checks.tensor("z", z, dtypes=_checks.FLOAT_DTYPES)
    _checks.same_shape(x=x, z=z)
    _checks.same_device(x=x, z=z)
    if _dispatch.compiling():
        return _rmsnorm_gated_op(x, z, weight, eps)
    return _gated_impl(x, z, weight, eps)
