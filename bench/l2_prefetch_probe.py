"""Probe for the next decode-step experiment: does streaming a layer's o_proj weight into L2 on a
side stream, while the latency-bound attention kernels run, make the o_proj GEMV that follows faster?

Why: on the H200 the Qwen3-30B-A3B o_proj GEMV (2048 x 4096 bf16, 16.8 MB) takes ~6.9 us against a
4.04 us HBM floor, and more loads in flight per thread did not help (gemv_step_reduce_sweep.json),
so the loss is the kernel's ramp and tail. The attention kernels before it (q/k norm + RoPE, split,
combine: ~4-5 us) barely use HBM. If the weight is already in the 50 MB L2 when the GEMV starts,
the GEMV reads it at L2 speed. Expected if it works: ~2-3 us per layer, ~0.1 ms per decode step.

The probe builds 48 "layers" (distinct weights, so nothing stays in L2 from one replay to the next),
each: [q/k norm + RoPE + cache write] -> [decode attention] -> [o_proj GEMV], captured in a CUDA
graph as is and with a prefetch of the layer's o_proj weight: plain ``evict_last`` loads forked onto
a side stream, or Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2``, no registers: one lane per
chunk) on the main stream or a side stream. It also times the GEMV alone (HBM), the GEMV with its
weight L2-resident (the ceiling of any gain) and the bulk prefetch alone.

    python bench/l2_prefetch_probe.py OUT_JSON [cache_len]

Measured (H200, bench/results/h200/l2_prefetch_probe.json; cache 400): no variant helps. Per layer
11.3 us as is; bulk prefetch on the main stream 14.4 (132 programs) to 31.6 us (3 programs), on a
side stream 16.1-16.5 us, side-stream plain loads 18.4-67 us. The bulk prefetch kernel itself holds
the stream 3.35 us for 16.8 MB (132 programs), about the HBM time of the bytes, and the GEMV after
it did not get faster (ceiling: 6.85 -> 4.43 us from L2); the side stream's fork and join cost more
than the ceiling. The same prefetch wired into the engine (o_proj during attention, the next layer's
qkv during the MoE block, with and without evict_last) made the Qwen3-30B-A3B step 2.60 ->
4.03-5.50 ms (step_variants_l2_prefetch.json), so those switches were removed.
"""
import json
import sys

import torch
import triton
import triton.language as tl

import ember
from ember.bench import _timing
from ember.models import _common
from ember.kernels._common import pdl_start
from ember.ops import attention as attn_ops

LAYERS, H, NH, KVH, D = 48, 2048, 32, 4, 128


@triton.jit
def _l2_prefetch_kernel(w_ptr, sink_ptr, n_words, BLOCK: tl.constexpr):
    """Read n_words int32 words with evict_last; one sum per program to a sink (keeps the loads)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _bulk_prefetch(addr, size, EVICT_LAST: tl.constexpr):
    """One ``cp.async.bulk.prefetch.L2`` per lane of ``size`` bytes at ``addr`` (skipped where size 0)."""
    if EVICT_LAST:  # kept in L2 ahead of streamed (evict-first) data
        done = tl.inline_asm_elementwise(
            """{ .reg .pred p; .reg .b64 pol;
            setp.ne.u32 p, $2, 0;
            createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
            @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol;
            mov.u32 $0, 0; }""", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        done = tl.inline_asm_elementwise(
            """{ .reg .pred p;
            setp.ne.u32 p, $2, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0; }""", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    return done


@triton.jit
def _l2_bulk_prefetch_kernel(base_ptr, n_bytes, chunk_bytes, sink_ptr, LANES: tl.constexpr,
                       EVICT_LAST: tl.constexpr, PDL: tl.constexpr):
    """Program p prefetches chunks p*LANES .. p*LANES+LANES-1 of ``chunk_bytes`` each of [base, base +
    n_bytes) (base 16-byte aligned, n_bytes and chunk_bytes multiples of 16), then joins the
    dependent-launch chain."""
    pid = tl.program_id(0)
    chunk = pid * LANES + tl.arange(0, LANES)
    start = chunk.to(tl.int64) * chunk_bytes
    size = tl.minimum(tl.maximum(n_bytes - start, 0), chunk_bytes).to(tl.int32)
    done = _bulk_prefetch(base_ptr + start, size, EVICT_LAST)
    pdl_start(PDL)
    # never true (the asm writes 0): keeps the asm's result, and so the asm, alive
    tl.store(sink_ptr + pid + tl.arange(0, LANES) * 0, done, mask=done != 0)


def bulk_prefetch(t: torch.Tensor, sink: torch.Tensor, programs: int, stream=None) -> None:
    """Hopper bulk prefetch (cp.async.bulk.prefetch.L2) of contiguous ``t`` spread over ``programs``
    programs of 128 lanes, one chunk per lane; launched with dependent launch, on ``stream`` if given."""
    raw = t.view(-1).view(torch.uint8)
    n_bytes = raw.numel() // 16 * 16
    chunk = -(-n_bytes // (programs * 128 * 16)) * 16
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream()):
        _l2_bulk_prefetch_kernel[(programs,)](raw, n_bytes, chunk, sink, LANES=128, EVICT_LAST=False, num_warps=4,
                                              PDL=True, launch_pdl=True)


def prefetch(w: torch.Tensor, sink: torch.Tensor, programs: int) -> None:
    words = w.view(torch.int32).view(-1)
    _l2_prefetch_kernel[(programs,)](words, sink, words.numel(), BLOCK=2048, num_warps=8)


def main(path: str, cache_len: int = 400) -> None:
    dev = torch.device("cuda")
    dt = torch.bfloat16
    w_o = [(torch.randn(H, NH * D, device=dev) / 64).to(dt) for _ in range(LAYERS)]
    qkv = [torch.randn(1, (NH + 2 * KVH) * D, device=dev).to(dt) for _ in range(LAYERS)]
    caches = [(torch.randn(1, KVH, 4096, D, device=dev).to(dt), torch.randn(1, KVH, 4096, D, device=dev).to(dt))
              for _ in range(LAYERS)]
    qn, kn = torch.ones(D, device=dev, dtype=dt), torch.ones(D, device=dev, dtype=dt)
    cos, sin = _common.rope_tables(D, 1e6, 4096, dev)
    pos = torch.tensor([cache_len - 1], device=dev)
    lens = (pos + 1).to(torch.int32)
    sink = torch.zeros(1024, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()

    def layer(i: int, programs) -> torch.Tensor:
        """One layer; ``programs`` > 0 forks the o_proj prefetch (plain evict_last loads) with that many
        programs onto a side stream; "bulk_P" / "bulk_side_P" issue the Hopper bulk prefetch with P
        programs on the main stream / a side stream."""
        main_stream = torch.cuda.current_stream()
        if isinstance(programs, str):  # "bulk[_side]_P": P programs, on the side stream or the main one
            p = int(programs.rsplit("_", 1)[1])
            if "_side" in programs:
                side.wait_stream(main_stream)
                bulk_prefetch(w_o[i], sink, p, stream=side)
            else:
                bulk_prefetch(w_o[i], sink, p)
            joined = "_side" in programs
            programs = 0
        else:
            joined = bool(programs)
        if programs:
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                prefetch(w_o[i], sink, programs)
        q = attn_ops.qk_norm_rope_cache(qkv[i], qn, kn, cos, sin, pos, caches[i][0], caches[i][1],
                                        num_heads=NH, eps=1e-6)
        out = attn_ops.decode_attention(q, caches[i][0], caches[i][1], lens, scale=D ** -0.5)
        if joined:
            main_stream.wait_stream(side)
        return ember.ops.linear(out, w_o[i])

    res = {"cache_len": cache_len, "layers": LAYERS, "us_per_layer_by_prefetch_programs": {}}
    # 0 = no prefetch; the prefetch competes with the attention kernels for SMs, so a few sizes
    for programs in (0, "bulk_3", "bulk_33", "bulk_132", "bulk_side_33", "bulk_side_132"):
        us = _timing.graph_time_us([lambda p=programs: [layer(i, p) for i in range(LAYERS)]], replays=20,
                                   calls_per_graph=1)
        res["us_per_layer_by_prefetch_programs"][programs] = us / LAYERS
        print(f"prefetch programs {programs}: {us / LAYERS:.2f} us per layer", flush=True)
    for p in (3, 33, 132):  # how long the prefetch kernel itself holds the stream
        us = _timing.graph_time_us([lambda p=p: [bulk_prefetch(w_o[i], sink, p) for i in range(LAYERS)]],
                                   replays=20, calls_per_graph=1)
        res[f"bulk_prefetch_alone_{p}_us"] = us / LAYERS
        print(f"bulk prefetch alone, {p} programs: {us / LAYERS:.2f} us", flush=True)
    gemv_only = _timing.graph_time_us([lambda: [ember.ops.linear(qkv[i][:, :NH * D], w_o[i]) for i in range(LAYERS)]],
                                      replays=20, calls_per_graph=1)
    res["gemv_alone_us"] = gemv_only / LAYERS
    print(f"o_proj GEMV alone (HBM): {gemv_only / LAYERS:.2f} us", flush=True)
    # the ceiling of the gain: one weight read 48 times stays in L2 after the first
    gemv_l2 = _timing.graph_time_us([lambda: [ember.ops.linear(qkv[i][:, :NH * D], w_o[0]) for i in range(LAYERS)]],
                                    replays=20, calls_per_graph=1)
    res["gemv_from_l2_us"] = gemv_l2 / LAYERS
    print(f"o_proj GEMV, weight L2-resident: {gemv_l2 / LAYERS:.2f} us", flush=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400)
