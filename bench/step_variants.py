"""A/B of decode-step kernels on the Qwen3-30B-A3B shape (48 layers, random weights): the CUDA-graph
decode step time (ms, three timings each) of every ``ember.bench.moe.STEP_VARIANTS`` entry (environment
switches read while the step is captured) on the same weights and prompt, for a cache sized to the
request (max_seq_len 400) and ember.load's default (4096, where most attention splits are empty).
An earlier version of this script swept the bf16 GEMV tiles of the attention projections
(bench/results/h200/step_variants.json; those tiles are now gemv.MEASURED_2BYTE).

    python bench/step_variants.py OUT_JSON [--names NAME,NAME] [--sizes 400,4096] [--fp8] [--batch 8] [--new 32]
        [--variants FILE.json]   # {name: {ENV_VAR: value}} added to STEP_VARIANTS (tile sweeps)
    names "tiles:GU:DN" (v1 T=1 MoE tiles BLOCK_NxBLOCK_Kxwarps, "-" = default) and "t1:v2x4x2x4x2"
    (EMBER_MOE_T1=v2,4,2,4,2) need no file.
"""
import argparse
import json

import torch

from ember.bench import env_vars, moe as moe_bench


def named_variant(name: str) -> dict | None:
    if name.startswith("tiles:"):
        gu, dn = name.split(":")[1:]
        return {k: v.replace("x", ",") for k, v in
                (("EMBER_MOE_GATE_UP_TILE", gu), ("EMBER_MOE_DOWN_TILE", dn)) if v != "-"}
    if name.startswith("t1:"):
        return {"EMBER_MOE_T1": name[3:].replace("x", ",")}
    return None


def main(path: str, names: list[str] | None, sizes: tuple[int, ...], fp8: bool, batch: int,
         extra: dict[str, dict[str, str]], new_tokens: int = 32) -> None:
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    em = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=400, table_len=4096)
    prompts = torch.randint(100, 1000, (batch, 128)).tolist()
    variants = dict(moe_bench.STEP_VARIANTS) | extra
    for name in names or []:
        if name not in variants and named_variant(name) is not None:
            variants[name] = named_variant(name)
    steps = {}
    for max_seq_len in sizes:
        for name, env in variants.items():
            if names and name not in names:
                continue
            key = f"{name}@{max_seq_len}"
            try:
                with env_vars(env):
                    m = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=max_seq_len, max_batch_size=batch,
                                                net=em.net)
                    moe_bench.ember_decode(m, prompts, new_tokens)  # the step is timed at 128 + new_tokens
                    steps[key] = [round(moe_bench.graph_step_ms(m, batch), 4) for _ in range(3)]
            except Exception as e:  # recorded, not fatal
                steps[key] = repr(e)[:300]
            m = None
            torch.cuda.empty_cache()
            print(key, steps[key], flush=True)
    with open(path, "w") as f:
        json.dump({"graph_step_ms": steps, "variants": {k: v for k, v in variants.items() if not names or k in names},
                   "batch": batch, "fp8": fp8, "new_tokens": new_tokens}, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--names", default="")
    ap.add_argument("--sizes", default="400,4096")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="")
    ap.add_argument("--new", type=int, default=32, help="tokens decoded after the 128-token prompt before timing")
    a = ap.parse_args()
    extra = json.load(open(a.variants)) if a.variants else {}
    names = [n for n in a.names.split(",") if n] or None
    if names is None and extra:
        names = ["default", *extra]
    main(a.out, names, tuple(int(v) for v in a.sizes.split(",")), a.fp8, a.batch, extra, a.new)
