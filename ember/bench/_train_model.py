"""Model-level training rows of ``ember bench train`` (the suite in ``ember/bench/train.py`` appends
``rows(ctx)``): one Qwen3-30B-A3B MoE layer forward + backward, and an 8-layer full fine-tuning step.

* ``moe_experts_fwd_bwd_qwen3_30b_a3b_T8192_bf16``: router (F.linear, float32 softmax, top-8,
  renormalise) + experts forward and backward at 8192 tokens, 128 experts, H 2048, I 768: ember's
  ``moe_experts_train`` against transformers 5.17's ``Qwen3MoeSparseMoeBlock`` with its "eager" and
  "grouped_mm" experts backends (``config._experts_implementation``), same weights and grad_out.
  FLOPs: the expert GEMMs are 6 * T*k * H * I forward (gate_up 2*P*H*2I, down 2*P*I*H, P = T*k pairs)
  and twice that backward: 18 * 65536 * 2048 * 768 = 1.855 TFLOP (2.35 ms at 790 TFLOP/s), plus the
  router's 3 * 2*T*H*E = 12.9 GFLOP. Timed by CUDA events around eager calls (median, launch cost in).
* ``train_step_qwen3_moe_30b_a3b_8layers_seq4096_bf16``: 8 full-width Qwen3-30B-A3B decoder layers
  (+ embeddings, norm, 151936-token lm_head), random weights built on the GPU with one seed, batch 1 x
  4096 tokens, full fine-tuning with fused AdamW; stock transformers, ember (``ember.train.patch``) and
  stock + Liger-Kernel (``apply_liger_kernel_to_qwen3_moe``, which patches transformers' classes, so
  it runs last). Per setup: tok/s over steps 10-50 and how a step splits into forward, backward and
  the optimizer (``forward_ms`` / ``backward_ms`` / ``optimizer_ms``), peak GB, the fraction of the
  step's FLOP bound, the loss after 50 steps (same data), and the longest sequence it trains at batch
  1 (doubling from 4096 while a step fits, bounded in time).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ember.bench import BenchContext, Row, _timing

PEAK_FLOPS = 790e12
LOSS_STEPS, TIMED_FROM = 50, 10


def _moe_config(quick: bool, layers: int = 8):
    import transformers
    if quick:
        return transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True, max_position_embeddings=1 << 17,
                                           tie_word_embeddings=False)
    return transformers.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                       moe_intermediate_size=768, num_hidden_layers=layers, num_attention_heads=32,
                                       num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                       norm_topk_prob=True, max_position_embeddings=1 << 17, tie_word_embeddings=False,
                                       decoder_sparse_step=1, mlp_only_layers=[])


def _timer(ctx):
    return _timing.event_time_us if ctx.on_gpu else _timing.host_time_us


# ----------------------------------------------------------------------------- one MoE layer
def moe_layer_row(ctx: BenchContext) -> Row:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    import ember
    cfg = _moe_config(ctx.quick)
    T = 64 if ctx.quick else 8192
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    dev = ctx.device
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).to(device=dev, dtype=dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(T, H, device=dev, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(T, H, device=dev, dtype=dtype)
    params = [x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]

    def ember_step():
        logits = F.linear(x, block.gate.weight)
        tw, ids = torch.topk(logits.float().softmax(-1), k)
        tw = (tw / tw.sum(-1, keepdim=True)).to(dtype)
        out = ember.ops.moe_experts_train(x, block.experts.gate_up_proj, block.experts.down_proj, tw, ids,
                                          check=False)
        return torch.autograd.grad(out, params, grad_out)

    def hf_step():
        out = block(x.view(1, T, H)).view(T, H)
        return torch.autograd.grad(out, params, grad_out)

    flops = 18 * T * k * H * I + 6 * T * H * E
    timer = _timer(ctx)
    ctx.progress("moe layer fwd+bwd: ember")
    want = [g.float() for g in ember_step()]
    t_em = timer([ember_step]) / 1e3
    figures, errors = {}, {}
    for impl in ("eager", "grouped_mm"):
        ctx.progress(f"moe layer fwd+bwd: transformers {impl}")
        cfg._experts_implementation = impl
        try:
            got = hf_step()
            figures[impl] = timer([hf_step]) / 1e3
            # the same gradients as the baseline (relative norm of the difference, x / router / experts)
            errors[impl] = [round(((a.float() - b).norm() / b.norm()).item(), 5) for a, b in zip(got, want)]
        except Exception as e:  # grouped_mm needs a torch with torch._grouped_mm on this device
            figures[impl] = None
            errors[impl] = repr(e)[:200]
    base_name = "grouped_mm" if figures.get("grouped_mm") else "eager"
    base = figures.get(base_name)
    target_ms = 6.0
    return Row("moe_experts_fwd_bwd_qwen3_30b_a3b_T8192_bf16", "ms", t_em, base,
               f"transformers {base_name} experts (Qwen3MoeSparseMoeBlock fwd+bwd)",
               target=f"<= {target_ms} ms (>= 40% of bf16 peak)", meets=t_em <= target_ms if ctx.on_gpu else None,
               extra={"tokens": T, "dtype": str(dtype), "hf_eager_ms": figures.get("eager"), "hf_grouped_mm_ms": figures.get("grouped_mm"),
                      "flops": flops, "fraction_of_peak": flops / (t_em * 1e-3) / PEAK_FLOPS,
                      "grad_rel_diff_vs_ember_x_router_gate_up_down": errors})


# ----------------------------------------------------------------------------- the training step
def _build(cfg, dev, dtype, setup):
    import transformers

    import ember.train
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.train()
    if setup == "ember":
        ember.train.patch(model)
    elif setup == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe
        apply_liger_kernel_to_qwen3_moe(model=model)
    return model


def _step_flops(cfg, S: int) -> float:
    """6 x the active parameters' matmul FLOPs per token x S, plus causal attention (QK^T and PV,
    half the S x S square, x3 for forward + backward)."""
    H, d = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = H * (d + 2 * kv) + d * H + cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size \
        + H * cfg.num_experts
    dense = 6 * S * (cfg.num_hidden_layers * per_layer + H * cfg.vocab_size)
    attention = 3 * cfg.num_hidden_layers * 2 * 2 * S * S * d / 2
    return dense + attention


def _fits(model, opt, S, vocab, dev) -> bool:
    ids = torch.randint(0, vocab, (1, S), device=dev)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.zero_grad(set_to_none=True)
        return True
    except torch.OutOfMemoryError:
        opt.zero_grad(set_to_none=True)
        return False
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _marker(cuda: bool):
    """A function that marks a point in the step: a recorded CUDA event, or the wall clock on CPU."""
    def mark():
        if not cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return mark


def _elapsed_ms(a, b) -> float:
    return a.elapsed_time(b) if isinstance(a, torch.cuda.Event) else (b - a) * 1e3


def _train(ctx, cfg, setup, S, steps, timed_from, search_s):
    dev = ctx.device
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = _build(cfg, dev, dtype, setup)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
    # what full fine-tuning with AdamW keeps resident whatever the kernels: the parameters and the two
    # moment tensors in their dtype (gradients add as much again unless applied during backward)
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    g = torch.Generator(device="cpu").manual_seed(1234)
    data = [torch.randint(0, cfg.vocab_size, (1, S), generator=g) for _ in range(steps)]
    losses, t0, marks = [], None, []
    for i, ids in enumerate(data):
        if i == timed_from:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        mark = _marker(cuda) if i >= timed_from else (lambda: None)
        ids = ids.to(dev)
        m = [mark()]
        loss = model(input_ids=ids, labels=ids).loss
        m.append(mark())
        loss.backward()
        m.append(mark())
        opt.step()
        opt.zero_grad(set_to_none=True)
        m.append(mark())
        losses.append(loss.detach())
        if i >= timed_from:
            marks.append(m)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
    tok_s = (steps - timed_from) * S / seconds
    longest, deadline = S, time.perf_counter() + search_s
    while time.perf_counter() < deadline and longest * 2 <= cfg.max_position_embeddings:
        if not _fits(model, opt, longest * 2, cfg.vocab_size, dev):
            break
        longest *= 2
    out = {"tok_s": tok_s, "peak_gb": peak, "params_and_adamw_states_gb": 3 * weights_gb,
           "with_grads_gb": 4 * weights_gb, "loss_curve": [round(v.item(), 4) for v in losses],
           "final_loss": losses[-1].item(), "longest_seq_b1": longest,
           # where a timed step goes (mean over the timed steps, so the parts add up to the step that
           # tok_s counts, less the host's time between steps; CUDA events on the GPU)
           **{f"{part}_ms": statistics.fmean(_elapsed_ms(m[j], m[j + 1]) for m in marks)
              for j, part in enumerate(("forward", "backward", "optimizer"))},
           "fraction_of_flop_bound": _step_flops(cfg, S) * (steps - timed_from) / seconds / PEAK_FLOPS}
    del model, opt
    return out


def train_step_row(ctx: BenchContext) -> Row:
    cfg = _moe_config(ctx.quick)
    S = 128 if ctx.quick else 4096
    steps, timed_from = (4, 2) if ctx.quick else (LOSS_STEPS, TIMED_FROM)
    search_s = 0.5 if ctx.quick else 45.0  # per setup: the suite stays inside one 10-minute GPU call
    results = {}
    for setup in ("stock", "ember", "liger"):  # Liger patches transformers' classes: last
        ctx.progress(f"train step: {setup}")
        try:
            results[setup] = _train(ctx, cfg, setup, S, steps, timed_from, search_s)
        except ImportError as e:
            results[setup] = {"error": f"not installed: {e}"[:200]}
        except Exception as e:
            results[setup] = {"error": repr(e)[:300]}
    em, st, lg = results["ember"], results["stock"], results["liger"]
    ok = "tok_s" in em and "tok_s" in st
    meets = None
    if ctx.on_gpu and ok:
        meets = (em["tok_s"] >= 2 * st["tok_s"] and em["peak_gb"] <= 0.6 * st["peak_gb"]
                 and ("tok_s" not in lg or em["tok_s"] >= 2 * lg["tok_s"]))
    return Row("train_step_qwen3_moe_30b_a3b_8layers_seq4096_bf16", "tok/s",
               em.get("tok_s", 0.0), st.get("tok_s"), "transformers 5.17 stock, fused AdamW",
               target=">= 2x stock and >= 2x stock+Liger tok/s, peak <= 0.6x stock", meets=meets,
               extra={"setups": results, "steps": steps, "seq": S, "quick": ctx.quick,
                      "step_flops": _step_flops(cfg, S),
                      # the memory target against what no kernel can remove (see _train)
                      "memory_target_gb": 0.6 * st["peak_gb"] if "peak_gb" in st else None,
                      "params_and_adamw_states_gb": em.get("params_and_adamw_states_gb")})


def rows(ctx: BenchContext) -> list[Row]:
    """The two model-level rows (see the module docstring)."""
    return [moe_layer_row(ctx), train_step_row(ctx)]
