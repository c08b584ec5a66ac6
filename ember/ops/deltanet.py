"""The gated delta rule: linear attention with a decaying, delta-updated [Dk, Dv] state per head
(Qwen3.5 / Qwen3.6-MoE "linear_attention" layers).

Per token t and value head h (key head ``h // (HV // HK)``)::

    S = S * exp(g_t)                          # decay (g <= 0, log space)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T  # delta-rule write of the correction
    o_t = S^T (q_t / sqrt(Dk))

with q and k L2-normalised first when ``l2norm_qk`` (the Qwen3.5 setting). The state is float32.
"""
from __future__ import annotations

import torch

from ember import _dispatch
from ember.ops import _checks


def _validate(q, k, v, g, beta, state):
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
    for name, t in (("g", g), ("beta", beta)):
        _checks.tensor(name, t, dtypes=_checks.FLOAT_DTYPES, ndim=3)
        if t.shape != (B, T, HV):
            raise ValueError(f"{name}: expected shape {(B, T, HV)}, got {tuple(t.shape)}")
    if state is not None:
        _checks.tensor("state", state, dtypes=(torch.float32,), ndim=4)
        if state.shape != (B, HV, DK, DV):
            raise ValueError(f"state: expected shape {(B, HV, DK, DV)}, got {tuple(state.shape)}")
    if DK > 256 or DV > 256:
        raise ValueError(f"q/v: expected head dims <= 256, got Dk={DK}, Dv={DV}")
    _checks.same_device(q=q, k=k, v=v, g=g, beta=beta, state=state)


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


def _impl(q, k, v, g, beta, state, l2norm_qk):
    if not _dispatch.use_triton(q):
        o, new_state = gated_delta_rule_reference(q, k, v, g, beta, state, l2norm_qk=l2norm_qk)
        if state is not None:
            state.copy_(new_state)
        return o
    # the kernel walks the head dim with unit stride; other strides are copied (a slice of a fused
    # qkv projection is already unit-stride, so models pay nothing)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    B, T, HK, DK = q.shape
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    st = state if state is not None else torch.empty(B, v.shape[2], DK, v.shape[3], dtype=torch.float32,
                                                      device=q.device)
    _dispatch.kernels("deltanet").gated_delta_rule(q, k, v, g, beta, st, out, scale=DK ** -0.5, l2norm=l2norm_qk,
                                                   has_state=state is not None)
    return out


@torch.library.custom_op("ember::gated_delta_rule", mutates_args=("state",))
def _gated_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor | None, l2norm_qk: bool) -> torch.Tensor:
    return _impl(q, k, v, g, beta, state, l2norm_qk)


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, state, l2norm_qk):
    return torch.empty_like(v)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     state: torch.Tensor | None = None, l2norm_qk: bool = True) -> torch.Tensor:
    """Gated delta rule over ``T`` tokens; returns ``o`` [B, T, HV, DV] and updates ``state`` in place.

    q, k: [B, T, HK, DK]; v: [B, T, HV, DV]; g (log decay, <= 0) and beta: [B, T, HV];
    state: [B, HV, DK, DV] float32 or None (start from zeros, discard the final state).

    Example:
        >>> q = k = torch.randn(1, 3, 2, 16); v = torch.randn(1, 3, 4, 16)
        >>> g, beta = -torch.rand(1, 3, 4), torch.rand(1, 3, 4)
        >>> state = torch.zeros(1, 4, 16, 16)
        >>> o = ember.ops.gated_delta_rule(q, k, v, g, beta, state=state)
    """
    _validate(q, k, v, g, beta, state)
    if _dispatch.compiling():
        return _gated_delta_rule_op(q, k, v, g, beta, state, l2norm_qk)
    return _impl(q, k, v, g, beta, state, l2norm_qk)
