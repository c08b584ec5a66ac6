"""Small helpers shared by kernel families: @triton.jit math, the arrival counters of the
"last program to arrive finishes the work" kernels, and programmatic dependent launch."""
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ember.kernels._cache_keys import settle_cache_keys
from ember import _dispatch

# Arrival counters, per (purpose, device, stream): zero between launches (the program that arrives
# last resets its slot), so no memset launch per call. If the first use is during CUDA-graph
# capture, the buffer comes from the graph's pool and its zeroing is captured too (harmless: the
# counters are all zero again at every replay). Per stream, so that two streams never share slots.
_COUNTERS: dict = {}
_RETIRED: list = []


def arrival_counters(purpose: str, device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters for ``purpose`` on the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (purpose, str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:  # a captured graph may still use it: never free it
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return buf


# Tagged words: a float32 value and a 31-bit tag (a counter generation) in one int64. A 64-bit
# aligned store or load is single-copy atomic, so a reader that sees the tag it looks for sees the
# value stored with it: writers store relaxed and arrive relaxed, a reader re-reads the words whose
# tag is older (no release drain: the sampler's and the many-row softmax's kernel docstrings measure it).
@triton.jit
def generation_tag(gen):
    """The tag of a launch in generation ``gen`` (a counter's value // its step, read before the launch
    arrives there): gen + 1 folded into 1 .. 2^31 - 1. Never 0, the tag of a zeroed slot no launch
    wrote: a plain 31-bit gen + 1 would reach 0 after 2^31 - 1 launches (weeks of decoding on one
    workspace) and then take such a slot as fresh."""
    return gen % 0x7FFFFFFF + 1


@triton.jit
def tagged(v, tag):
    """float32 ``v`` and a 31-bit ``tag`` in one int64 word (tag in the high half). Aligned 64-bit
    stores and loads are single-copy atomic: a reader that sees the tag sees the value stored with it."""
    return (tag << 32) | (v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def untagged(w):
    return (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def tagged_load(ptrs, ok, FIRST: tl.constexpr):
    """int64 words from L2 (FIRST: .cg; later polls volatile, so the compiler cannot hoist them)."""
    if FIRST:
        return tl.load(ptrs, mask=ok, other=0, cache_modifier=".cg")
    return tl.load(ptrs, mask=ok, other=0, volatile=True)


@triton.jit
def await_tagged(ptr, n, tag, spin_cap, PAIRS: tl.constexpr, BLOCK: tl.constexpr):
    """The n tagged int64 words at ``ptr`` (PAIRS: n pairs of words, the second of each pair returned
    apart) as [BLOCK] blocks (0 past n), re-read while some word does not carry ``tag`` yet, at most
    ``spin_cap`` reads. Returns (first words, second words (= first without PAIRS), gave up)."""
    i = tl.arange(0, BLOCK)
    ok = i < n
    if PAIRS:
        i = 2 * i
    a = tagged_load(ptr + i, ok, True)
    b = a
    if PAIRS:
        b = tagged_load(ptr + i + 1, ok, True)
    stale = tl.sum((ok & (((a >> 32) != tag) | ((b >> 32) != tag))).to(tl.int32), axis=0)
    polls = 1
    while (stale > 0) & (polls < spin_cap):
        a = tagged_load(ptr + i, ok, False)
        b = a
        if PAIRS:
            b = tagged_load(ptr + i + 1, ok, False)
        stale = tl.sum((ok & (((a >> 32) != tag) | ((b >> 32) != tag))).to(tl.int32), axis=0)
        polls += 1
    return a, b, stale > 0


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast float32 ``x`` to ``dtype`` with round-to-nearest-even, identically on GPU and interpreter.

    The GPU rounds fp32 -> bf16 to nearest even, but Triton's interpreter (how CI runs kernels)
    truncates, even when asked for "rtne". For bf16 we therefore round on the bits ourselves: a few
    integer ops per element, free in the memory-bound kernels that use this.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        as_bf16 = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), as_bf16)  # keep NaN a NaN
    else:
        return x.to(dtype)


# Float32 transcendentals that equal torch's CUDA kernels bit for bit on the GPU. torch computes
# exp with CUDA's expf, log1p with log1pf and divides with IEEE division; Triton's tl.exp lowers to
# the approximate ex2.approx and its fp32 "/" to the approximate div.full, so these use libdevice
# (the same expf / log1pf) and div_rn. Triton's interpreter has no libdevice (LIBDEVICE=False):
# numpy's exp there, which differs from torch's CPU exp in the last bit of ~40% of fp32 values.
@triton.jit
def exp_f32(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def sigmoid_f32(x, LIBDEVICE: tl.constexpr):
    """torch's ``sigmoid`` in float32: ``1 / (1 + exp(-x))``."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x, LIBDEVICE))


@triton.jit
def silu_f32(x, LIBDEVICE: tl.constexpr):
    """torch's ``F.silu`` in float32: ``x / (1 + exp(-x))`` (not ``x * sigmoid(x)``: one rounding less)."""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x, LIBDEVICE))


@triton.jit
def softplus_f32(x, LIBDEVICE: tl.constexpr):
    """torch's ``F.softplus`` (beta=1, threshold=20) in float32: ``x`` where ``x > 20``, else
    ``log1p(exp(x))``."""
    xc = tl.where(x > 20.0, 20.0, x)  # the pass-through lanes never overflow exp; NaN stays NaN
    if LIBDEVICE:
        sp = libdevice.log1p(libdevice.exp(xc))
    else:  # no log1p in the interpreter: log(1 + e) corrected by e / ((1 + e) - 1), a few ulps
        e = tl.exp(xc)
        u = 1.0 + e
        sp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, sp)


@triton.jit
def dot_acc(a, b, acc, MAX_IMPRECISE: tl.constexpr):
    """acc + a @ b on the tensor cores. MAX_IMPRECISE > 0: fp8 MMAs sum at most that many K
    products in Hopper's reduced-precision accumulator before promoting to fp32 (0: Triton's default)."""
    if MAX_IMPRECISE > 0:
        return tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
    return tl.dot(a, b, acc)


# ----------------------------------------------------------------------------- dependent launch
# Programmatic dependent launch (Hopper+): a kernel launched with ``launch_pdl=True`` may start while
# the kernel before it in the stream still runs, once every program of that one has passed
# ``pdl_start``. Batch-1 decode is ~500 short dependent launches per token, each paying launch
# latency and a ramp from empty SMs; with PDL the next kernel's programs are already resident and
# waiting. Contract for every kernel launched with PDL: call ``pdl_start(PDL)`` before it reads any
# input or writes anything (so it also orders writes after the previous kernel's reads), on every
# path. Then, when a kernel starts, the kernel two back has finished, and a chain of such kernels
# behaves like plain stream order. Kernels launched without PDL (torch's) wait for full completion.
@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to finish (its writes visible), then allow the next
    one to launch. A no-op without PDL (and under the interpreter)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=16)
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (dependent launch, bulk L2 prefetch); cached."""
    return device.type == "cuda" and _sm90_or_newer(device.index if device.index is not None
                                                     else torch.cuda.current_device())


def use_pdl(device: torch.device) -> bool:
    """Whether to launch with programmatic dependent launch on ``device``: CUDA, sm_90 or newer, and
    EMBER_PDL not "0" (read per call, so also while a CUDA graph is captured)."""
    return device.type == "cuda" and _dispatch.pdl_allowed() and hopper_or_newer(device)


def pdl_options(device: torch.device) -> dict:
    """Launch keywords of a kernel with a ``PDL`` constexpr: ``PDL`` and Triton's ``launch_pdl``."""
    pdl = use_pdl(device)
    return dict(PDL=pdl, launch_pdl=pdl)


# ----------------------------------------------------------------------------- folded add_rmsnorm
# The decoder's ``add_rmsnorm`` computed inside the kernel that consumes it (the MoE router): every
# program derives the row's norm itself, with the same code and layout, so all agree.
@triton.jit
def residual_sum(x_ptr, res_ptr, ks, K, stride_xk):
    """x + residual at columns ks (x stepped by stride_xk, the residual contiguous), rounded to x's
    dtype as ``add_rmsnorm`` stores it, as fp32."""
    x = tl.load(x_ptr + ks * stride_xk, mask=ks < K, other=0.0)
    r = tl.load(res_ptr + ks, mask=ks < K, other=0.0)
    return round_to(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def residual_inv_rms_after(h0, x_ptr, res_ptr, new_res_ptr, K, stride_xk, eps, store, BLOCK: tl.constexpr):
    """1 / rms of x + residual over all K columns, given its first block ``h0`` (columns 0 .. BLOCK - 1,
    ``residual_sum``); with ``store`` also writes x + residual (the new residual stream) to
    ``new_res_ptr``."""
    ks = tl.arange(0, BLOCK)
    if store:
        tl.store(new_res_ptr + ks, h0.to(new_res_ptr.dtype.element_ty), mask=ks < K)
    ss = h0 * h0
    for k0 in range(BLOCK, K, BLOCK):
        ks = k0 + tl.arange(0, BLOCK)
        h = residual_sum(x_ptr, res_ptr, ks, K, stride_xk)
        if store:
            tl.store(new_res_ptr + ks, h.to(new_res_ptr.dtype.element_ty), mask=ks < K)
        ss += h * h
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def bulk_prefetch_l2(addr, size):
    """Hopper's ``cp.async.bulk.prefetch.L2``: ``size`` bytes at ``addr`` into L2, per lane where
    size != 0 (addr 16-byte aligned, size a multiple of 16; sm_90+). Returns 0s: the caller must use
    the result (e.g. a store masked on it != 0) or the asm is dropped."""
    return tl.inline_asm_elementwise(
        """{ .reg .pred p;
        setp.ne.u32 p, $2, 0;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0; }""", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
