"""Same-run A/B of ``ember.vae.decode`` with a tile's steady latent-frame steps replayed from a CUDA
graph (EMBER_VAE_GRAPHS=1) against eager steps (0), H200 bf16, default tiles: seconds per decode
(alternating), peak allocated and reserved GB above the weights, and the largest output difference
(expected 0: the same kernels on the same data).

    python bench/vae_graph_ab.py OUT_JSON [latent_frames]   # needs diffusers (bench/run_h200.sh)
"""
import json
import os
import sys
import time

import torch

import ember
from ember.bench.vae import build_vae


def main(path: str, frames: int = 31) -> None:
    dev = torch.device("cuda")
    res = {"note": f"H200 bf16, random-weight diffusers VAEs, {frames} latent frames, default tiles; "
                   "wan22 at 704x1280, wan21 at 480x832; GB above the weights"}
    for name, shape in (("wan22", (48, 44, 80)), ("wan21", (16, 60, 104))):
        vae = build_vae(name, dev, torch.bfloat16)
        z = torch.randn(1, shape[0], frames, *shape[1:], device=dev, dtype=torch.bfloat16)
        base = torch.cuda.memory_allocated()
        r = {"s": {"graphs": [], "eager": []}, "peak_alloc_GB": {}, "peak_reserved_GB": {}}
        outs = {}
        for rep in range(3):
            for label, env in (("graphs", "1"), ("eager", "0")):
                os.environ["EMBER_VAE_GRAPHS"] = env
                outs.pop(label, None)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs[label] = ember.vae.decode(vae, z, progress=False)
                torch.cuda.synchronize()
                if rep:
                    r["s"][label].append(round(time.perf_counter() - t0, 3))
                r["peak_alloc_GB"][label] = round((torch.cuda.max_memory_allocated() - base) / 1e9, 3)
                r["peak_reserved_GB"][label] = round((torch.cuda.max_memory_reserved() - base) / 1e9, 3)
        r["max_abs_diff"] = (outs["graphs"].float() - outs["eager"].float()).abs().max().item()
        res[name] = r
        print(name, r, flush=True)
        del vae, outs, z
        torch.cuda.empty_cache()
    os.environ.pop("EMBER_VAE_GRAPHS", None)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
