"""Decode-time attention over a static KV cache, as two ops the engine captures in its CUDA graph.

``qk_norm_rope_cache(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads=, eps=)``
    takes one token per row from the fused qkv projection [B, (NH + 2 KVH) * D], applies Qwen3's
    per-head RMSNorm to q and k, rotates both with RoPE at ``positions`` [B], writes k and v into the
    caches [B_max, KVH, S, D] at those positions and returns q [B, NH, D]. One launch instead of ~12.
``prefill_qk_norm_rope_cache(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads=, eps=)``
    the same for a prompt: qkv [B, T, (NH + 2 KVH) * D] at positions 0..T-1, k and v written into
    cache rows 0..B-1, q returned as [B, T, NH, D]. One launch instead of ~20 (two norms, two
    rotations, transposes, two cache copies) per prefill layer; not yet used by the engine (see
    ``_common.Attention.prefill``).
``decode_attention(q, k_cache, v_cache, seq_lens, scale=)``
    attends each row's query heads [B, NH, D] over the first ``seq_lens[b]`` cache entries (GQA:
    NH / KVH query heads share a kv head) and returns [B, NH * D]. The kernel reads only the live
    part of the cache (split over the sequence, then one combine), and the reference only the
    positions below the longest row's length, so the cost grows with the context actually used,
    not with max_seq_len.

The decode kernels read positions and lengths from device tensors and never sync the host, so they can
be captured once and replayed per token. Math in float32; outputs in the I/O dtype.
"""
from __future__ import annotations

import torch

from ember import _dispatch
from ember.ops import _checks

_INT_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- validation
def _validate_cache(k_cache, v_cache, dtype):
    _checks.tensor("k_cache", k_cache, dtypes=_checks.FLOAT_DTYPES, ndim=4)
    _checks.tensor("v_cache", v_cache, dtypes=_checks.FLOAT_DTYPES, ndim=4)
    _checks.same_shape(k_cache=k_cache, v_cache=v_cache)
    if k_cache.dtype != dtype or v_cache.dtype != dtype:
        raise TypeError(f"k_cache/v_cache: expected dtype {dtype} (the dtype of the activations), got {k_cache.dtype}, {v_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {t.stride()}")


def _validate_rope(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps):
    _checks.tensor("qkv", qkv, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    _validate_cache(k_cache, v_cache, qkv.dtype)
    _validate_qkv_heads(qkv, k_cache, num_heads)
    return _validate_norm_rope_args("qkv", qkv.shape[0], q_norm, k_norm, cos, sin, positions, k_cache, v_cache, eps)


def _validate_prenorm(prenorm, qkv) -> tuple[torch.Tensor | None, float]:
    if prenorm is None:
        return None, 0.0
    if not isinstance(prenorm, tuple) or len(prenorm) != 2:
        raise TypeError(f"prenorm: expected a (h, eps) tuple, got {type(prenorm).__name__}")
    h, h_eps = prenorm
    _checks.tensor("prenorm[0]", h, ndim=2)
    _checks.same_device(qkv=qkv, **{"prenorm[0]": h})
    _checks.same_dtype(qkv=qkv, **{"prenorm[0]": h})
    if h.shape[0] != qkv.shape[0]:
        raise ValueError(f"prenorm[0]: expected {qkv.shape[0]} rows (qkv's), got {h.shape[0]}")
    return h.contiguous(), _checks.positive_float("prenorm[1]", h_eps)


def _validate_qkv_heads(qkv, k_cache, num_heads):
    """num_heads against the cache's kv heads, and qkv's last dim against both (shared by decode and prefill)."""
    _, kvh, _, D = k_cache.shape
    if not isinstance(num_heads, int) or num_heads <= 0 or num_heads % kvh:
        raise ValueError(f"num_heads: expected a positive multiple of the cache's {kvh} kv heads, got {num_heads!r}")
    if qkv.shape[-1] != (num_heads + 2 * kvh) * D:
        raise ValueError(f"qkv: expected last dim (num_heads + 2 * kv_heads) * head_dim = {(num_heads + 2 * kvh) * D}, "
                         f"got {qkv.shape[-1]}")
    _checks.same_device(qkv=qkv, k_cache=k_cache)


def _validate_norm_rope_args(rows_name, B, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, eps):
    """Checks shared by the decode and prefill norm + RoPE ops (the caches are checked already)."""
    S, D = k_cache.shape[2], k_cache.shape[3]
    if B > k_cache.shape[0]:
        raise ValueError(f"{rows_name}: expected at most {k_cache.shape[0]} rows (the cache's batch), got {B}")
    if D % 2 or D & (D - 1):
        raise ValueError(f"k_cache: expected a power-of-two head dim, got {D}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        _checks.tensor(name, w, dtypes=_checks.FLOAT_DTYPES, ndim=1)
        if w.shape[0] != D:
            raise ValueError(f"{name}: expected length {D} (head dim), got {w.shape[0]}")
    for name, t in (("cos", cos), ("sin", sin)):
        _checks.tensor(name, t, dtypes=(torch.float32,), ndim=2)
        if t.shape[1] != D // 2 or t.shape[0] < S:
            raise ValueError(f"{name}: expected shape [>= {S}, {D // 2}], got {tuple(t.shape)}")
    if positions is not None:  # None: prefill, positions 0..T-1 implied
        _checks.tensor("positions", positions, dtypes=_INT_DTYPES, ndim=1)
        if positions.shape[0] != B:
            raise ValueError(f"positions: expected length {B} (rows of {rows_name}), got {positions.shape[0]}")
    _checks.same_device(k_cache=k_cache, q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin, positions=positions,
                        v_cache=v_cache)
    return _checks.positive_float("eps", eps)


def _validate_prefill_rope(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps):
    _checks.tensor("qkv", qkv, dtypes=_checks.FLOAT_DTYPES, ndim=3)
    _validate_cache(k_cache, v_cache, qkv.dtype)
    _validate_qkv_heads(qkv, k_cache, num_heads)
    B, T, _ = qkv.shape
    if T > k_cache.shape[2]:
        raise ValueError(f"qkv: expected at most {k_cache.shape[2]} tokens (the cache's length), got {T}")
    return _validate_norm_rope_args("qkv", B, q_norm, k_norm, cos, sin, None, k_cache, v_cache, eps)


def _validate_attention(q, k_cache, v_cache, seq_lens, scale):
    _checks.tensor("q", q, dtypes=_checks.FLOAT_DTYPES, ndim=3)
    _validate_cache(k_cache, v_cache, q.dtype)
    B, NH, D = q.shape
    _, kvh, _, Dc = k_cache.shape
    if D != Dc:
        raise ValueError(f"q: expected head dim {Dc} (the cache's), got {D}")
    if NH % kvh:
        raise ValueError(f"q: expected a multiple of the cache's {kvh} kv heads, got {NH} heads")
    if B > k_cache.shape[0]:
        raise ValueError(f"q: expected at most {k_cache.shape[0]} rows (the cache's batch), got {B}")
    _checks.same_device(q=q, k_cache=k_cache, v_cache=v_cache)
    return _validate_lengths_scale("q", q, seq_lens, scale)


def _validate_lengths_scale(rows_name, rows, seq_lens, scale):
    """seq_lens [B] (one per row of ``rows``, on its device) and a positive scale, which it returns."""
    _checks.tensor("seq_lens", seq_lens, dtypes=_INT_DTYPES, ndim=1)
    if seq_lens.shape[0] != rows.shape[0]:
        raise ValueError(f"seq_lens: expected length {rows.shape[0]} (rows of {rows_name}), got {seq_lens.shape[0]}")
    _checks.same_device(**{rows_name: rows, "seq_lens": seq_lens})
    return _checks.positive_float("scale", scale)


# ----------------------------------------------------------------------------- references
def _head_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last (head) dim in float32, rounded to ``dtype`` (default x's)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype or x.dtype)


def _rope_rounded(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE with cos/sin (broadcastable to x's halves) rounded to x's dtype, products in it."""
    c, s = c.to(x.dtype), s.to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def qk_norm_rope_cache_reference(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps,
                                 prenorm_h=None, prenorm_eps=0.0):
    """Spec: per-head RMSNorm (fp32 math, rounded to the I/O dtype), then RoPE with cos/sin rounded to
    the I/O dtype (as transformers applies it), k and v written at ``positions``. ``prenorm_h``
    [B, H]: qkv is first multiplied, in float32, by 1 / rms(prenorm_h) (eps ``prenorm_eps``), the
    layer's input norm deferred past the projection; v is rounded to the I/O dtype after it."""
    B, dt = qkv.shape[0], qkv.dtype
    kvh, D = k_cache.shape[1], k_cache.shape[3]
    if prenorm_h is not None:
        hf = prenorm_h.float()
        qkv = qkv.float() * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + prenorm_eps)
    q, k, v = qkv.split([num_heads * D, kvh * D, kvh * D], -1)
    c, s = cos[positions][:, None], sin[positions][:, None]
    q = _rope_rounded(_head_rmsnorm(q.reshape(B, num_heads, D), q_norm, eps, dt), c, s)
    k = _rope_rounded(_head_rmsnorm(k.reshape(B, kvh, D), k_norm, eps, dt), c, s)
    rows = torch.arange(B, device=qkv.device)
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v.reshape(B, kvh, D).to(dt)
    return q


def prefill_qk_norm_rope_cache_reference(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps):
    """Spec: ``qk_norm_rope_cache_reference`` for every token of every row, token t at position t."""
    B, T, _ = qkv.shape
    kvh, D = k_cache.shape[1], k_cache.shape[3]
    q, k, v = qkv.split([num_heads * D, kvh * D, kvh * D], -1)
    c, s = cos[:T][None, :, None], sin[:T][None, :, None]
    q = _rope_rounded(_head_rmsnorm(q.reshape(B, T, num_heads, D), q_norm, eps), c, s)
    k = _rope_rounded(_head_rmsnorm(k.reshape(B, T, kvh, D), k_norm, eps), c, s)
    k_cache[:B, :, :T] = k.transpose(1, 2)
    v_cache[:B, :, :T] = v.reshape(B, T, kvh, D).transpose(1, 2)
    return q


def decode_attention_reference(q, k_cache, v_cache, seq_lens, scale):
    """Spec: softmax(q k^T * scale) v over cache entries [0, seq_lens[b]) in float32.

    Reads the cache only below the longest row's length (at least one position, so that a length of 0
    gives NaN as the kernel does), not its whole max_seq_len: one host read of the lengths, skipped
    while a CUDA graph is being captured (a GPU without Triton kernels), which reads the whole cache."""
    B, NH, D = q.shape
    kvh, S = k_cache.shape[1], k_cache.shape[2]
    if not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        S = max(1, min(S, int(seq_lens.max()))) if B else S
    g = NH // kvh
    qf = q.float().reshape(B, kvh, g, D)
    k, v = k_cache[:B, :, :S].float(), v_cache[:B, :, :S].float()
    scores = torch.einsum("bhgd,bhsd->bhgs", qf, k) * scale
    live = torch.arange(S, device=q.device)[None, :] < seq_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), v)
    return out.reshape(B, NH * D).to(q.dtype)


# ----------------------------------------------------------------------------- implementations
def _rope_impl(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps, prenorm_h=None,
               prenorm_eps=0.0):
    if not _dispatch.use_triton(qkv):
        return qk_norm_rope_cache_reference(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps,
                                            prenorm_h, prenorm_eps)
    _dispatch.prepare_triton()
    from ember.kernels import attention as kernels
    q = torch.empty(qkv.shape[0], num_heads, k_cache.shape[3], dtype=qkv.dtype, device=qkv.device)
    kernels.qk_norm_rope_cache(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, q, eps, prenorm_h,
                               prenorm_eps)
    return q


def _prefill_rope_impl(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps):
    if not _dispatch.use_triton(qkv):
        return prefill_qk_norm_rope_cache_reference(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps)
    _dispatch.prepare_triton()
    from ember.kernels import attention as kernels
    B, T, _ = qkv.shape
    q = torch.empty(B, T, num_heads, k_cache.shape[3], dtype=qkv.dtype, device=qkv.device)
    kernels.prefill_qk_norm_rope_cache(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, q, eps)
    return q


def _attention_impl(q, k_cache, v_cache, seq_lens, scale):
    if not _dispatch.use_triton(q):
        return decode_attention_reference(q, k_cache, v_cache, seq_lens, scale)
    _dispatch.prepare_triton()
    from ember.kernels import attention as kernels
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    kernels.decode_attention(q, k_cache, v_cache, seq_lens, scale, out)
    return out


# ----------------------------------------------------------------------------- registration
@torch.library.custom_op("ember::qk_norm_rope_cache", mutates_args=("k_cache", "v_cache"))
def _rope_op(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
             eps: float, prenorm_h: torch.Tensor | None, prenorm_eps: float) -> torch.Tensor:
    return _rope_impl(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps, prenorm_h,
                      prenorm_eps)


@_rope_op.register_fake
def _(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps, prenorm_h, prenorm_eps):
    return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[3])


@torch.library.custom_op("ember::prefill_qk_norm_rope_cache", mutates_args=("k_cache", "v_cache"))
def _prefill_rope_op(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                     eps: float) -> torch.Tensor:
    return _prefill_rope_impl(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps)


@_prefill_rope_op.register_fake
def _(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], num_heads, k_cache.shape[3])


@torch.library.custom_op("ember::decode_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float) -> torch.Tensor:
    return _attention_impl(q, k_cache, v_cache, seq_lens, scale)


@_attention_op.register_fake
def _(q, k_cache, v_cache, seq_lens, scale):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# ----------------------------------------------------------------------------- public API
def qk_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       *, num_heads: int, eps: float = 1e-6,
                       prenorm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """Per-head q/k RMSNorm + RoPE + KV-cache write for one decode token per row; returns q [B, NH, D].

    ``prenorm = (h, h_eps)``, h [B, H] in qkv's dtype: qkv was projected from ``h * norm_weight``
    without the layer's input RMSNorm scale (``moe_experts_add_scale``); q, k, v are first multiplied
    by ``1 / sqrt(mean(h^2) + h_eps)`` in float32, v rounded after it.

    Example:
        >>> B, NH, KVH, D, S = 1, 4, 2, 16, 32
        >>> kc, vc = torch.zeros(B, KVH, S, D), torch.zeros(B, KVH, S, D)
        >>> cos, sin = torch.ones(S, D // 2), torch.zeros(S, D // 2)
        >>> q = ember.ops.attention.qk_norm_rope_cache(torch.randn(B, (NH + 2 * KVH) * D), torch.ones(D),
        ...     torch.ones(D), cos, sin, torch.tensor([3]), kc, vc, num_heads=NH)
    """
    eps = _validate_rope(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps)
    prenorm_h, prenorm_eps = _validate_prenorm(prenorm, qkv)
    if _dispatch.compiling():
        return _rope_op(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps, prenorm_h,
                        prenorm_eps)
    return _rope_impl(qkv, q_norm, k_norm, cos, sin, positions, k_cache, v_cache, num_heads, eps, prenorm_h,
                      prenorm_eps)


def prefill_qk_norm_rope_cache(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_heads: int,
                               eps: float = 1e-6) -> torch.Tensor:
    """Per-head q/k RMSNorm + RoPE + KV-cache write for a prompt; returns q [B, T, NH, D].

    ``qkv`` [B, T, (NH + 2 KVH) * D] holds tokens at positions 0..T-1; their k and v land in cache
    rows 0..B-1, positions 0..T-1. Same math and rounding as :func:`qk_norm_rope_cache` per token.

    Example:
        >>> B, T, NH, KVH, D, S = 1, 5, 4, 2, 16, 32
        >>> kc, vc = torch.zeros(B, KVH, S, D), torch.zeros(B, KVH, S, D)
        >>> cos, sin = torch.ones(S, D // 2), torch.zeros(S, D // 2)
        >>> q = ember.ops.attention.prefill_qk_norm_rope_cache(torch.randn(B, T, (NH + 2 * KVH) * D),
        ...     torch.ones(D), torch.ones(D), cos, sin, kc, vc, num_heads=NH)
    """
    eps = _validate_prefill_rope(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps)
    if _dispatch.compiling():
        return _prefill_rope_op(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps)
    return _prefill_rope_impl(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, num_heads, eps)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     *, scale: float) -> torch.Tensor:
    """Attention of one query token per row over the first ``seq_lens[b]`` cache entries; [B, NH * D].

    On sm_90+ the kernel reads ``seq_lens`` before waiting for the kernel launched just before it
    (programmatic dependent launch): write the lengths two or more kernels earlier in the stream, as
    the engine does (once per step, before the layers), not in the kernel launched right before this
    call.

    Example:
        >>> q, kc, vc = torch.randn(1, 4, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
        >>> out = ember.ops.attention.decode_attention(q, kc, vc, torch.tensor([5]), scale=0.25)
    """
    scale = _validate_attention(q, k_cache, v_cache, seq_lens, scale)
    if _dispatch.compiling():
        return _attention_op(q, k_cache, v_cache, seq_lens, scale)
    return _attention_impl(q, k_cache, v_cache, seq_lens, scale)

