"""``ember.audio.decode``: exact streamed decode for transformers' DacModel and diffusers' AutoencoderOobleck.

The output is cut into consecutive sample ranges, one per chunk of latent frames. For each range the
decoder's geometry (``_plan``) gives the latent frames it depends on: the chunk plus its receptive
field on either side. That slice runs through the decoder with the module's zero padding only where
it touches a sequence end, and exactly the chunk's own samples are written into the preallocated
output: no blending, the same numbers as the module's untiled decode up to the summation order of
convolutions of another length. Peak memory is one chunk's activations plus the output.
"""
from __future__ import annotations

import sys

import torch

from ember.audio import _plan

SUPPORTED = ("transformers DacModel", "diffusers AutoencoderOobleck")
AUTO_BYTES_CUDA = 2 << 30  # activation budget of one chunk on CUDA (at most half of what is free)
AUTO_BYTES_CPU = 512 << 20
LIVE_ACTIVATIONS = 4  # a residual unit holds its input, the snake temporary, the conv output and the sum
MIN_AUTO_CHUNK = 64  # latent frames: smaller chunks spend most of their work on context
PROGRESS_MIN_CHUNKS = 4


class AudioSpec:
    """What decode needs to know about a supported model, read from the module."""

    def __init__(self, model):
        name = type(model).__name__
        decoder = getattr(model, "decoder", None)
        if name == "DacModel" and hasattr(model, "quantizer") and decoder is not None:
            self.kind = "dac"
            self.n_codebooks = len(model.quantizer.quantizers)
            self.codebook_size = model.quantizer.quantizers[0].codebook.num_embeddings
        elif name == "AutoencoderOobleck" and decoder is not None:
            self.kind = "oobleck"
        else:
            raise TypeError(f"model: expected a {' or a '.join(SUPPORTED)}, got {name}")
        self.model, self.decoder = model, decoder
        p = next(decoder.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.latent_channels = decoder.conv1.in_channels


def _check_chunk(chunk) -> int | None:
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"chunk: expected None or an int (latent frames per chunk), got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"chunk: expected None or at least 1 latent frame, got {chunk}")
    return chunk


def _check_input(spec: AudioSpec, x) -> bool:
    """Validates latents or codes; True for codes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"latents_or_codes: expected a torch.Tensor, got {type(x).__name__}")
    codes = not (x.is_floating_point() or x.is_complex())
    what = "codes [batch, n_codebooks, frames]" if codes else f"latents [batch, {spec.latent_channels}, frames]"
    if x.dim() != 3:
        raise ValueError(f"latents_or_codes: expected 3-d {what}, got shape {tuple(x.shape)}")
    if x.shape[0] < 1 or x.shape[2] < 1:
        raise ValueError(f"latents_or_codes: expected a non-empty batch and at least 1 frame, got shape {tuple(x.shape)}")
    if x.device != spec.device:
        raise ValueError(f"latents_or_codes: expected device {spec.device} (the model's), got {x.device}")
    if codes:
        if spec.kind != "dac":
            raise TypeError(f"latents_or_codes: expected floating-point latents for {type(spec.model).__name__} "
                            f"(only DacModel decodes codes), got dtype {x.dtype}")
        if x.dtype == torch.bool or not 1 <= x.shape[1] <= spec.n_codebooks:
            raise ValueError(f"latents_or_codes: expected integer codes with 1 to {spec.n_codebooks} codebooks "
                             f"in dim 1, got shape {tuple(x.shape)} dtype {x.dtype}")
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi >= spec.codebook_size:
            raise ValueError(f"latents_or_codes: expected codes in [0, {spec.codebook_size}), got values in "
                             f"[{lo}, {hi}]")
        return True
    if x.shape[1] != spec.latent_channels:
        raise ValueError(f"latents_or_codes: expected {spec.latent_channels} latent channels in dim 1 (the "
                         f"decoder's conv1.in_channels), got shape {tuple(x.shape)}")
    if x.dtype != spec.dtype:
        raise TypeError(f"latents_or_codes: expected dtype {spec.dtype} (the model's), got {x.dtype}")
    return False


def auto_chunk(plan: _plan.Plan, spec: AudioSpec, batch: int, frames: int) -> int:
    """Latent frames per chunk for ``chunk=None``: the chunk whose largest activations
    (LIVE_ACTIVATIONS of the widest level) fit AUTO_BYTES (on CUDA at most half the free memory),
    at least MIN_AUTO_CHUNK; the whole latent when it fits."""
    elem = torch.empty((), dtype=spec.dtype).element_size()
    per_frame = plan.elems_per_frame() * batch * elem * LIVE_ACTIVATIONS
    budget = AUTO_BYTES_CPU
    if spec.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(spec.device)
        budget = min(AUTO_BYTES_CUDA, free // 2)
    return min(frames, max(MIN_AUTO_CHUNK, budget // per_frame))


def _progress_bar(total: int, enabled: bool):
    """A transient rich bar on stderr over ``total`` chunks, or None (disabled, few chunks, no TTY, no rich)."""
    if not enabled or total < PROGRESS_MIN_CHUNKS or not sys.stderr.isatty():
        return None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return None
    bar = Progress(TextColumn("audio decode"), BarColumn(), TextColumn("{task.completed}/{task.total} chunks"),
                   TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    bar.start()
    bar.add_task("audio decode", total=total)
    return bar


def _latents_of(spec: AudioSpec, x: torch.Tensor, codes: bool) -> torch.Tensor:
    """The decoder's input for a time slice: the latents, or the quantizer's ``from_codes`` of the
    codes (pointwise in time, so a slice of codes gives that slice of the latents)."""
    return spec.model.quantizer.from_codes(x)[0] if codes else x


def chunk_bounds(frames: int, chunk: int) -> list[int]:
    """Latent frame boundaries of ceil(frames / chunk) chunks of near-equal size (each <= chunk)."""
    n = -(-frames // chunk)
    return [round(i * frames / n) for i in range(n + 1)]


@torch.no_grad()
def decode(model, latents_or_codes: torch.Tensor, *, chunk: int | None = None, progress: bool = True) -> torch.Tensor:
    """Decode audio latents (or DAC codes) chunk by chunk, exactly as the module's untiled decode.

    ``model`` is a transformers ``DacModel`` (16/24/44 kHz) or a diffusers ``AutoencoderOobleck``.
    ``latents_or_codes``: floating latents [B, C, T] (DAC: the quantized representation ``decode``
    takes, C = hidden_size; Oobleck: C = decoder_input_channels) in the model's dtype, or for DAC
    integer audio codes [B, n_codebooks, T] (up to the model's n_codebooks, values below
    codebook_size), turned into latents by the quantizer's ``from_codes`` a chunk at a time.
    ``chunk``: latent frames each step owns; each also decodes its receptive field around it (the
    decoder's convolution reach, a few latent frames a side). ``None`` picks it from the length and,
    on CUDA, from the free memory. ``progress``: a bar on stderr when several chunks run and stderr is
    a terminal. Weight norm is folded into copies of the weights once per call; the module is not
    changed. Returns what the module's decode returns as audio: DAC [B, samples], Oobleck
    [B, audio_channels, samples], in the model's dtype.

    Example:
        >>> from transformers import DacModel
        >>> dac = DacModel.from_pretrained("descript/dac_44khz").to("cuda", torch.bfloat16)
        >>> audio = ember.audio.decode(dac, codes)  # codes: [1, 9, 51680] -> [1, 26460160] samples
        >>> same = ember.audio.decode(dac, dac.quantizer.from_codes(codes)[0], chunk=2048)
    """
    spec = AudioSpec(model)
    chunk = _check_chunk(chunk)
    codes = _check_input(spec, latents_or_codes)
    x = latents_or_codes
    B, _, T = x.shape
    plan = _plan.build(spec.decoder)
    if chunk is None:
        chunk = auto_chunk(plan, spec, B, T)
    n_out = plan.length(T)
    out = torch.empty((B, plan.out_channels, n_out), dtype=spec.dtype, device=spec.device)
    bounds = chunk_bounds(T, chunk)
    hop = n_out / T
    bar = _progress_bar(len(bounds) - 1, progress)
    try:
        for i in range(len(bounds) - 1):
            # the chunk owns the output samples between its frames' boundaries
            o0 = 0 if i == 0 else round(bounds[i] * hop)
            o1 = n_out if i == len(bounds) - 2 else round(bounds[i + 1] * hop)
            if o1 <= o0:
                continue
            a, b = plan.need(o0, o1, T)
            y, y0, y1 = plan.run(_latents_of(spec, x[:, :, a:b], codes), a, b, T)
            assert y0 <= o0 and o1 <= y1, (o0, o1, y0, y1)  # the geometry's promise
            out[:, :, o0:o1] = y[:, :, o0 - y0:o1 - y0]
            del y
            if bar is not None:
                bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
    return out[:, 0] if spec.kind == "dac" else out
