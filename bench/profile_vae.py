"""Where ember's Wan2.2 VAE decode spends its GPU time (H200): per-kernel totals from torch.profiler,
and the same decode with cuDNN's autotuner on and off.

    python bench/profile_vae.py [latent_frames] [--shapes]   # needs diffusers (see bench/run_h200.sh)

--shapes: aten ops grouped by input shape instead (what bench/results/h200/profile_vae_shapes.txt holds).
"""
import os
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


def by_shape(vae, z) -> None:
    """Self CUDA time of aten ops grouped by input shape (a conv's bias add shows as its own add_).
    Eager steps: kernels replayed from a CUDA graph are not attributed to aten ops."""
    os.environ.setdefault("EMBER_VAE_GRAPHS", "0")
    timed_decode(vae, z[:, :, :2])
    print(f"decode {z.shape[2]} latent frames {timed_decode(vae, z):.3f} s (unprofiled)")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        timed_decode(vae, z)
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:45]:
        print(f"{e.self_device_time_total / 1e3:9.1f} ms {e.count:6d}  {e.key:28s} {str(e.input_shapes)[:150]}")
    print("---- by op")
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.self_device_time_total / 1e3:9.1f} ms {e.count:6d}  {e.key}")


def main(latent_frames: int = 9, shapes: bool = False) -> None:
    dev = torch.device("cuda")
    vae = build_vae("wan22", dev, torch.bfloat16)
    z = torch.randn(1, 48, latent_frames, 44, 80, device=dev, dtype=torch.bfloat16)
    if shapes:
        return by_shape(vae, z)
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
    args = [a for a in sys.argv[1:] if a != "--shapes"]
    main(int(args[0]) if args else 9, shapes="--shapes" in sys.argv)
