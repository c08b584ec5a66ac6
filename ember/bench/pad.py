"""``ember bench pad``: reflect / replicate / circular padding of long audio rows vs torch F.pad.

Floor (H200): bf16 16 x 64 x 1,048,576 padded by (512, 512) (STFT centring, n_fft = 1024): 2,147 MB
read + 2,150 MB written = 4,297 MB -> 1.03 ms at 4.155 TB/s; the target is 80% of that bandwidth.
The GB/s of both columns count the same bytes (x once, the output once). Graph-timed on the GPU
(each call moves > 2x L2, so one input set); ``--quick`` times a 2 x 4 x 4096 row on the host.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ember
from ember.bench import BenchContext, Row, _timing

PAD = (512, 512)
TARGETS = {"reflect": True, "replicate": False, "circular": False}  # the row is reflect


def mode_row(ctx: BenchContext, mode: str, shape: tuple[int, ...]) -> Row:
    x = torch.randn(shape, device=ctx.device).to(torch.bfloat16)
    nbytes = (x.numel() + x.numel() // shape[-1] * (shape[-1] + sum(PAD))) * x.element_size()
    sets = _timing.copies_to_exceed_l2(nbytes) if ctx.on_gpu else 2
    xs = [x] + [torch.randn(shape, device=ctx.device).to(torch.bfloat16) for _ in range(sets - 1)]
    t_e = ctx.time_us([lambda x=x: ember.ops.pad(x, PAD, mode) for x in xs])
    t_t = ctx.time_us([lambda x=x: F.pad(x, PAD, mode=mode) for x in xs])
    ge, gt = nbytes / t_e / 1e3, nbytes / t_t / 1e3
    target = TARGETS[mode]
    bw = _timing.copy_bandwidth_gbs(ctx.device)
    return Row(f"pad_{mode}_bf16_" + "x".join(map(str, shape)), "GB/s", ge, gt, f"torch F.pad (mode={mode!r})",
               target=">= 80% of the copy bandwidth measured in the run" if target else "informational",
               meets=ge >= 0.8 * bw if target and ctx.on_gpu else None,
               extra={"ember_us": t_e, "baseline_us": t_t, "copy_bw_gbs": bw, "fraction_of_copy_bw": ge / bw})


def run(ctx: BenchContext) -> list[Row]:
    shape = (16, 64, 1048576) if not ctx.quick else (2, 4, 4096)
    rows = []
    for mode in TARGETS:
        rows.append(mode_row(ctx, mode, shape))
        if ctx.on_gpu:
            torch.cuda.empty_cache()
    return rows
