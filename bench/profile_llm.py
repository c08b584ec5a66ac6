"""Where ember's Qwen3-30B-A3B-shaped forward spends GPU time (4 of the 48 layers, random weights):
per-kernel totals from torch.profiler for a 2048-token prefill and for eager decode steps.

    python bench/profile_llm.py [layers]
"""
import sys

import torch
import transformers

from ember.bench.moe import ember_from_hf


def top_kernels(fn, title: str, rows: int = 22) -> None:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"===== {title}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))


def make_models(layers: int):
    """(HF model, ember Model over its tensors): Qwen3-30B-A3B shapes with ``layers`` layers, random weights."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                      moe_intermediate_size=768, num_hidden_layers=layers, num_attention_heads=32,
                                      num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                      norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    return hf, ember_from_hf(hf, cfg, max_seq_len=2048)


def main(layers: int = 4) -> None:
    hf, em = make_models(layers)
    ids = torch.randint(100, 500, (1, 2048), device="cuda")
    caches = [(k[:1], v[:1]) for k, v in em.caches]
    with torch.no_grad():
        top_kernels(lambda: em.net.prefill(ids, caches, last_only=True), f"ember prefill 2048, {layers} layers")
        top_kernels(lambda: hf(ids, logits_to_keep=1), f"HF forward 2048, {layers} layers")
        tok = torch.tensor([5], device="cuda")
        pos = torch.tensor([300], device="cuda")
        lens = (pos + 1).to(torch.int32)
        top_kernels(lambda: [em.net.decode(tok, pos, lens, em.caches) for _ in range(3)],
                    f"ember eager decode x3, {layers} layers")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
