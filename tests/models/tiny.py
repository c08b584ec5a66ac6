"""Tiny random Qwen3 / Qwen3-MoE checkpoints built with transformers (the oracle), and a tiny
word-level tokenizer built with `tokenizers`, saved beside them."""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("the a cat dog sat ran on under mat tree big small red blue and then it was happy sad "
         "one two three four five six seven eight nine ten hello world once upon time there lived").split()
SPECIALS = ["<unk>", "<|eos|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|user|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def moe_config(**kw):
    import transformers
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
                rms_norm_eps=1e-6)
    base.update(kw)
    return transformers.Qwen3MoeConfig(**base)


def dense_config(**kw):
    import transformers
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                initializer_range=0.1)
    base.update(kw)
    return transformers.Qwen3Config(**base)


def build(config, seed: int = 0, dtype=torch.float32):
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # norms start at 1.0; make them random so a swapped norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def save(model, path: Path, *, tokenizer: bool = False, **kw) -> Path:
    model.save_pretrained(path, **kw)
    if tokenizer:
        save_tokenizer(path, model.config.vocab_size)
        cfg = json.loads((path / "config.json").read_text())
        cfg["eos_token_id"] = 1
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def save_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    assert len(vocab) <= vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|eos|>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}))


if __name__ == "__main__":  # python -m tests.models.tiny DIR: a tiny Qwen3-MoE checkpoint to try ember on
    import sys
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3-moe")
    # vocabulary = the tokenizer's words, so every sampled id decodes to a word
    save(build(moe_config(vocab_size=len(SPECIALS) + len(WORDS))), out, tokenizer=True)
    print(f"wrote a tiny random Qwen3-MoE checkpoint with a word-level tokenizer to {out}")
