"""Same-run A/B of the Wan VAE decode's folded conv biases (H200): conv1's bias added inside norm2's
pass and conv2's inside the shortcut add, one Triton pass (``new``), against a bias add per conv over
channels-last rows and a separate shortcut add (``old``: torch's adds, as before). Seconds per decode,
alternating, and the largest difference between the two outputs (expected 0: the same roundings).

    python bench/vae_bias_fold_ab.py OUT_JSON [latent_frames]   # needs diffusers (bench/run_h200.sh)
"""
import json
import sys
import time

import torch

import ember
from ember.bench.vae import build_vae
from ember.vae import _stream


def _old_add_conv_bias_(y, bias, residual=None):
    if bias is not None:
        rows = _stream._rows(y)
        (y.add_(bias.view(1, -1, *[1] * (y.dim() - 2))) if rows is None else rows.add_(bias))
    return y if residual is None else y.add_(residual)


def _old_resblock(self, blk, x):
    h = x if isinstance(blk.conv_shortcut, torch.nn.Identity) else self.causal(blk.conv_shortcut, x)
    y = self.causal(blk.conv1, x, norm=blk.norm1)
    y = self.causal(blk.conv2, y, norm=blk.norm2)
    return y.add_(h)


def main(path: str, frames: int = 11) -> None:
    dev = torch.device("cuda")
    res = {}
    for name, shape in (("wan22", (48, 44, 80)), ("wan21", (16, 60, 104))):
        vae = build_vae(name, dev, torch.bfloat16)
        z = torch.randn(1, shape[0], frames, *shape[1:], device=dev, dtype=torch.bfloat16)
        new = (_stream.add_conv_bias_, _stream.CausalStream.resblock)
        outs, times = {}, {"new": [], "old": []}
        for rep in range(3):
            for label in ("new", "old"):
                fn, rb = new if label == "new" else (_old_add_conv_bias_, _old_resblock)
                _stream.add_conv_bias_, _stream.CausalStream.resblock = fn, rb
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    outs[label] = ember.vae.decode(vae, z, progress=False)
                torch.cuda.synchronize()
                if rep:  # the first round warms cuDNN and Triton
                    times[label].append(round(time.perf_counter() - t0, 4))
        _stream.add_conv_bias_, _stream.CausalStream.resblock = new
        res[name] = {"s": times, "max_abs_diff": (outs["new"].float() - outs["old"].float()).abs().max().item()}
        print(name, res[name], flush=True)
        del vae, outs
        torch.cuda.empty_cache()
    res["note"] = (f"H200 bf16, random-weight diffusers VAEs, {frames} latent frames, ember.vae.decode default tiles; "
                   "wan22 at 704x1280, wan21 at 480x832")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
