"""Whisper's log-mel input features, computed with torch on the waveform's device.

``log_mel`` follows transformers' ``WhisperFeatureExtractor``: each window of ``chunk_seconds`` (30 s)
of 16 kHz audio, zero-padded at the end, goes through a centred STFT (reflect padding, periodic Hann
window of ``n_fft`` samples, hop ``hop_length``), the power spectrum without its last frame, a Slaney
mel filterbank over 0 - 8 kHz, ``log10`` of the energies floored at 1e-10, a floor 8 below the
window's maximum, and ``(x + 4) / 4``.

Audio longer than one window is cut into consecutive windows (the last one zero-padded), each computed
on its own as the extractor computes a clip of at most 30 s, and all of them in one batch: window
``i`` equals ``WhisperFeatureExtractor()(waveform[i * n : (i + 1) * n])`` with ``n = chunk_seconds *
16000``. (transformers' long-form ``generate`` instead featurises the whole clip at once and slices
the frames, which differs near window edges and in the dynamic-range floor.)

Everything is torch ops (``torch.stft`` and one matmul), so on a CUDA waveform it all runs on the GPU;
a bespoke kernel would save little next to cuFFT on a [windows, 201, 3001] spectrum.
"""
from __future__ import annotations

import functools
import math
import numbers

import torch

from ember.ops import _checks

SAMPLING_RATE = 16000  # the recipe's rate: Whisper's filterbank spans 0 - 8 kHz, its Nyquist
_MAX_FREQUENCY = 8000.0
_WINDOWS_PER_BATCH = 32  # bounds the STFT's working memory (~5 MB a window) for hour-long audio
_INPUT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- filterbank
def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above."""
    log_step = math.log(6.4) / 27.0
    return torch.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + torch.log(f.clamp(min=1e-12) / 1000.0) / log_step)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    log_step = math.log(6.4) / 27.0
    return torch.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * torch.exp(log_step * (m - 15.0)))


def mel_filters_reference(sampling_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """Slaney-normalised triangular mel filters over 0 - 8 kHz, float64 [n_fft // 2 + 1, n_mels].

    Filter ``i`` rises from centre frequency ``i`` to ``i + 1`` and falls to ``i + 2`` of ``n_mels + 2``
    points equally spaced in mels, scaled by ``2 / (f[i + 2] - f[i])`` (equal area per filter).
    """
    fft_freqs = torch.linspace(0.0, sampling_rate // 2, n_fft // 2 + 1, dtype=torch.float64)  # [F]
    edges = _mel_to_hz(torch.linspace(float(_hz_to_mel(torch.tensor(0.0, dtype=torch.float64))),
                                      float(_hz_to_mel(torch.tensor(_MAX_FREQUENCY, dtype=torch.float64))),
                                      n_mels + 2, dtype=torch.float64))  # [n_mels + 2]
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    rising = (fft_freqs[:, None] - lo) / (mid - lo)
    falling = (hi - fft_freqs[:, None]) / (hi - mid)
    tri = torch.minimum(rising, falling).clamp(min=0.0)  # [F, n_mels]
    return tri * (2.0 / (hi - lo))


@functools.lru_cache(maxsize=32)
def _mel_filters_t(sampling_rate: int, n_fft: int, n_mels: int, device: torch.device, dtype: torch.dtype):
    """[n_mels, F] on ``device``, once per key (a host -> device copy a call would cost more than the matmul)."""
    fb = mel_filters_reference(sampling_rate, n_fft, n_mels)
    empty = (fb.amax(dim=0) <= 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"n_mels: {n_mels} filters over {n_fft // 2 + 1} frequency bins (n_fft={n_fft}) leave "
                         f"filters {empty[:5]}{'...' if len(empty) > 5 else ''} without any bin; expected fewer "
                         "mels or a larger n_fft")
    return fb.T.contiguous().to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=32)
def _hann(n_fft: int, device: torch.device) -> torch.Tensor:
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------- validation
def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {v}")
    return int(v)


def _validate(waveform, sampling_rate, n_mels, n_fft, hop_length, chunk_seconds, device):
    _checks.tensor("waveform", waveform, dtypes=_INPUT_DTYPES)
    if waveform.dim() not in (1, 2):
        raise ValueError(f"waveform: expected a 1-d [samples] or 2-d [batch, samples] tensor of mono audio, "
                         f"got shape {tuple(waveform.shape)}")
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, numbers.Real):
        raise TypeError(f"sampling_rate: expected an int, got {type(sampling_rate).__name__}")
    if sampling_rate != SAMPLING_RATE:
        raise ValueError(f"sampling_rate: expected {SAMPLING_RATE} (Whisper's features are defined for 16 kHz "
                         f"audio; resample first), got {sampling_rate}")
    n_mels, n_fft, hop_length = (_positive_int("n_mels", n_mels), _positive_int("n_fft", n_fft),
                                 _positive_int("hop_length", hop_length))
    if isinstance(chunk_seconds, bool) or not isinstance(chunk_seconds, numbers.Real):
        raise TypeError(f"chunk_seconds: expected a number, got {type(chunk_seconds).__name__}")
    n_samples = chunk_seconds * SAMPLING_RATE
    if not chunk_seconds > 0 or n_samples != int(n_samples):
        raise ValueError(f"chunk_seconds: expected a positive number of seconds spanning whole samples at "
                         f"{SAMPLING_RATE} Hz, got {chunk_seconds}")
    n_samples = int(n_samples)
    if n_samples <= n_fft // 2:  # the centred STFT reflects n_fft // 2 samples at each end
        raise ValueError(f"chunk_seconds: expected a window longer than n_fft // 2 = {n_fft // 2} samples, "
                         f"got {n_samples} samples ({chunk_seconds} s)")
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device: expected None, a str or a torch.device, got {type(device).__name__}")
    device = waveform.device if device is None else torch.device(device)
    return n_mels, n_fft, hop_length, n_samples, device


# ----------------------------------------------------------------------------- features
def _features(windows: torch.Tensor, filters_t: torch.Tensor, n_fft: int, hop_length: int) -> torch.Tensor:
    """[W, n_samples] float32 -> [W, n_mels, frames] float32."""
    spec = torch.stft(windows, n_fft, hop_length, window=_hann(n_fft, windows.device), center=True,
                      pad_mode="reflect", return_complex=True)  # [W, F, frames + 1]
    power = torch.view_as_real(spec[..., :-1]).pow(2).sum(-1)  # [W, F, frames]: the last frame dropped
    mel = torch.matmul(filters_t, power)  # [W, n_mels, frames]
    log_spec = mel.clamp(min=1e-10).log10()
    floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0  # per window: an 80 dB dynamic range
    return (torch.maximum(log_spec, floor) + 4.0) / 4.0


def log_mel(waveform: torch.Tensor, *, sampling_rate: int = 16000, n_mels: int = 80, n_fft: int = 400,
            hop_length: int = 160, chunk_seconds: float = 30, device: torch.device | str | None = None
            ) -> torch.Tensor:
    """Whisper's log-mel features of mono 16 kHz audio, as ``WhisperFeatureExtractor`` computes them.

    ``waveform``: [samples] or [batch, samples], float16 / bfloat16 / float32 / float64 (computed in
    float32). Each row is cut into ``ceil(samples / (chunk_seconds * 16000))`` windows (at least one; the
    last zero-padded to full length), and each window is featurised on its own.

    Returns float32 ``[windows, n_mels, frames]`` with ``frames = chunk_seconds * 16000 // hop_length``
    (3000 for 30 s); for a 2-d input the rows' windows follow one another, row 0's first, so a batch of
    clips of at most 30 s gives ``[batch, n_mels, 3000]``, as the extractor does. ``n_mels``: 80
    (Whisper v1 - v3 small) or 128 (large-v3), or any count whose filters each cover a frequency bin.
    The result is on ``device`` (default: the waveform's).

    Example:
        >>> audio = torch.randn(16000 * 45) * 0.1          # 45 s at 16 kHz
        >>> ember.audio.log_mel(audio).shape                # two 30 s windows
        torch.Size([2, 80, 3000])
        >>> ember.audio.log_mel(audio[None], n_mels=128).shape
        torch.Size([2, 128, 3000])
    """
    n_mels, n_fft, hop_length, n_samples, device = _validate(waveform, sampling_rate, n_mels, n_fft, hop_length,
                                                             chunk_seconds, device)
    filters_t = _mel_filters_t(SAMPLING_RATE, n_fft, n_mels, device, torch.float32)
    rows = waveform.to(device=device, dtype=torch.float32)
    rows = rows if rows.dim() == 2 else rows[None]  # [B, N]
    B, n = rows.shape
    per_row = max(1, -(-n // n_samples))
    if B == 0:
        return torch.empty(0, n_mels, n_samples // hop_length, device=device)
    rows = torch.nn.functional.pad(rows, (0, per_row * n_samples - n))
    windows = rows.reshape(B * per_row, n_samples)  # row 0's windows first
    if windows.shape[0] <= _WINDOWS_PER_BATCH:
        return _features(windows, filters_t, n_fft, hop_length)
    return torch.cat([_features(w, filters_t, n_fft, hop_length) for w in windows.split(_WINDOWS_PER_BATCH)])
