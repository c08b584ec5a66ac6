"""``ember bench audio``: 600 s of audio decoded with ember.audio.decode vs the module's own decode.

Rows: DAC at 44.1 kHz (transformers DacModel, 512-sample hop, random full-size weights) in bf16 and
fp32, and Stable Audio's Oobleck VAE (diffusers AutoencoderOobleck defaults, stereo 44.1 kHz, 2048
hop) in bf16; ``snake_bf16_16x1024x65536`` (GB/s, against the transformers Snake1d formula in torch,
floor: read + write 4.3 GB at 4.155 TB/s = 1.03 ms); ``whisper_log_mel_3600s_128mel`` (ms, one hour
of 16 kHz audio as 120 windows, against ``WhisperFeatureExtractor`` on the GPU; its CPU figure as an
extra field; floor: the hour's 230 MB of samples and 176 MB of features, ~0.1 ms). The baseline is the module's untiled decode (its exact result, what ember reproduces),
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
from ember.bench import BenchContext, Row, _timing

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


def _row(ctx: BenchContext, name: str, model, z: torch.Tensor, hop: int, baseline, baseline_name: str) -> Row:
    def ours():
        return ember.audio.decode(model, z, progress=False)

    with torch.no_grad():  # warm-up: kernels loaded, cuDNN plans picked
        baseline(z[:, :, :64])
        ember.audio.decode(model, z[:, :, :64], progress=False)
    ctx.progress(f"{name}: baseline")
    failure = None
    try:
        ref, t_base, gb_base, _ = _timing.timed_with_peak(lambda: baseline(z), ctx.device)
    except RuntimeError as e:  # out of memory, or a conv past 2^31 elements: the row records why
        ref, t_base, gb_base, failure = None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if ctx.on_gpu:
            torch.cuda.empty_cache()
    ctx.progress(f"{name}: ember")
    out, t, gb, _ = _timing.timed_with_peak(ours, ctx.device)
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


COPY_BW_GBS = 4155.0


def snake_row(ctx: BenchContext) -> Row:
    """ember.ops.snake against the Snake1d formula transformers' DAC runs (eager torch), GB/s moved."""
    B, C, T = (2, 16, 256) if ctx.quick else (16, 1024, 65536)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(B, C, T, generator=g).to(ctx.device, torch.bfloat16)
    alpha = (torch.rand(1, C, 1, generator=g) + 0.5).to(ctx.device, torch.bfloat16)
    out = torch.empty_like(x)

    def stock():
        return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)

    t_em = ctx.time_us([lambda: ember.ops.snake(x, alpha, out=out)])
    t_torch = ctx.time_us([stock])
    gbs = lambda us: 2 * x.numel() * x.element_size() / (us * 1e-6) / 1e9  # noqa: E731
    return Row(f"snake_bf16_{B}x{C}x{T}", "GB/s", gbs(t_em), gbs(t_torch), "torch eager Snake1d (transformers DAC)",
               target=">= 80% of 4155 GB/s copy bandwidth", meets=gbs(t_em) >= 0.8 * COPY_BW_GBS if ctx.on_gpu else None,
               extra={"ember_us": t_em, "torch_us": t_torch})


def log_mel_row(ctx: BenchContext) -> Row:
    """An hour of 16 kHz audio to Whisper's 128-bin features: ember.audio.log_mel on ctx.device against
    WhisperFeatureExtractor on the same device (the GPU path it has), its CPU figure beside it."""
    from transformers import WhisperFeatureExtractor
    seconds = 60 if ctx.quick else 3600
    g = torch.Generator(device="cpu").manual_seed(0)
    wave = torch.randn(seconds * 16000, generator=g) * 0.1
    windows = [w.numpy() for w in wave.split(30 * 16000)]
    fe = WhisperFeatureExtractor(feature_size=128)
    wave_dev = wave.to(ctx.device)
    sync = torch.cuda.synchronize if ctx.on_gpu else (lambda: None)

    def wall(fn, reps=3):
        fn(); sync()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); fn(); sync(); ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]

    t_em = wall(lambda: ember.audio.log_mel(wave_dev, n_mels=128))
    t_fe = wall(lambda: fe(windows, sampling_rate=16000, return_tensors="pt", device=str(ctx.device)))
    t_fe_cpu = t_fe if not ctx.on_gpu else wall(lambda: fe(windows, sampling_rate=16000, return_tensors="np"), reps=1)
    return Row(f"whisper_log_mel_{seconds}s_128mel", "ms", t_em * 1e3, t_fe * 1e3,
               f"transformers WhisperFeatureExtractor on {ctx.device.type}",
               target="<= 20 ms for the hour, >= 50x the CPU extractor, >= 20x its GPU path",
               meets=(t_em <= 0.02 and t_fe_cpu / t_em >= 50 and t_fe / t_em >= 20) if ctx.on_gpu else None,
               extra={"extractor_cpu_ms": t_fe_cpu * 1e3, "windows": len(windows)})


def run(ctx: BenchContext) -> list[Row]:
    rows = [snake_row(ctx)]
    try:
        rows.append(log_mel_row(ctx))
    except ImportError:
        ctx.progress("transformers not installed: skipping the log-mel row")
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
