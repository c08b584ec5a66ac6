"""``ember generate``: load a checkpoint, print the continuation as it is decoded, then one line of
figures (prompt tok/s, decode tok/s, peak memory).

Example:
    $ ember generate --model ./Qwen3-30B-A3B --prompt "The capital of France is" --max-new-tokens 32
"""
from __future__ import annotations

import sys

HELP = "generate text from a local Hugging Face checkpoint (Qwen3, Qwen3-MoE)"


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fp8", action="store_true", help="quantise weights to FP8 on load")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="with --fp8 or an FP8 checkpoint: the lm_head in FP8 too (faster; logits rounded to fp8)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-seq-len", type=int, default=None, help="KV cache length (default: prompt + new tokens)")


def _peak_memory_gb(device) -> float:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def run(args) -> int:
    import ember
    try:
        sampling = ember.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                        min_p=args.min_p, seed=args.seed)
    except (TypeError, ValueError) as e:
        print(f"ember generate: {e}", file=sys.stderr)
        return 2
    try:
        # Size the cache to this request: the tokenizer is needed first, so load once with a
        # generous length when none is given.
        model = ember.load(args.model, device=args.device, dtype=args.dtype, fp8=args.fp8,
                           max_seq_len=args.max_seq_len or 4096, fp8_lm_head=args.fp8_lm_head)
        prompt = args.prompt
        if args.chat:
            if model.tokenizer is None:
                raise ValueError(f"{args.model}: --chat needs tokenizer files (tokenizer.json)")
            prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        for piece in model.stream(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as e:
        print(f"\nember generate: {e}", file=sys.stderr)
        return 2
    st = model.stats
    print(f"\n[{st.prompt_tokens} prompt tokens: {st.prompt_tok_s:.1f} tok/s | {st.new_tokens} new tokens: "
          f"{st.decode_tok_s:.1f} tok/s decode | peak memory {_peak_memory_gb(model.device):.2f} GB"
          f"{' | fp8' if model.fp8 else ''}]")
    return 0
