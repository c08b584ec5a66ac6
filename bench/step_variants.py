"""A/B of decode-step kernels on the Qwen3-30B-A3B shape (48 layers, random weights): the CUDA-graph
decode step time (batch 1, ms, three timings each) of every ``ember.bench.moe.STEP_VARIANTS`` entry
(environment switches read while the step is captured) on the same weights and prompt, for a cache
sized to the request (max_seq_len 400) and ember.load's default (4096, where most attention splits
are empty). An earlier version of this script swept the bf16 GEMV tiles of the attention projections
(bench/results/h200/step_variants.json; those tiles are now gemv.MEASURED_2BYTE).

    python bench/step_variants.py OUT_JSON [NAME,NAME,...] [SIZE,SIZE,...]   # optional subsets
    python bench/step_variants.py OUT_JSON tiles:4x256x1:4x512x2,tiles:-:2x256x1 400  # MoE GEMV tiles
    python bench/step_variants.py OUT_JSON default,t1:v2x4x2x4x2 400 fp8  # FP8 model, v2 T=1 shapes
"""
import json
import sys

import torch

from ember.bench import env_vars, moe as moe_bench


def main(path: str, names: list[str] | None = None, sizes: tuple[int, ...] = (400, 4096), fp8: bool = False) -> None:
    hf, cfg = moe_bench.make_hf(False, torch.device("cuda"))
    em = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=400, table_len=4096)
    ids = torch.randint(100, 1000, (1, 128))
    steps = {}
    variants = dict(moe_bench.STEP_VARIANTS)
    for name in names or []:  # "tiles:GU:DN": v1 T=1 MoE tiles BLOCK_NxBLOCK_Kxwarps ("-": the default)
        if name.startswith("tiles:"):
            gu, dn = name.split(":")[1:]
            variants[name] = {k: v.replace("x", ",") for k, v in
                              (("EMBER_MOE_GATE_UP_TILE", gu), ("EMBER_MOE_DOWN_TILE", dn)) if v != "-"}
        elif name.startswith("t1:"):  # "t1:v2x4x2x4x2": EMBER_MOE_T1=v2,4,2,4,2
            variants[name] = {"EMBER_MOE_T1": name[3:].replace("x", ",")}
    for max_seq_len in sizes:
        for name, env in variants.items():
            if names and name not in names:
                continue
            key = f"{name}@{max_seq_len}"
            try:
                with env_vars(env):
                    m = moe_bench.ember_from_hf(hf, cfg, fp8=fp8, max_seq_len=max_seq_len, net=em.net)
                    moe_bench.ember_decode(m, [ids[0].tolist()], 32)
                    steps[key] = [round(moe_bench.graph_step_ms(m, 1), 4) for _ in range(3)]
            except Exception as e:  # recorded, not fatal
                steps[key] = repr(e)[:300]
            m = None
            torch.cuda.empty_cache()
            print(key, steps[key], flush=True)
    with open(path, "w") as f:
        json.dump({"graph_step_ms": steps, "variants": variants}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else None,
         tuple(int(v) for v in sys.argv[3].split(",")) if len(sys.argv) > 3 else (400, 4096),
         fp8=len(sys.argv) > 4 and sys.argv[4] == "fp8")
