"""Fused linear + cross-entropy: the loss of ``x @ weight.T (+ bias)`` against ``target`` without the
[N, V] logits.

Per row, with z the logits (soft-capped: ``z = cap * tanh(z / cap)`` when ``logit_softcap`` is
given), ``lse = logsumexp(z)`` and smoothing eps over V classes::

    loss = lse - (1 - eps) * z[target] - eps / V * sum(z)          (0 on rows whose target is ignore_index)
    dloss/dz = softmax(z) - (1 - eps) * onehot(target) - eps / V

which is ``F.cross_entropy(z.float(), target, ignore_index=, label_smoothing=, reduction=)``.
"mean" divides by the number of rows not ignored (0 when all are ignored, with zero gradients).

The forward keeps only a float32 logsumexp per row; the backward recomputes the logits a vocab chunk
at a time (ember/kernels/cross_entropy.py says how). The reference, also the CPU / MPS path, does
the same math in plain torch over row chunks, so it too stays memory-bounded.
"""
from __future__ import annotations

import torch

from ember import _dispatch
from ember.ops import _checks

REDUCTIONS = ("mean", "sum", "none")
_REF_CHUNK_ELEMENTS = 1 << 22  # float32 logits per reference chunk (16 MB): rows = this // V
_G_CHUNK_BYTES = 16 << 20  # the kernel path's gradient-of-logits buffer per vocab chunk


# ----------------------------------------------------------------------------- validation
def _validate(x, weight, target, bias, ignore_index, reduction, label_smoothing, logit_softcap, check):
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    _checks.tensor("weight", weight, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    _checks.tensor("target", target, dtypes=(torch.int64, torch.int32))
    _checks.same_dtype(x=x, weight=weight)
    if bias is not None:
        _checks.tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES, ndim=1)
        _checks.same_dtype(x=x, bias=bias)
    _checks.same_device(x=x, weight=weight, target=target, bias=bias)
    V, H = weight.shape
    if x.shape[-1] != H:
        raise ValueError(f"x: expected last dim {H} (weight.shape[1]), got shape {tuple(x.shape)}")
    if V < 1:
        raise ValueError(f"weight: expected at least one row (the vocabulary), got shape {tuple(weight.shape)}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target: expected shape {tuple(x.shape[:-1])} (x.shape[:-1]), got {tuple(target.shape)}")
    if bias is not None and bias.shape[0] != V:
        raise ValueError(f"bias: expected length {V} (weight.shape[0]), got {bias.shape[0]}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing: expected a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1), got {label_smoothing}")
    if logit_softcap is not None:
        logit_softcap = _checks.positive_float("logit_softcap", logit_softcap)
    if not isinstance(check, bool):
        raise TypeError(f"check: expected a bool, got {type(check).__name__}")
    if check and not _checks.capturing() and target.numel():
        bad = (target != ignore_index) & ((target < 0) | (target >= V))
        if bool(bad.any()):  # one sync; check=False skips it
            v = int(target[bad][0])
            raise ValueError(f"target: expected class ids in [0, {V}) (weight.shape[0]) or ignore_index "
                             f"({ignore_index}), got {v}")
    return float(label_smoothing), logit_softcap


# ----------------------------------------------------------------------------- reference
def _ref_logits(x, weight, bias, softcap):
    """float32 logits of a row chunk, and tanh(z / cap) (None without a cap)."""
    z = x.float() @ weight.float().t()
    if bias is not None:
        z = z + bias.float()
    if softcap is None:
        return z, None
    th = torch.tanh(z / softcap)
    return softcap * th, th


def _row_chunks(N: int, V: int):
    step = max(1, _REF_CHUNK_ELEMENTS // V)
    return [(i, min(N, i + step)) for i in range(0, N, step)]


def _ref_forward(x2, weight, bias, target, ignore_index, smoothing, softcap):
    N, V = x2.shape[0], weight.shape[0]
    losses, lses = [], []
    for i, j in _row_chunks(N, V):
        z, _ = _ref_logits(x2[i:j], weight, bias, softcap)
        t = target[i:j].long()
        valid = t != ignore_index
        lse = torch.logsumexp(z, dim=-1)
        zt = z.gather(1, torch.where(valid, t, 0)[:, None])[:, 0]
        loss = lse - (1.0 - smoothing) * zt
        if smoothing:
            loss = loss - smoothing * z.mean(dim=-1)
        losses.append(torch.where(valid, loss, 0.0))
        lses.append(lse)
    if N == 0:
        return x2.new_zeros(0, dtype=torch.float32), x2.new_zeros(0, dtype=torch.float32)
    return torch.cat(losses), torch.cat(lses)


def _ref_backward(x2, weight, bias, target, lse, scale, ignore_index, smoothing, softcap, need_x, need_w):
    """Gradients in float32 of sum(scale * loss_rows); ``scale`` is 0 on ignored rows."""
    N, V = x2.shape[0], weight.shape[0]
    wf = weight.float()
    gx = torch.zeros(N, x2.shape[1], dtype=torch.float32, device=x2.device) if need_x else None
    gw = torch.zeros(weight.shape, dtype=torch.float32, device=x2.device) if need_w else None
    gb = torch.zeros(V, dtype=torch.float32, device=x2.device) if (bias is not None and need_w) else None
    for i, j in _row_chunks(N, V):
        z, th = _ref_logits(x2[i:j], weight, bias, softcap)
        g = torch.exp(z - lse[i:j, None]) - smoothing / V
        t = target[i:j].long()
        valid = t != ignore_index
        g[torch.arange(j - i, device=g.device)[valid], t[valid]] -= 1.0 - smoothing
        g = g * scale[i:j, None]
        if th is not None:
            g = g * (1.0 - th * th)
        if need_x:
            gx[i:j] = g @ wf
        if need_w:
            gw += g.t() @ x2[i:j].float()
            if gb is not None:
                gb += g.sum(0)
    return gx, gw, gb


# ----------------------------------------------------------------------------- kernel path
def _kernel_forward(x2, weight, bias, target, ignore_index, smoothing, softcap):
    _dispatch.prepare_triton()
    from ember.kernels import cross_entropy as k
    m, s, zt, zs = k.lse_partials(x2, weight, bias, target, softcap, smoothing > 0)
    mx = m.max(dim=0).values  # [N]; finite: every split saw at least one column
    lse = mx + torch.log((s * torch.exp(m - mx)).sum(dim=0))
    loss = lse - (1.0 - smoothing) * zt.sum(dim=0)
    if smoothing:
        loss = loss - smoothing / weight.shape[0] * zs.sum(dim=0)
    return torch.where(target != ignore_index, loss, 0.0), lse


def _kernel_backward(x2, weight, bias, target, lse, scale, smoothing, softcap, need_x, need_w):
    _dispatch.prepare_triton()
    from ember.kernels import cross_entropy as k
    N, H = x2.shape
    V = weight.shape[0]
    # a vocab chunk's [N, Vc] gradient buffer stays within _G_CHUNK_BYTES (a multiple of 256 columns)
    vc = max(256, (_G_CHUNK_BYTES // max(1, N * x2.element_size())) // 256 * 256)
    vc = min(vc, V)
    g = torch.empty(N, vc, dtype=x2.dtype, device=x2.device)
    acc = torch.zeros(N, H, dtype=torch.float32, device=x2.device) if need_x else None
    gw = torch.empty_like(weight) if need_w else None
    gb = torch.empty(V, dtype=torch.float32, device=x2.device) if (need_w and bias is not None) else None
    for v0 in range(0, V, vc):
        v1 = min(V, v0 + vc)
        gc = g[:, : v1 - v0]
        k.grad_logits(x2, weight, bias, target, lse, scale, softcap, 1.0 - smoothing, smoothing / V, v0, gc)
        if need_w:
            torch.mm(gc.t(), x2, out=gw[v0:v1])  # the K = N reduction inside one GEMM: no atomics
            if gb is not None:
                torch.sum(gc, dim=0, dtype=torch.float32, out=gb[v0:v1])
        if need_x:
            k.mm_accumulate(gc, weight[v0:v1], acc)
    return acc, gw, gb


# ----------------------------------------------------------------------------- registration
def _rows_2d(x, weight, target):
    x2 = _checks.rows_2d(x)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    return x2, w, target.reshape(-1).contiguous()


@torch.library.custom_op("ember::linear_cross_entropy_rows", mutates_args=())
def _lce_rows_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                 ignore_index: int, smoothing: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss, per-row logsumexp), both float32 [N], of 2-d x [N, H] and 1-d target [N]."""
    x2, w, t = _rows_2d(x, weight, target)
    if x2.shape[0] and _dispatch.use_triton(x2):
        return _kernel_forward(x2, w, bias, t, ignore_index, smoothing, softcap)
    return _ref_forward(x2, w, bias, t, ignore_index, smoothing, softcap)


@_lce_rows_op.register_fake
def _(x, weight, bias, target, ignore_index, smoothing, softcap):
    n = x.shape[0]
    return x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("ember::linear_cross_entropy_backward", mutates_args=())
def _lce_backward_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                     lse: torch.Tensor, scale: torch.Tensor, ignore_index: int, smoothing: float,
                     softcap: float | None, need_x: bool, need_w: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad x, grad weight, grad bias) in their inputs' dtypes; an unneeded one is an empty tensor."""
    x2, w, t = _rows_2d(x, weight, target)
    if x2.shape[0] and _dispatch.use_triton(x2):
        gx, gw, gb = _kernel_backward(x2, w, bias, t, lse, scale, smoothing, softcap, need_x, need_w)
    else:
        gx, gw, gb = _ref_backward(x2, w, bias, t, lse, scale, ignore_index, smoothing, softcap, need_x, need_w)
    def empty():  # one per unneeded output: custom-op outputs may not alias each other
        return x.new_empty(0)
    return (gx.to(x.dtype).view(x.shape) if gx is not None else empty(),
            gw.to(weight.dtype) if gw is not None else empty(),
            gb.to(bias.dtype) if gb is not None else empty())


@_lce_backward_op.register_fake
def _(x, weight, bias, target, lse, scale, ignore_index, smoothing, softcap, need_x, need_w):
    return (torch.empty_like(x) if need_x else x.new_empty(0), torch.empty_like(weight) if need_w else x.new_empty(0),
            torch.empty_like(bias) if (need_w and bias is not None) else x.new_empty(0))


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, ignore_index, smoothing, softcap = inputs
    ctx.save_for_backward(x, weight, bias, target, output[1])
    ctx.args = (ignore_index, smoothing, softcap)


def _backward(ctx, grad_loss, grad_lse):
    x, weight, bias, target, lse = ctx.saved_tensors
    ignore_index, smoothing, softcap = ctx.args
    need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    # lse is an internal output: its gradient never flows (the public function does not return it)
    scale = torch.where(target.reshape(-1) != ignore_index, grad_loss.float(), 0.0)
    gx, gw, gb = _lce_backward_op(x, weight, bias, target, lse, scale, ignore_index, smoothing, softcap,
                                  need_x, need_w or need_b)
    return (gx if need_x else None, gw if need_w else None, gb if (need_b and bias is not None) else None,
            None, None, None, None)


_lce_rows_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public API
def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, logit_softcap: float | None = None,
                         check: bool = True) -> torch.Tensor:
    """Cross-entropy of the logits ``x @ weight.T + bias`` against ``target``, never materialising them.

    ``x``: [..., H] bfloat16 / float16 / float32; ``weight``: [V, H] and ``bias``: [V] in x's dtype;
    ``target``: int64 / int32 class ids shaped ``x.shape[:-1]``, ``ignore_index`` marking rows that do
    not count. Float32 math throughout; the loss is float32: a scalar for "mean" (over rows not
    ignored; 0 when none count) and "sum", ``target.shape`` for "none". ``label_smoothing`` and
    ``logit_softcap`` (``z = cap * tanh(z / cap)``, Gemma-2's final softcap) follow
    ``F.cross_entropy`` on the capped logits. Differentiable in x, weight and bias.

    ``check=True`` validates target ids on the device (one sync; skipped while capturing or
    compiling); ``check=False`` skips it.

    Example:
        >>> x, w = torch.randn(6, 32, requires_grad=True), torch.randn(100, 32, requires_grad=True)
        >>> t = torch.tensor([1, 5, -100, 99, 0, 7])
        >>> loss = ember.ops.linear_cross_entropy(x, w, t)
        >>> loss.backward()
    """
    smoothing, softcap = _validate(x, weight, target, bias, ignore_index, reduction, label_smoothing,
                                   logit_softcap, check)
    H = weight.shape[1]
    rows, _ = _lce_rows_op(x.reshape(-1, H), weight, bias, target.reshape(-1), ignore_index, smoothing, softcap)
    if reduction == "none":
        return rows.view(target.shape)
    if reduction == "sum":
        return rows.sum()
    count = (target != ignore_index).sum().clamp(min=1)  # all ignored: 0 / 1, zero gradients
    return rows.sum() / count
