"""A/B of the Qwen3-30B-A3B decode step (48 layers, random weights on the GPU): the CUDA-graph step
time (ms, three timings each) of every variant on the same weights and prompt, for a cache sized to
the request (max_seq_len 400) and ember.load's default (4096).

A variant is what ``ember.bench.variant`` takes: switch values and tile entries read while the step is
captured. The built-in ones are ``ember.bench.moe.STEP_VARIANTS`` (default, generic_tiles, pdl_off); a
file adds more, e.g. a tile sweep of the attention projections:

    {"qkv_8x16x8": {"tuning": {"gemv": {"bf16:5120x2048": {"BLOCK_N": 8, "CHUNKS": 16, "num_warps": 8,
                                                            "STEP_REDUCE": true}}}}}

Usage (on a CUDA machine):
    python bench/step_variants.py OUT_JSON [--names A,B] [--sizes 400,4096] [--fp8] [--batch 8] [--new 32]
        [--variants FILE.json]
"""
from __future__ import annotations

import argparse
import json


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file the step times are written to")
    ap.add_argument("--names", default="", help="comma-separated variants to time (default: all)")
    ap.add_argument("--sizes", default="400,4096", help="comma-separated cache sizes (max_seq_len)")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (quantised on load) instead of bf16")
    ap.add_argument("--batch", type=int, default=1, help="rows decoded per step")
    ap.add_argument("--variants", default="", help="JSON file of {name: variant} added to the built-in ones")
    ap.add_argument("--new", type=int, default=32, help="tokens decoded after the 128-token prompt before timing")
    a = ap.parse_args(argv)
    a.names = [n for n in a.names.split(",") if n] or None
    a.sizes = tuple(int(v) for v in a.sizes.split(","))
    return a


def load_variants(path: str) -> dict[str, dict]:
    """The built-in variants plus those of ``path`` (each checked for its parts)."""
    from ember.bench import moe as moe_bench
    extra = json.load(open(path)) if path else {}
    for name, spec in extra.items():
        if not isinstance(spec, dict) or set(spec) - {"switches", "tuning"}:
            raise ValueError(f"{path}: variant {name!r}: expected an object with 'switches' and/or 'tuning'")
    return dict(moe_bench.STEP_VARIANTS) | extra


def main(a: argparse.Namespace) -> None:
    import torch

    from ember.bench import moe as moe_bench, variant
    variants = load_variants(a.variants)
    unknown = set(a.names or ()) - set(variants)
    if unknown:
        raise SystemExit(f"step_variants: unknown variant(s) {sorted(unknown)}; known: {', '.join(variants)}")
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    em = moe_bench.ember_from_hf(hf, cfg, fp8=a.fp8, max_seq_len=400, table_len=max(4096, *a.sizes))
    prompts = torch.randint(100, 1000, (a.batch, 128)).tolist()
    steps = {}
    for max_seq_len in a.sizes:
        for name, spec in variants.items():
            if a.names and name not in a.names:
                continue
            key = f"{name}@{max_seq_len}"
            try:
                with variant(spec):
                    m = moe_bench.ember_from_hf(hf, cfg, fp8=a.fp8, max_seq_len=max_seq_len, max_batch_size=a.batch,
                                                net=em.net)
                    moe_bench.ember_decode(m, prompts, a.new)  # the step is timed at 128 + new tokens
                    steps[key] = [round(moe_bench.graph_step_ms(m, a.batch), 4) for _ in range(3)]
            except Exception as e:  # recorded, not fatal
                steps[key] = repr(e)[:300]
            m = None
            torch.cuda.empty_cache()
            print(key, steps[key], flush=True)
    with open(a.out, "w") as f:
        json.dump({"graph_step_ms": steps, "variants": {k: v for k, v in variants.items() if not a.names or k in a.names},
                   "batch": a.batch, "fp8": a.fp8, "new_tokens": a.new, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main(parse_args())
