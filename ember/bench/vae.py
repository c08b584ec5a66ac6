"""``ember bench vae``: Wan-family video VAE decode (ember.vae.decode vs diffusers 0.42.1) and pad.

Floors (H200, bf16 dense 790 TFLOP/s; conv FLOPs counted with hooks on diffusers' decoder):
  * Wan2.2 VAE, 121 x 704 x 1280 (31 latent frames, 44 x 80): 2,010 TFLOP untiled -> 2.54 s; tiles
    add their overlap (2 x 2 tiles with 4 latent px of overlap: +10%).
  * Wan2.1 VAE, 81 x 480 x 832 (21 latent frames, 60 x 104): 274 TFLOP -> 0.35 s.
  * pad 1x96x4x256x512 bf16 -> 1x96x6x258x514 (causal-conv pattern): 100.7 MB read + 152.8 MB
    written = 253 MB -> 61 us at 4.15 TB/s.
Decodes are timed once each, wall clock around a synchronised call, after a short warm-up decode
(kernels loaded, Triton compiled); peak_GB is the CUDA allocator's peak above what was allocated
before the call (the weights and the latents), as in shared/reference/vae_baseline.py;
peak_reserved_GB the same for the memory the allocator held (its cache and any CUDA graph pool).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import ember
from ember.bench import BenchContext, Row, _timing

WAN_CONFIGS = {
    "wan21": dict(),
    "wan22": dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                  patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48),
}
TINY = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
# (row name, config, frames, height, width, ember seconds target, ember peak GB target, frames_per_chunk)
# Auto tiles in both; the Wan2.1 row, whose memory target binds, also takes the decoder's full-resolution
# layers two frames at a time (the row records the default's figures too); Wan2.2, whose time target
# binds, does not (it would cost 9%: vae_wan22_memory_sweep.json).
DECODES = [("wan22_121x704x1280_bf16", "wan22", 121, 704, 1280, 4.0, 3.0, None),
           ("wan21_81x480x832_bf16", "wan21", 81, 480, 832, 2.0, 1.0, 2)]

# encode rows (informational, no target): (row name, config, frames, height, width)
ENCODES = [("wan22_encode_121x704x1280_bf16", "wan22", 121, 704, 1280),
           ("wan21_encode_81x480x832_bf16", "wan21", 81, 480, 832)]


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = sum((((x.float() - y.float()) / 2) ** 2).sum().item() for x, y in zip(a.split(8, 2), b.split(8, 2)))
    mse /= a.numel()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1 / mse)).item()


class PadCounter:
    """Counts F.pad calls (each one materialises a padded copy) inside diffusers' Wan module."""

    def __init__(self):
        self.calls = 0

    def __enter__(self):
        import diffusers.models.autoencoders.autoencoder_kl_wan as wan
        self._mods = [F, wan.F]
        self._real = F.pad

        def counting(*a, **k):
            self.calls += 1
            return self._real(*a, **k)
        for m in self._mods:
            m.pad = counting
        return self

    def __exit__(self, *exc):
        for m in self._mods:
            m.pad = self._real


def build_vae(name: str, device, dtype, tiny: bool = False):
    from diffusers import AutoencoderKLWan
    cfg = TINY if tiny else WAN_CONFIGS[name]
    with torch.device(device):
        vae = AutoencoderKLWan(**cfg)
    return vae.to(device, dtype).eval()


timed = _timing.timed_with_peak


def _diffusers_tiling(vae, tiled: bool):
    if tiled:
        vae.enable_tiling()  # diffusers' defaults: 256 px tiles, 192 px stride
    else:
        vae.disable_tiling()
    return vae


def diffusers_decode(vae, z, tiled: bool):
    return _diffusers_tiling(vae, tiled).decode(z).sample


def _baseline_fields(results: dict) -> dict:
    """The row fields of diffusers' untiled (results[False]) and tiled (results[True]) runs."""
    fields = {}
    for tiled, kind in ((False, "untiled"), (True, "tiled")):
        s, gb, rgb = results[tiled]
        fields.update({f"diffusers_{kind}_s": s, f"diffusers_{kind}_peak_GB": gb,
                       f"diffusers_{kind}_peak_reserved_GB": rgb})
    return fields


def decode_row(ctx: BenchContext, name, cfg, frames, h, w, t_target, gb_target, tile=None, overlap=None,
               frames_per_chunk=None) -> tuple[Row, int]:
    dtype = torch.bfloat16
    vae = build_vae(cfg, ctx.device, dtype, tiny=ctx.quick)
    comp = vae.spatial_compression_ratio
    T = (frames - 1) // 4 + 1
    z = torch.randn(1, vae.config.z_dim, T, h // comp, w // comp, device=ctx.device, dtype=dtype)
    results = {}
    pad_calls = 0
    for tiled in (False, True):
        ctx.progress(f"{name}: diffusers {'tiled' if tiled else 'untiled'}")
        with torch.no_grad():
            diffusers_decode(vae, z[:, :, :2], tiled)  # warm-up
        with PadCounter() as pc:
            out, s, gb, rgb = timed(lambda: diffusers_decode(vae, z, tiled), ctx.device)
        if tiled:
            pad_calls = pc.calls
            del out
        else:
            reference = out
        results[tiled] = (s, gb, rgb)
    ctx.progress(f"{name}: ember")

    def ember_timed(chunk):
        def run(latents):
            return ember.vae.decode(vae, latents, tile=tile, overlap=overlap, frames_per_chunk=chunk, progress=False)
        run(z[:, :, :2])  # warm-up
        return timed(lambda: run(z), ctx.device)

    extra = {}
    if frames_per_chunk is not None:  # the default's figures, for the record
        out, s, gb, rgb = ember_timed(None)
        extra = {"default_chunk_s": s, "default_chunk_peak_GB": gb, "default_chunk_peak_reserved_GB": rgb}
        del out
    out, s, gb, rgb = ember_timed(frames_per_chunk)
    quality = psnr(out, reference)
    del out, reference, vae, z
    if ctx.on_gpu:
        torch.cuda.empty_cache()
    row = Row(name, "s", s, results[False][0], "diffusers 0.42.1 AutoencoderKLWan.decode, untiled",
              target=f"<= {t_target} s and peak_GB <= {gb_target}",
              meets=(s <= t_target and gb <= gb_target) if ctx.on_gpu else None,  # no GPU peak memory on CPU
              extra={"peak_GB": gb, "peak_reserved_GB": rgb, **_baseline_fields(results),
                     "speedup_vs_diffusers_tiled": results[True][0] / s, "psnr_vs_diffusers_untiled_db": quality,
                     "tile": str(tile), "overlap": str(overlap), "frames_per_chunk": frames_per_chunk, **extra})
    return row, pad_calls


def diffusers_encode(vae, x, tiled: bool):
    return _diffusers_tiling(vae, tiled).encode(x).latent_dist


def encode_row(ctx: BenchContext, name, cfg, frames, h, w) -> Row:
    """ember.vae.encode (auto tiles) of a random [-1, 1] video vs diffusers' encode, untiled and
    tiled; quality: PSNR of ember's posterior mean against the untiled one's (peak = its range)."""
    dtype = torch.bfloat16
    vae = build_vae(cfg, ctx.device, dtype, tiny=ctx.quick)
    x = (torch.rand(1, 3, frames, h, w, device=ctx.device) * 2 - 1).to(dtype)
    results = {}
    for tiled in (False, True):
        ctx.progress(f"{name}: diffusers {'tiled' if tiled else 'untiled'}")
        with torch.no_grad():
            diffusers_encode(vae, x[:, :, :5], tiled)  # warm-up
        post, s, gb, rgb = timed(lambda: diffusers_encode(vae, x, tiled), ctx.device)
        if not tiled:
            reference = post.mean
        results[tiled] = (s, gb, rgb)
        del post
    ctx.progress(f"{name}: ember")
    ember.vae.encode(vae, x[:, :, :5], progress=False)  # warm-up
    post, s, gb, rgb = timed(lambda: ember.vae.encode(vae, x, progress=False), ctx.device)
    ref = reference.double()
    mse = ((post.mean.double() - ref) ** 2).mean().item()
    peak = (ref.max() - ref.min()).item()
    quality = float("inf") if mse == 0 else 10 * math.log10(peak ** 2 / mse)
    del post, reference, ref, vae, x
    if ctx.on_gpu:
        torch.cuda.empty_cache()
    return Row(name, "s", s, results[False][0], "diffusers 0.42.1 AutoencoderKLWan.encode, untiled",
               target="informational",
               extra={"peak_GB": gb, "peak_reserved_GB": rgb, **_baseline_fields(results),
                      "speedup_vs_diffusers_tiled": results[True][0] / s, "psnr_mean_vs_diffusers_untiled_db": quality})


def encode_rows(ctx: BenchContext) -> list[Row]:
    encodes = ENCODES if not ctx.quick else [("wan21_encode_tiny_9x64x96_bf16", "wan21", 9, 64, 96)]
    return [encode_row(ctx, *e) for e in encodes]


def pad_copies_row(ctx: BenchContext, diffusers_calls: int) -> Row:
    """F.pad calls during ember's Wan2.2 decode (a small one: the count does not depend on size)."""
    vae = build_vae("wan22", ctx.device, torch.bfloat16, tiny=ctx.quick)
    comp = vae.spatial_compression_ratio
    z = torch.randn(1, vae.config.z_dim, 3, 64 // comp * 2, 64 // comp * 2, device=ctx.device, dtype=torch.bfloat16)
    real = F.pad
    calls = [0]
    F.pad = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or real(*a, **k)
    try:
        ember.vae.decode(vae, z, tile=False)
    finally:
        F.pad = real
    return Row("pad_copies_per_decode", "count", float(calls[0]), float(diffusers_calls),
               "diffusers 0.42.1 tiled Wan2.2 decode (F.pad calls, 121x704x1280)", target="0 materialised padded copies",
               meets=calls[0] == 0)


def pad_row(ctx: BenchContext) -> Row:
    shape = (1, 96, 4, 256, 512) if not ctx.quick else (1, 8, 4, 32, 64)
    pad = (1, 1, 1, 1, 2, 0)
    x = torch.randn(shape, device=ctx.device, dtype=torch.bfloat16)
    out_numel = F.pad(x, pad).numel()
    nbytes = (x.numel() + out_numel) * 2
    sets = _timing.copies_to_exceed_l2(nbytes) if ctx.on_gpu else 2
    xs = [torch.randn(shape, device=ctx.device, dtype=torch.bfloat16) for _ in range(sets)]
    t_e = ctx.time_us([lambda x=x: ember.ops.pad(x, pad) for x in xs])
    t_t = ctx.time_us([lambda x=x: F.pad(x, pad) for x in xs])
    ge, gt = nbytes / t_e / 1e3, nbytes / t_t / 1e3
    copy = _timing.copy_bandwidth_gbs(ctx.device)
    name = "pad_rank5_bf16_" + "x".join(map(str, shape))
    return Row(name, "GB/s", ge, gt, "torch F.pad (constant)",
               target=">= 80% of the copy bandwidth measured in the run", meets=ge >= 0.8 * copy,
               extra={"ember_us": t_e, "baseline_us": t_t, "fraction_of_copy_bw": ge / copy, "copy_bw_gbs": copy})


def run(ctx: BenchContext, tiles: dict | None = None) -> list[Row]:
    rows = [pad_row(ctx)]
    try:
        import diffusers  # noqa: F401
    except ImportError:
        ctx.progress("diffusers not installed: skipping the VAE rows")
        return rows
    decodes = DECODES if not ctx.quick else [("wan21_tiny_9x64x96_bf16", "wan21", 9, 64, 96, float("inf"), float("inf"), 2)]
    wan22_pads = 0
    for name, cfg, frames, h, w, t_target, gb_target, chunk in decodes:
        tile, overlap = (tiles or {}).get(name, (None, None))
        row, pads = decode_row(ctx, name, cfg, frames, h, w, t_target, gb_target, tile, overlap, chunk)
        rows.append(row)
        if cfg == "wan22" or ctx.quick:
            wan22_pads = pads
    rows.append(pad_copies_row(ctx, wan22_pads))
    rows.extend(encode_rows(ctx))
    return rows
