"""``ember bench audio``: 600 s of audio decoded with ember.audio.decode vs the module's own decode.

Rows: DAC at 44.1 kHz (transformers DacModel, 512-sample hop, random full-size weights) in bf16 and
fp32, and Stable Audio's Oobleck VAE (diffusers AutoencoderOobleck defaults, stereo 44.1 kHz, 2048
hop) in bf16. The baseline is the module's untiled decode (its exact result, what ember reproduces),
timed in the same process; ``snr_vs_baseline_db`` is ember's output against it.

Floors (H200, 790 TFLOP/s bf16; conv FLOPs per latent frame counted from the decoder's layers):
  * DAC 44 kHz: 1.61 GFLOP per latent frame; 600 s = 51,680 frames -> 83 TFLOP -> 0.105 s bf16.
  * Oobleck: 5.04 GFLOP per latent frame; 600 s = 12,920 frames -> 65 TFLOP -> 0.082 s bf16.
  Both convs and the unfused snakes (5 elementwise passes each) stream every activation through
  HBM several times per layer, so the bandwidth, not the FLOPs, is the expected bound.
Each decode is timed once, wall clock around a synchronised call, after a short warm-up decode;
peak_GB is the CUDA allocator's peak above what was allocated before the call (weights, latents).
``--quick`` runs tiny random models on the CPU with 2 s of audio.
"""
from __future__ import annotations

import time

import torch

import ember
from ember.bench import BenchContext, Row

SECONDS = 600
DAC_44K = dict(sampling_rate=44100)  # DacConfig's defaults are the 512-hop, 9-codebook geometry
DAC_TINY = dict(encoder_hidden_size=4, decoder_hidden_size=32, hidden_size=16, codebook_dim=4, n_codebooks=3,
                codebook_size=32, downsampling_ratios=[2, 4], upsampling_ratios=[4, 2], hop_length=8,
                sampling_rate=44100)
OOBLECK_TINY = dict(encoder_hidden_size=4, downsampling_ratios=[2, 4], channel_multiples=[1, 2],
                    decoder_channels=8, decoder_input_channels=8, audio_channels=2)


def snr(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = sig = 0.0
    for o, r in zip(out.reshape(-1).split(1 << 24), ref.reshape(-1).split(1 << 24)):
        err += ((o.double() - r.double()) ** 2).sum().item()
        sig += (r.double() ** 2).sum().item()
    return float("inf") if err == 0 else 10 * torch.log10(torch.tensor(sig / err)).item()


def timed(fn, device) -> tuple[object, float, float]:
    """(result, seconds, peak GB allocated above what was allocated before the call)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return out, seconds, ((torch.cuda.max_memory_allocated() - base) / 1e9 if cuda else float("nan"))


def _row(ctx: BenchContext, name: str, model, z: torch.Tensor, hop: int, baseline, baseline_name: str) -> Row:
    def ours():
        return ember.audio.decode(model, z, progress=False)

    with torch.no_grad():  # warm-up: kernels loaded, cuDNN plans picked
        baseline(z[:, :, :64])
        ember.audio.decode(model, z[:, :, :64], progress=False)
    ctx.progress(f"{name}: baseline")
    failure = None
    try:
        ref, t_base, gb_base = timed(lambda: baseline(z), ctx.device)
    except RuntimeError as e:  # out of memory, or a conv past 2^31 elements: the row records why
        ref, t_base, gb_base, failure = None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if ctx.on_gpu:
            torch.cuda.empty_cache()
    ctx.progress(f"{name}: ember")
    out, t, gb = timed(ours, ctx.device)
    quality = snr(out, ref) if ref is not None else None
    del out, ref
    if ctx.on_gpu:
        torch.cuda.empty_cache()
    floor = 70 if z.dtype == torch.float32 else 45
    meets = None
    if ctx.on_gpu and quality is not None:
        meets = quality >= floor and gb < gb_base
    return Row(name, "s", t, t_base, baseline_name, target=f">= {floor} dB vs untiled, peak_GB below it",
               meets=meets, extra={"peak_GB": gb, "baseline_peak_GB": gb_base, "baseline_failure": failure,
                                   "snr_vs_baseline_db": quality,
                                   "audio_seconds": z.shape[-1] * hop / 44100, "latent_frames": z.shape[-1]})


def dac_rows(ctx: BenchContext) -> list[Row]:
    from transformers import DacConfig, DacModel
    rows = []
    tf32 = torch.backends.cudnn.allow_tf32
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        torch.backends.cudnn.allow_tf32 = tf32 and dtype != torch.float32  # the fp32 row: fp32 convs, both sides
        with torch.device(ctx.device):
            model = DacModel(DacConfig(**(DAC_TINY if ctx.quick else DAC_44K))).eval()
        model = model.to(ctx.device, dtype)
        seconds = 2 if ctx.quick else SECONDS
        frames = seconds * 44100 // int(model.config.hop_length)
        z = torch.randn(1, model.config.hidden_size, frames, device=ctx.device, dtype=dtype)
        rows.append(_row(ctx, f"dac_44khz_decode_600s_{tag}", model, z, int(model.config.hop_length),
                         lambda x, m=model: m.decode(x).audio_values, "transformers DacModel.decode"))
        del model, z
    torch.backends.cudnn.allow_tf32 = tf32
    return rows


def oobleck_row(ctx: BenchContext) -> Row:
    from diffusers import AutoencoderOobleck
    with torch.device(ctx.device):
        vae = AutoencoderOobleck(**(OOBLECK_TINY if ctx.quick else {})).eval()
    vae = vae.to(ctx.device, torch.bfloat16)
    frames = (2 if ctx.quick else SECONDS) * 44100 // vae.hop_length
    z = torch.randn(1, vae.decoder.conv1.in_channels, frames, device=ctx.device, dtype=torch.bfloat16)
    return _row(ctx, "oobleck_decode_stereo_600s_bf16", vae, z, vae.hop_length, lambda x: vae.decode(x).sample,
                "diffusers AutoencoderOobleck.decode, untiled")


def run(ctx: BenchContext) -> list[Row]:
    rows = []
    try:
        rows += dac_rows(ctx)
    except ImportError:
        ctx.progress("transformers without DacModel: skipping the DAC rows")
    try:
        import diffusers  # noqa: F401
    except ImportError:
        ctx.progress("diffusers not installed: skipping the Oobleck row")
        return rows
    rows.append(oobleck_row(ctx))
    return rows
