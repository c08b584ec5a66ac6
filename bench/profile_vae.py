"""Where ember's Wan2.2 VAE decode spends its GPU time (H200): per-kernel totals from torch.profiler,
and the same decode with cuDNN's autotuner on and off.

    python bench/profile_vae.py [latent_frames]     # needs diffusers (see bench/run_h200.sh)
"""
import sys
import time

import torch

import ember
from ember.bench.vae import build_vae


def timed_decode(vae, z) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        ember.vae.decode(vae, z, progress=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(latent_frames: int = 9) -> None:
    dev = torch.device("cuda")
    vae = build_vae("wan22", dev, torch.bfloat16)
    z = torch.randn(1, 48, latent_frames, 44, 80, device=dev, dtype=torch.bfloat16)
    for bench in (False, True):
        torch.backends.cudnn.benchmark = bench
        timed_decode(vae, z[:, :, :2])
        timed_decode(vae, z)
        torch.cuda.reset_peak_memory_stats()
        s = timed_decode(vae, z)
        print(f"cudnn.benchmark={bench}: {latent_frames} latent frames {s:.3f} s, "
              f"peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB", flush=True)
    torch.backends.cudnn.benchmark = False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_decode(vae, z)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
