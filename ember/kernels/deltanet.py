"""Triton kernel for the gated delta rule (Qwen3.5 / Qwen3-Next linear attention).

One program owns one (batch, value head, block of value columns) and keeps its slice of the
[Dk, Dv] recurrent state in registers while it scans the tokens, so a decode step reads and writes
the state once (Qwen3.5-35B-A3B: 32 heads x 128 x 128 fp32 = 2 MB a layer).

With RAW_G / RAW_BETA the kernel also computes the gates from the projections, saving the model's
~5 elementwise launches: ``g = neg_a * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` rounded to
b's dtype, in float32 exactly as the torch expressions (libdevice exp / log1p and IEEE division on
the GPU, see ``_common.exp_f32``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys
from ember.kernels._common import pdl_options, pdl_start, round_to, sigmoid_f32, softplus_f32


@triton.jit
def _gated_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, dt_bias_ptr, neg_a_ptr,
                             T, HV, GROUP, scale,
                             sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                             sgb, sgt, sgh, sbb, sbt, sbh, ssb, ssh, ssk, ssv, sob, sot, soh,
                             DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                             L2NORM: tl.constexpr, HAS_STATE: tl.constexpr, RAW_G: tl.constexpr,
                             RAW_BETA: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_start(PDL)
    # RAW_G: g_ptr holds a (the decay projection); RAW_BETA: beta_ptr holds b (the beta projection)
    pid = tl.program_id(0)
    b = (pid // HV).to(tl.int64)
    hv = pid % HV
    hk = hv // GROUP  # value heads share key heads like GQA (repeat_interleave order)
    ks = tl.arange(0, BLOCK_K)
    kmask = ks < DK
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vs < DV
    smask = kmask[:, None] & vmask[None, :]
    s_ptrs = state_ptr + b * ssb + hv * ssh + ks[:, None] * ssk + vs[None, :] * ssv
    if HAS_STATE:
        S = tl.load(s_ptrs, mask=smask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    if RAW_G:
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        neg_a = tl.load(neg_a_ptr + hv).to(tl.float32)
    for t in range(T):
        q = tl.load(q_ptr + b * sqb + t * sqt + hk * sqh + ks, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * skb + t * skt + hk * skh + ks, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * svb + t * svt + hv * svh + vs, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * sgb + t * sgt + hv * sgh).to(tl.float32)
        if RAW_G:  # torch: neg_a * F.softplus(a.float() + dt_bias)
            g = neg_a * softplus_f32(g + dt_bias, LIBDEVICE)
        beta = tl.load(beta_ptr + b * sbb + t * sbt + hv * sbh)
        if RAW_BETA:  # torch: b.sigmoid(), float32 math rounded to b's dtype
            beta = round_to(sigmoid_f32(beta.to(tl.float32), LIBDEVICE), beta_ptr.dtype.element_ty)
        beta = beta.to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        S = S * tl.exp(g)
        kv_mem = tl.sum(S * k[:, None], axis=0)            # [BLOCK_V]
        delta = (v - kv_mem) * beta
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(o_ptr + b * sob + t * sot + hv * soh + vs, round_to(o, o_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_ptrs, S, mask=smask)


def gated_delta_rule(q, k, v, g, beta, state, out, *, scale: float, l2norm: bool, has_state: bool,
                     dt_bias=None, neg_a=None, raw_beta: bool = False) -> None:
    """q, k [B, T, HK, DK]; v [B, T, HV, DV]; g, beta [B, T, HV]; state [B, HV, DK, DV] fp32 (in/out).

    With ``dt_bias`` and ``neg_a`` [HV] given, ``g`` holds the raw decay projection ``a``; with
    ``raw_beta``, ``beta`` holds the raw projection ``b`` (see the module docstring)."""
    B, T, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    BLOCK_K = triton.next_power_of_2(DK)
    BLOCK_V = min(32, triton.next_power_of_2(DV))  # 128x32 fp32 tile: 32 registers a thread at 4 warps
    grid = (B * HV, triton.cdiv(DV, BLOCK_V))
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state, out, dt_bias if dt_bias is not None else g, neg_a if neg_a is not None else g,
        T, HV, HV // HK, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride(), *beta.stride(), *state.stride(),
        *out.stride()[:3],
        DK=DK, DV=DV, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, L2NORM=l2norm, HAS_STATE=has_state,
        RAW_G=dt_bias is not None, RAW_BETA=raw_beta, LIBDEVICE=q.device.type == "cuda", num_warps=4,
        **pdl_options(q.device))


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
