"""``ember bench moe_hybrid``: batch-1 decode of the hybrid MoE families, LFM2-8B-A1B and
Qwen3.5-35B-A3B, ember vs Hugging Face transformers in the same process, full-size random weights
built on the GPU as shared/reference/baseline_h200.py's make_model does (rows for issue 6, to be
merged into bench/results/h200/moe.json).

Floor (H200, 4.15 TB/s; weights read per token, active experts only, lm_head included):
* LFM2-8B-A1B (24 layers, 6 attention; 2 dense MLPs 3x2048x7168; 22 MoE layers, 4 of 32 experts of
  3x2048x1792; conv in/out 4x2048x2048; tied 65536x2048 lm_head): ~1.56 G params = 3.1 GB bf16
  -> 0.75 ms -> ~1,330 tok/s (FP8 weights, bf16 lm_head: ~1.7 GB, ~2,400 tok/s).
* Qwen3.5-35B-A3B (40 layers, 30 DeltaNet + 10 gated attention; 8 of 256 experts of 3x2048x512 plus
  a shared one; DeltaNet projections 2048x16448 + 4096x2048; 248320x2048 lm_head): ~2.94 G params
  = 5.9 GB bf16 -> 1.42 ms -> ~700 tok/s (FP8: ~3.5 GB, ~1,200 tok/s). The recurrent states
  (30 x 32 x 128 x 128 fp32 = 63 MB read and written) add ~3%.
FLOPs are negligible at batch 1 (~6 GFLOP/token -> 8 us at 790 TFLOP/s). transformers' static cache
+ torch.compile runs for both families (H200: LFM2 123 tok/s, Qwen3.5 60 tok/s), so the targets'
30x / 40x of HF's fastest setting (3,690 / 2,411 tok/s) lie above these floors.

ember is timed as one decode step (embedding, all layers, final norm, lm_head, argmax; the engine
adds its sampler) captured once in a CUDA graph and replayed per token after a 128-token prefill;
transformers as ``generate`` (default experts and eager experts; decode rate from the time of n+1
tokens minus 1 token, as baseline_h200.py measures); with ``--hf-compile`` also with a static cache +
torch.compile (the rate of a second identical generate, as ``ember bench moe`` times it), recorded
as an error where transformers does not support it for the model. ``--variants`` also times the
bf16 decode under the VARIANTS below.
"""
from __future__ import annotations

import time

import torch

from ember.bench import BenchContext, Row, variant
from ember.bench import moe as moe_bench

COPY_BW = 4.155e12
PROMPT, STEPS, HF_NEW = 128, 128, 16
TARGETS = {"lfm2_moe_8b_a1b": (600.0, 30.0), "qwen3_5_moe_35b_a3b": (300.0, 40.0)}
# Variants of the bf16 decode timed beside the default (``bench.variant``: switches and tile data
# read while the step is captured): the generic tile entries and the dependent-launch kill switch.
VARIANTS = {"generic_tiles": {"switches": {"EMBER_TUNING": "generic"}}, "pdl_off": {"switches": {"EMBER_PDL": False}}}


def _variant_tok_s(net, ids, steps, spec: dict) -> float | str:
    """bf16 decode tok/s with the graph captured and replayed inside ``variant(spec)``."""
    try:
        with variant(spec):
            return ember_decode(net, ids, steps)["tok_s"]
    except Exception as e:  # recorded, not fatal
        return repr(e)[:200]


def make_hf(kind: str, quick: bool, device):
    import transformers
    if kind == "lfm2_moe_8b_a1b":
        n, attn = (4, {1, 3}) if quick else (24, {2, 6, 10, 14, 18, 21})
        kw = dict(num_hidden_layers=n, layer_types=["full_attention" if i in attn else "conv" for i in range(n)])
        if quick:
            kw.update(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_dense_layers=1)
        cfg = transformers.Lfm2MoeConfig(**kw)
    else:
        kw = {} if not quick else dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=64, linear_key_head_dim=32,
                                       linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                       moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=16,
                                       num_experts_per_tok=4)
        cfg = transformers.Qwen3_5MoeTextConfig(**kw)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval(), cfg


def ember_net(hf, cfg, *, fp8: bool, max_seq_len: int):
    """ember's net over the HF model's own tensors (shared, not copied, where the layouts agree)."""
    from ember.models import _common, lfm2_moe, qwen3_5_moe
    module = lfm2_moe if cfg.model_type == "lfm2_moe" else qwen3_5_moe
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    p = hf.model.embed_tokens.weight
    src = _common.TensorSource(set(sd), sd.__getitem__, p.device, p.dtype)
    with torch.no_grad():
        return module.build(src, cfg.to_dict(), fp8=fp8, max_seq_len=max_seq_len)


def decode_bytes(net) -> int:
    """Weight bytes one batch-1 decode step reads: every parameter once (the embedding only as the
    tied lm_head), stacked experts scaled by the share a token reads (top_k / E; (top_k + 1) / (E + 1)
    with Qwen3.5's shared expert folded in)."""
    frac = {}
    for m in net.modules():
        if hasattr(m, "w_gate_up"):
            f = getattr(m, "experts_read", m.top_k) / m.w_gate_up.shape[0]
            for p in (m.w_gate_up, m.w_down, getattr(m, "gate_up_scale", None), getattr(m, "down_scale", None)):
                if p is not None:
                    frac[p.data_ptr()] = f
    seen, total = set(), 0.0
    for name, p in net.named_parameters():
        if name == "embed" or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size() * frac.get(p.data_ptr(), 1.0)
    return int(total)


def hf_decode_tok_s(model, ids, new_tokens: int) -> float:
    """HF generate decode rate with an explicit all-ones mask (without it, generate treats prompt
    tokens equal to pad_token_id as padding and masks them out of the conv states)."""
    return moe_bench.hf_decode_tok_s(model, ids, new_tokens, attention_mask=torch.ones_like(ids))


def ember_decode(net, ids: torch.Tensor, steps: int) -> dict:
    """Prefill, then ``steps`` greedy decode steps: replays of one captured CUDA graph on the GPU,
    eager calls elsewhere. Returns tok/s, prefill seconds, capture (warm-up) seconds, the tokens."""
    dev, on_gpu = net.embed.device, net.embed.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    caches = net.allocate_caches(1, ids.shape[1] + steps + 8)
    with torch.no_grad():
        sync(); t0 = time.perf_counter()
        first = net.prefill(ids, caches, last_only=True).argmax(-1)
        sync(); prefill_s = time.perf_counter() - t0
        tok, pos = first.clone(), torch.tensor([ids.shape[1]], device=dev)
        lens = (pos + 1).to(torch.int32)

        def step():
            tok.copy_(net.decode(tok, pos, lens, caches).argmax(-1))
            pos.add_(1)
            lens.add_(1)

        capture_s, graph = 0.0, None
        if on_gpu:
            t0 = time.perf_counter()
            saved = [t.clone() for t in (tok, pos, lens)] + [t.clone() for layer in caches for t in layer]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # Triton compiles and autotunes outside the capture
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            # the warm-up advanced the conv / recurrent states: put the post-prefill state back
            for t, s in zip([tok, pos, lens] + [t for layer in caches for t in layer], saved):
                t.copy_(s)
            del saved
            sync(); capture_s = time.perf_counter() - t0
        out = []
        sync(); t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay() if graph is not None else step()
            out.append(tok.clone())
        sync(); dt = time.perf_counter() - t0
    return {"tok_s": steps / dt, "prefill_s": prefill_s, "capture_s": capture_s,
            "tokens": [first.item()] + torch.cat(out).tolist()}


def _family_rows(ctx: BenchContext, kind: str) -> list[Row]:
    quick = ctx.quick or not ctx.on_gpu
    dev = ctx.device
    ctx.progress(f"{kind}: building the HF model")
    t0 = time.perf_counter()
    hf, cfg = make_hf(kind, quick, dev)
    build_s = time.perf_counter() - t0
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = 16 if quick else PROMPT
    ids = torch.randint(100, 500, (1, prompt), generator=gen).to(dev)
    steps = 8 if quick else STEPS

    ctx.progress(f"{kind}: HF generate (default experts, static cache + compile if asked, eager experts)")
    hf_figs, extra_hf = {}, {"hf_model_build_s": build_s}
    settings = ["default", "eager"]
    if ctx.on_gpu and ctx.hf_compile:
        settings.insert(1, "static_compiled")  # with the default experts, before switching to eager
    for impl in settings:
        try:
            if impl == "static_compiled":
                hf_figs[impl], extra_hf["hf_static_compiled_first_call_s"] = moe_bench.hf_static_compiled_tok_s(
                    hf, ids[:, :32], HF_NEW, attention_mask=torch.ones_like(ids[:, :32]))
                continue
            if impl != "default":
                hf.set_experts_implementation(impl)
            hf_figs[impl] = hf_decode_tok_s(hf, ids[:, :32], 4 if quick else HF_NEW)
        except Exception as e:  # recorded: the row keeps whichever setting ran
            hf_figs[impl] = None
            extra_hf[f"hf_{impl}_error"] = repr(e)[:300]
            print(f"{kind}: HF {impl} generate failed: {e!r}"[:300], flush=True)
    hf_best_name, hf_best = max(((k, v) for k, v in hf_figs.items() if v), key=lambda kv: kv[1], default=(None, None))
    extra_hf.update(hf_default_tok_s=hf_figs.get("default"), hf_eager_experts_tok_s=hf_figs.get("eager"),
                    hf_static_compiled_tok_s=hf_figs.get("static_compiled"))
    rows, bf16 = [], None
    for fp8 in (False, True):
        name = f"{kind}_{'fp8' if fp8 else 'bf16'}_b1"
        ctx.progress(f"{name}: ember")
        try:
            t0 = time.perf_counter()
            net = ember_net(hf, cfg, fp8=fp8, max_seq_len=prompt + steps + 8)
            load_s = time.perf_counter() - t0
            r = ember_decode(net, ids, steps)
            floor_ms = decode_bytes(net) / COPY_BW * 1e3
            extra = dict(extra_hf, prefill_s=r["prefill_s"], warmup_s=r["capture_s"], load_s=load_s,
                         floor_ms=floor_ms, roofline_tok_s=1e3 / floor_ms,
                         fraction_of_roofline=r["tok_s"] * floor_ms / 1e3, prompt=prompt, decode_steps=steps)
            if not fp8 and ctx.on_gpu and ctx.variants:
                extra["tok_s_variants"] = {v: _variant_tok_s(net, ids, steps, spec) for v, spec in VARIANTS.items()}
                print(f"{name} variants (tok/s):", extra["tok_s_variants"], flush=True)
            del net
            if not fp8:
                bf16 = r["tok_s"]
                tok_target, x_target = TARGETS[kind]
                meets = r["tok_s"] >= tok_target and bool(hf_best) and r["tok_s"] >= x_target * hf_best
                target = f">= {tok_target:.0f} tok/s and >= {x_target:.0f}x HF's fastest setting"
            else:
                meets = bool(bf16) and r["tok_s"] >= 1.4 * bf16
                target = "report; aim at 1.4x the bf16 row"
                extra["vs_bf16"] = r["tok_s"] / bf16 if bf16 else None
            rows.append(Row(name, "tok/s", r["tok_s"], hf_best,
                            f"HF transformers generate bf16 ({hf_best_name}, the fastest setting that ran)",
                            target=target, meets=meets, extra=extra))
        except Exception as e:
            net = None  # a failed row must not keep its weights alive through the next one
            rows.append(Row(name, "tok/s", 0.0, hf_best, "HF transformers generate bf16", meets=False,
                            extra=dict(extra_hf, error=repr(e)[:400])))
        print("ROW", rows[-1].as_dict(), flush=True)
        if ctx.on_gpu:
            torch.cuda.empty_cache()
    del hf
    if ctx.on_gpu:
        torch.cuda.empty_cache()
    return rows


def run(ctx: BenchContext) -> list[Row]:
    rows = []
    for kind in ("lfm2_moe_8b_a1b", "qwen3_5_moe_35b_a3b"):
        rows += _family_rows(ctx, kind)
    return rows
