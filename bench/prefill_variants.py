"""A/B of prefill kernels on the Qwen3-30B-A3B shape (48 layers, random weights): the engine's
T-token prefill (the captured graph ``ember bench moe`` times) for each variant's environment
switches, on the same weights and prompt. Every variant is captured under its switches first, then
all are timed in alternating rounds (variant order rotates each round) and each gets its median, so
a drift of the machine during the run touches all of them alike. HF's forward is timed once for scale.

    python bench/prefill_variants.py OUT_JSON [--variants FILE.json or '{"name": {"VAR": "value"}}']
        [--tokens 2048] [--rounds 5]
"""
import argparse
import json
import statistics
import time

import torch

from ember.bench import env_vars, moe as moe_bench


def main(path: str, variants: dict[str, dict[str, str]], T: int, rounds: int) -> None:
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    em = moe_bench.ember_from_hf(hf, cfg, max_seq_len=T, table_len=T)
    ids = torch.randint(100, 500, (1, T), generator=torch.Generator().manual_seed(0))
    prompt = ids[0].tolist()
    models, errors = {}, {}
    with torch.no_grad():
        for name, env in variants.items():
            try:
                with env_vars(env):
                    m = moe_bench.ember_from_hf(hf, cfg, max_seq_len=T, net=em.net)
                    m._prefill_last(0, prompt)  # eager: the first prompt of a length bucket
                    m._prefill_last(0, prompt)  # captures the graph under this variant's switches
                models[name] = m
            except Exception as e:  # recorded, not fatal
                errors[name] = repr(e)[:300]
                print(name, errors[name], flush=True)
        times = {name: [] for name in models}
        for r in range(rounds):
            order = list(models)[r % max(1, len(models)):] + list(models)[:r % max(1, len(models))]
            for name in order:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                models[name]._prefill_last(0, prompt)
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) * 1e3)
        hf(ids.cuda(), logits_to_keep=1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf(ids.cuda(), logits_to_keep=1)
        torch.cuda.synchronize()
        hf_ms = (time.perf_counter() - t0) * 1e3
    out = {"tokens": T, "hf_forward_ms_once": hf_ms, "variants": variants, "errors": errors,
           "prefill_ms": {n: {"median": statistics.median(ts), "each": [round(t, 3) for t in ts]}
                          for n, ts in times.items()}}
    for n, ts in times.items():
        print(f"{n}: median {statistics.median(ts):.2f} ms  {[round(t, 2) for t in ts]}", flush=True)
    print(f"HF forward (once): {hf_ms:.1f} ms", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--variants", default='{"default": {}}')
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    text = a.variants if a.variants.lstrip().startswith("{") else open(a.variants).read()
    main(a.path, json.loads(text), a.tokens, a.rounds)
