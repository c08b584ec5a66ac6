"""``ember bench audio``: 600 s of audio decoded with ember.audio.decode vs the module's own decode.

Rows: DAC at 44.1 kHz (transformers DacModel, 512-sample hop, random full-size weights) in bf16 and
fp32, and Stable Audio's Oobleck VAE (diffusers AutoencoderOobleck defaults, stereo 44.1 kHz, 2048
hop) in bf16; ``snake_bf16_16x1024x65536`` (GB/s, against the transformers Snake1d formula in torch,
floor: read + write 4.3 GB at 4.155 TB/s = 1.03 ms); ``whisper_log_mel_3600s_128mel`` (ms, one hour
of 16 kHz audio as 120 windows, against ``WhisperFeatureExtractor`` on the GPU; its CPU figure as an
extra field; floor: the hour's 230 MB of samples and 176 MB of features, ~0.1 ms). The baseline is the module's untiled decode (its exact result, what ember reproduces),
timed in the same process; ``snr_vs_baseline_db`` is ember's output against it. Oobleck's untiled
600 s decode runs in a child process stopped after 60 s (it ran past 4 minutes on the H200), and its
quality is checked on the first 60 s, which the untiled decode finishes.

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


def _row(ctx: BenchContext, name: str, model, z: torch.Tensor, hop: int, baseline, baseline_name: str, *,
         seconds_limit: float, gb_limit: float | None, ref_frames: int | None = None,
         baseline_time: tuple[float | None, float | None, str | None] | None = None) -> Row:
    """Time ``ember.audio.decode`` on ``z`` and the module's untiled ``baseline`` beside it. The quality
    is ember's output against the untiled one on the first ``ref_frames`` latent frames (all of them by
    default); ``baseline_time`` = (s, GB, failure) measured elsewhere replaces timing the baseline here."""
    def ours(x=z):
        return ember.audio.decode(model, x, progress=False)

    with torch.no_grad():  # warm-up: kernels loaded, cuDNN plans picked
        baseline(z[:, :, :64])
    # ember's first call at full length compiles the snake / pad variants its chunk shapes need (Triton
    # specialises on sizes divisible by 16, which a 64-frame warm-up does not cover: timed as the first
    # call on a cold H100 the Oobleck row took 7.3 s, as long as diffusers); recorded, then timed warm
    ctx.progress(f"{name}: ember, first call")
    first, first_s, _, _ = _timing.timed_with_peak(ours, ctx.device)
    del first
    ctx.progress(f"{name}: baseline")
    ref_z = z if ref_frames is None else z[:, :, :ref_frames]
    failure, full = None, None
    if baseline_time is not None:
        t_base, gb_base, failure = baseline_time
    else:
        try:
            full, t_base, gb_base, _ = _timing.timed_with_peak(lambda: baseline(z), ctx.device)
        except RuntimeError as e:  # out of memory, or a conv past 2^31 elements: the row records why
            full, t_base, gb_base, failure = None, None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if ctx.on_gpu:
            torch.cuda.empty_cache()
    with torch.no_grad():  # the untiled output the quality is measured on (the 600 s one when it is that)
        ref = full if ref_z is z else baseline(ref_z)
        del full
    ctx.progress(f"{name}: ember")
    out, t, gb, _ = _timing.timed_with_peak(ours, ctx.device)
    if ref_frames is not None:
        del out
        out = ours(ref_z)
    quality = snr(out, ref) if ref is not None else None
    # Against the decode in true fp32 (TF32 off): two roundings of the same decode differ from each
    # other more than either differs from it, so this is what says whether ember lost accuracy.
    with torch.no_grad(), _no_tf32():
        truth = baseline(ref_z.float(), fp32=True)
    ours_vs_fp32 = snr(out, truth)
    base_vs_fp32 = snr(ref, truth) if ref is not None else None
    del out, ref, truth
    if ctx.on_gpu:
        torch.cuda.empty_cache()
    meets = (t <= seconds_limit and (gb_limit is None or gb <= gb_limit)) if ctx.on_gpu else None
    target = f"<= {seconds_limit:g} s" + (f", <= {gb_limit:g} GB" if gb_limit is not None else "")
    # quality_ok: ember's error against the true-fp32 decode at most 1 dB above the baseline's own
    quality_ok = None if base_vs_fp32 is None else ours_vs_fp32 >= base_vs_fp32 - 1.0
    return Row(name, "s", t, t_base, baseline_name, target=target,
               meets=meets, extra={"peak_GB": gb, "first_call_s": first_s, "baseline_peak_GB": gb_base,
                                   "baseline_failure": failure,
                                   "snr_vs_baseline_db": quality, "snr_vs_fp32_db": ours_vs_fp32,
                                   "baseline_snr_vs_fp32_db": base_vs_fp32, "quality_ok": quality_ok,
                                   "snr_audio_seconds": ref_z.shape[-1] * hop / 44100,
                                   "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                                   "audio_seconds": z.shape[-1] * hop / 44100, "latent_frames": z.shape[-1]})


class _no_tf32:
    def __enter__(self):
        self.saved = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cudnn.allow_tf32 = self.saved


def _same_weights(build, device):
    """``build()`` on ``device`` from a fixed seed, in eval mode: two calls give the same random weights
    (the weight-normed modules cannot be deep-copied)."""
    torch.manual_seed(0)
    with torch.device(device):
        return build().eval()


def dac_rows(ctx: BenchContext) -> list[Row]:
    from transformers import DacConfig, DacModel
    rows = []
    # both rows at torch's default conv settings (cuDNN may use TF32 for fp32), as a user's call runs
    for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        model32 = _same_weights(lambda: DacModel(DacConfig(**(DAC_TINY if ctx.quick else DAC_44K))), ctx.device)
        model = model32 if dtype == torch.float32 else _same_weights(
            lambda: DacModel(DacConfig(**(DAC_TINY if ctx.quick else DAC_44K))), ctx.device).to(dtype)
        seconds = 2 if ctx.quick else SECONDS
        hop = int(model.config.hop_length)
        z = torch.randn(1, model.config.hidden_size, seconds * 44100 // hop, device=ctx.device, dtype=dtype)

        def stock(x, fp32=False, m=model, m32=model32):
            return (m32 if fp32 else m).decode(x).audio_values

        rows.append(_row(ctx, f"dac_44khz_decode_600s_{tag}", model, z, hop, stock, "transformers DacModel.decode",
                         seconds_limit=1.0 if dtype == torch.bfloat16 else 2.0,
                         gb_limit=4.0 if dtype == torch.bfloat16 else None,
                         ref_frames=None if ctx.quick or dtype == torch.float32 else 60 * 44100 // hop))
        del model, model32, z
    return rows


OOBLECK_BASELINE_LIMIT_S = 60  # diffusers' untiled 600 s decode ran > 4 min on the H200 (2026-12-03)


def _oobleck_untiled_seconds(frames: int, limit_s: float) -> tuple[float | None, float | None, str | None]:
    """diffusers' untiled decode of ``frames`` latent frames in a child process stopped after
    ``limit_s`` (a running CUDA kernel cannot be interrupted in-process): (s, peak GB, failure)."""
    import json
    import subprocess
    import sys
    code = ("import json,time,torch;from diffusers import AutoencoderOobleck as A\n"
            "v=A().eval().to('cuda',torch.bfloat16);"
            f"z=torch.randn(1,v.decoder.conv1.in_channels,{frames},device='cuda',dtype=torch.bfloat16)\n"
            "with torch.no_grad():\n v.decode(z[:,:,:64]);torch.cuda.synchronize();"
            "b=torch.cuda.memory_allocated();torch.cuda.reset_peak_memory_stats();t=time.perf_counter();"
            "v.decode(z);torch.cuda.synchronize()\n"
            "print(json.dumps([time.perf_counter()-t,(torch.cuda.max_memory_allocated()-b)/1e9]))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return None, None, f"stopped after {limit_s:g} s (child process killed; not finished)"
    if done.returncode != 0:
        return None, None, done.stderr.strip().splitlines()[-1][:200] if done.stderr.strip() else "failed"
    t, gb = json.loads(done.stdout.strip().splitlines()[-1])
    return t, gb, None


def oobleck_row(ctx: BenchContext) -> Row:
    from diffusers import AutoencoderOobleck
    build = lambda: AutoencoderOobleck(**(OOBLECK_TINY if ctx.quick else {}))  # noqa: E731
    vae32 = _same_weights(build, ctx.device)
    vae = _same_weights(build, ctx.device).to(torch.bfloat16)
    frames = (2 if ctx.quick else SECONDS) * 44100 // vae.hop_length
    z = torch.randn(1, vae.decoder.conv1.in_channels, frames, device=ctx.device, dtype=torch.bfloat16)
    # full length: the untiled decode in a child stopped after a limit; quality on the first 60 s
    # (what the untiled decode finishes in 0.08 s) in this process
    baseline_time = None if ctx.quick else _oobleck_untiled_seconds(frames, OOBLECK_BASELINE_LIMIT_S)
    ref_frames = None if ctx.quick else 60 * 44100 // vae.hop_length
    def stock(x, fp32=False):
        return (vae32 if fp32 else vae).decode(x).sample

    return _row(ctx, "oobleck_decode_stereo_600s_bf16", vae, z, vae.hop_length, stock,
                "diffusers AutoencoderOobleck.decode, untiled", seconds_limit=1.0, gb_limit=4.0,
                ref_frames=ref_frames, baseline_time=baseline_time)


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
    bw = _timing.copy_bandwidth_gbs(ctx.device)
    return Row(f"snake_bf16_{B}x{C}x{T}", "GB/s", gbs(t_em), gbs(t_torch), "torch eager Snake1d (transformers DAC)",
               target=">= 80% of the copy bandwidth measured in the run", meets=gbs(t_em) >= 0.8 * bw if ctx.on_gpu else None,
               extra={"ember_us": t_em, "torch_us": t_torch, "copy_bw_gbs": bw, "fraction_of_copy_bw": gbs(t_em) / bw})


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
