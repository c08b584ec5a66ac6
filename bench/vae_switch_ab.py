"""Same-run A/B of ``ember.vae.decode`` with a switch on (VAR=1) and off (0), H200 bf16, default
tiles: seconds per decode (alternating), peak allocated and reserved GB above the weights, the
largest output difference and the PSNR of "on" against "off". VAR: EMBER_VAE_GRAPHS (a tile's steady
latent-frame steps replayed from a CUDA graph; expected difference 0), EMBER_VAE_SUBPIXEL (the
upsample + 3x3 conv as a 2x2 sub-pixel conv; summed weights, so not 0), dup_up_kernel (Wan2.2's
DupUp3D shortcut add as one Triton pass, off = the torch gather + add; expected 0) or bias_fold
(a residual block's conv biases folded into norm2's pass and the shortcut add, off = a torch bias
add per conv and a separate shortcut add; expected 0).

    python bench/vae_switch_ab.py OUT_JSON [VAR] [latent_frames] [wan22,wan21]   # needs diffusers (bench/run_h200.sh)
"""
import json
import math
import os
import sys
import time

import torch

import ember
from ember.bench.vae import build_vae, psnr
from ember.vae import _stream


_DUP_UP_ADD = _stream.StreamDecoder.dup_up_add
_ADD_CONV_BIAS = _stream.add_conv_bias_
_RESBLOCK = _stream.CausalStream.resblock


def _dup_up_add_torch(self, du, x_in, x, first):
    """StreamDecoder.dup_up_add on its torch path (the gather, then the add)."""
    use = _stream._dispatch.use_triton
    _stream._dispatch.use_triton = lambda t: False
    try:
        return _DUP_UP_ADD(self, du, x_in, x, first)
    finally:
        _stream._dispatch.use_triton = use


def _add_conv_bias_torch(y, bias, residual=None):
    """add_conv_bias_ as torch adds: the bias over channels-last rows, then the residual."""
    if bias is not None:
        rows = _stream._rows(y)
        (y.add_(_stream._per_channel(bias, y)) if rows is None else rows.add_(bias))
    return y if residual is None else y.add_(residual)


def _resblock_unfolded(self, blk, x):
    """CausalStream.resblock with each conv adding its own bias and a separate shortcut add."""
    h = x if isinstance(blk.conv_shortcut, torch.nn.Identity) else self.causal(blk.conv_shortcut, x)
    y = self.causal(blk.conv1, x, norm=blk.norm1)
    y = self.causal(blk.conv2, y, norm=blk.norm2)
    return y.add_(h)


def switch(var: str, on: bool) -> None:
    if var == "dup_up_kernel":
        _stream.StreamDecoder.dup_up_add = _DUP_UP_ADD if on else _dup_up_add_torch
    elif var == "bias_fold":
        _stream.add_conv_bias_ = _ADD_CONV_BIAS if on else _add_conv_bias_torch
        _stream.CausalStream.resblock = _RESBLOCK if on else _resblock_unfolded
    else:
        os.environ[var] = "1" if on else "0"


def main(path: str, var: str = "EMBER_VAE_GRAPHS", frames: int = 31, names: str = "wan22,wan21") -> None:
    dev = torch.device("cuda")
    res = {"note": f"H200 bf16, random-weight diffusers VAEs, {frames} latent frames, default tiles, {var} 1 "
                   "vs 0; wan22 at 704x1280, wan21 at 480x832; GB above the weights"}
    shapes = {"wan22": (48, 44, 80), "wan21": (16, 60, 104)}
    for name in names.split(","):
        shape = shapes[name]
        vae = build_vae(name, dev, torch.bfloat16)
        z = torch.randn(1, shape[0], frames, *shape[1:], device=dev, dtype=torch.bfloat16)
        base = torch.cuda.memory_allocated()
        r = {"s": {"on": [], "off": []}, "peak_alloc_GB": {}, "peak_reserved_GB": {}}
        outs = {}
        for rep in range(3):
            for label in ("on", "off"):
                switch(var, label == "on")
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
        r["max_abs_diff"] = (outs["on"].float() - outs["off"].float()).abs().max().item()
        db = psnr(outs["on"], outs["off"])
        r["psnr_on_vs_off_db"] = db if math.isfinite(db) else None  # None: identical
        res[name] = r
        print(name, r, flush=True)
        del vae, outs, z
        torch.cuda.empty_cache()
    switch(var, True)
    os.environ.pop(var, None)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3], *(int(a) for a in sys.argv[3:4]), *sys.argv[4:5])
