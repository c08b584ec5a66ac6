"""The gated delta rule: linear attention with a decaying, delta-updated [Dk, Dv] state per head
(Qwen3.5 / Qwen3.6-MoE "linear_attention" layers).

Per token t and value head h (key head ``h // (HV // HK)``)::

    S = S * exp(g_t)                          # decay (g <= 0, log space)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T  # delta-rule write of the correction
    o_t = S^T (q_t / sqrt(Dk))

with q and k L2-normalised first when ``l2norm_qk`` (the Qwen3.5 setting). The state is float32.

The gates may come raw, as the model projects them, to be computed inside the kernel (no extra
launches): ``g = neg_a * softplus(a.float() + dt_bias)`` (float32, softplus with threshold 20) from
``a``, ``dt_bias``, ``neg_a``, and ``beta = sigmoid(b)`` rounded to ``b.dtype`` from ``b``, exactly
the torch expressions ``neg_a * F.softplus(a.float() + dt_bias)`` and ``b.sigmoid()``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import _dispatch
from ember.ops import _checks


def _validate_gates(B, T, HV, g, beta, a, dt_bias, neg_a, b):
    raw = {"a": a, "dt_bias": dt_bias, "neg_a": neg_a}
    if g is None and any(t is None for t in raw.values()):
        missing = ", ".join(n for n, t in raw.items() if t is None)
        raise ValueError(f"g: expected g, or a, dt_bias and neg_a to compute it; got g=None and no {missing}")
    if g is not None and any(t is not None for t in raw.values()):
        given = ", ".join(n for n, t in raw.items() if t is not None)
        raise ValueError(f"g: expected either g or (a, dt_bias, neg_a), got both g and {given}")
    if (beta is None) == (b is None):
        raise ValueError("beta: expected exactly one of beta and b (the raw projection), got "
                         + ("neither" if beta is None else "both"))
    for name, t in (("g", g), ("beta", beta), ("a", a), ("b", b)):
        if t is not None:
            _checks.tensor(name, t, dtypes=_checks.FLOAT_DTYPES, ndim=3)
            if t.shape != (B, T, HV):
                raise ValueError(f"{name}: expected shape {(B, T, HV)}, got {tuple(t.shape)}")
    for name, t in (("dt_bias", dt_bias), ("neg_a", neg_a)):
        if t is not None:
            _checks.tensor(name, t, dtypes=_checks.FLOAT_DTYPES, ndim=1)
            if t.shape[0] != HV:
                raise ValueError(f"{name}: expected shape ({HV},) (one per value head), got {tuple(t.shape)}")


def _validate(q, k, v, g, beta, state, a=None, dt_bias=None, neg_a=None, b=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(name, t, dtypes=_checks.FLOAT_DTYPES, ndim=4)
    _checks.same_dtype(q=q, k=k, v=v)
    _checks.same_shape(q=q, k=k)
    B, T, HK, DK = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v: expected shape [{B}, {T}, HV, DV] (batch and length of q), got {tuple(v.shape)}")
    HV, DV = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"v: expected a number of value heads divisible by the {HK} key heads of q, got {HV}")
    _validate_gates(B, T, HV, g, beta, a, dt_bias, neg_a, b)
    if state is not None:
        _checks.tensor("state", state, dtypes=(torch.float32,), ndim=4)
        if state.shape != (B, HV, DK, DV):
            raise ValueError(f"state: expected shape {(B, HV, DK, DV)}, got {tuple(state.shape)}")
    if DK > 256 or DV > 256:
        raise ValueError(f"q/v: expected head dims <= 256, got Dk={DK}, Dv={DV}")
    _checks.same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, a=a, dt_bias=dt_bias, neg_a=neg_a, b=b)


def gates_reference(a, dt_bias, neg_a, b):
    """The spec of the raw gates: ``(g, beta)`` as the Qwen3.5 model computes them in torch."""
    g = neg_a * F.softplus(a.float() + dt_bias) if a is not None else None
    return g, (b.sigmoid() if b is not None else None)


def gated_delta_rule_reference(q, k, v, g, beta, state=None, *, l2norm_qk=True):
    """The spec: a token-by-token float32 scan. Returns ``(o, final_state)``; ``state`` is not modified."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    qf, kf = q.float().repeat_interleave(HV // HK, 2), k.float().repeat_interleave(HV // HK, 2)
    if l2norm_qk:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf = qf * DK ** -0.5
    S = state.clone() if state is not None else q.new_zeros(B, HV, DK, DV, dtype=torch.float32)
    out = torch.empty(B, T, HV, DV, dtype=torch.float32, device=q.device)
    for t in range(T):
        S = S * g[:, t].float().exp()[..., None, None]
        kv_mem = (S * kf[:, t, :, :, None]).sum(-2)
        delta = (v[:, t].float() - kv_mem) * beta[:, t].float()[..., None]
        S = S + kf[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (S * qf[:, t, :, :, None]).sum(-2)
    return out.to(v.dtype), S


def _impl(q, k, v, g, beta, state, l2norm_qk, a=None, dt_bias=None, neg_a=None, b=None):
    if not _dispatch.use_triton(q):
        g_raw, beta_raw = gates_reference(a, dt_bias, neg_a, b)
        g = g if g is not None else g_raw
        beta = beta if beta is not None else beta_raw
        o, new_state = gated_delta_rule_reference(q, k, v, g, beta, state, l2norm_qk=l2norm_qk)
        if state is not None:
            state.copy_(new_state)
        return o
    # the kernel walks the head dim with unit stride; other strides are copied (a slice of a fused
    # qkv projection is already unit-stride, so models pay nothing)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if g is None:  # the kernel reads one scalar per head at offset hv
        dt_bias, neg_a = dt_bias.contiguous(), neg_a.contiguous()
    B, T, HK, DK = q.shape
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    st = state if state is not None else torch.empty(B, v.shape[2], DK, v.shape[3], dtype=torch.float32,
                                                      device=q.device)
    _dispatch.prepare_triton()
    from ember.kernels import deltanet as kernels
    kernels.gated_delta_rule(
        q, k, v, g if g is not None else a, beta if beta is not None else b, st, out, scale=DK ** -0.5,
        l2norm=l2norm_qk, has_state=state is not None, dt_bias=dt_bias if g is None else None,
        neg_a=neg_a if g is None else None, raw_beta=beta is None)
    return out


@torch.library.custom_op("ember::gated_delta_rule", mutates_args=("state",))
def _gated_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
                         beta: torch.Tensor | None, state: torch.Tensor | None, l2norm_qk: bool,
                         a: torch.Tensor | None, dt_bias: torch.Tensor | None, neg_a: torch.Tensor | None,
                         b: torch.Tensor | None) -> torch.Tensor:
    return _impl(q, k, v, g, beta, state, l2norm_qk, a, dt_bias, neg_a, b)


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, state, l2norm_qk, a, dt_bias, neg_a, b):
    return torch.empty_like(v)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
                     beta: torch.Tensor | None = None, *, state: torch.Tensor | None = None, l2norm_qk: bool = True,
                     a: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                     neg_a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> torch.Tensor:
    """Gated delta rule over ``T`` tokens; returns ``o`` [B, T, HV, DV] and updates ``state`` in place.

    q, k: [B, T, HK, DK]; v: [B, T, HV, DV]; g (log decay, <= 0) and beta: [B, T, HV];
    state: [B, HV, DK, DV] float32 or None (start from zeros, discard the final state).
    Instead of ``g``: ``a`` [B, T, HV] with ``dt_bias`` and ``neg_a`` [HV] (``g = neg_a *
    softplus(a.float() + dt_bias)``); instead of ``beta``: ``b`` [B, T, HV] (``beta = b.sigmoid()``,
    in b's dtype). The kernel computes these, bit for bit as torch does on the GPU.

    Example:
        >>> q = k = torch.randn(1, 3, 2, 16); v = torch.randn(1, 3, 4, 16)
        >>> g, beta = -torch.rand(1, 3, 4), torch.rand(1, 3, 4)
        >>> state = torch.zeros(1, 4, 16, 16)
        >>> o = ember.ops.gated_delta_rule(q, k, v, g, beta, state=state)
        >>> a, b = torch.randn(1, 3, 4), torch.randn(1, 3, 4)  # raw projections, gates in the kernel
        >>> o = ember.ops.gated_delta_rule(q, k, v, a=a, dt_bias=torch.zeros(4), neg_a=-torch.ones(4), b=b)
    """
    _validate(q, k, v, g, beta, state, a, dt_bias, neg_a, b)
    if _dispatch.compiling():
        return _gated_delta_rule_op(q, k, v, g, beta, state, l2norm_qk, a, dt_bias, neg_a, b)
    return _impl(q, k, v, g, beta, state, l2norm_qk, a, dt_bias, neg_a, b)
