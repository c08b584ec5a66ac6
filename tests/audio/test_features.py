from unittest import mock

import numpy as np
import pytest
import torch

import ember.audio.features as features
from ember.audio.features import log_mel

SR = 16000


def whisper_numpy(clip: np.ndarray, n_mels: int = 80, **kw) -> np.ndarray:
    """transformers' WhisperFeatureExtractor on its numpy path: [clips, n_mels, frames] for one clip of
    at most ``chunk_length`` seconds or a list of equal-length ones."""
    from transformers import WhisperFeatureExtractor
    import transformers.models.whisper.feature_extraction_whisper as fw
    fe = WhisperFeatureExtractor(feature_size=n_mels, **kw)
    with mock.patch.object(fw, "is_torch_available", lambda: False):
        return fe(clip, sampling_rate=SR, return_tensors="np")["input_features"]


def whisper_windows(wave: np.ndarray, n_mels: int = 80, chunk_seconds: int = 30, **kw) -> np.ndarray:
    """The extractor on each consecutive chunk_seconds window (it pads the last one)."""
    n = chunk_seconds * SR
    chunks = [wave[i:i + n] for i in range(0, max(len(wave), 1), n)]
    return np.concatenate([whisper_numpy(c, n_mels, chunk_length=chunk_seconds, **kw) for c in chunks])


def signal(kind: str, seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    rng = np.random.default_rng(0)
    if kind == "noise":
        x = rng.standard_normal(t.size) * 0.1
    elif kind == "tone":
        x = 0.5 * np.sin(2 * np.pi * 440.0 * t) + 0.2 * np.sin(2 * np.pi * 3150.0 * t)
    else:  # a linear chirp 100 Hz -> 7.5 kHz over the clip
        x = 0.4 * np.sin(2 * np.pi * (100.0 * t + (7400.0 / (2 * max(seconds, 1e-9))) * t ** 2))
    return x.astype(np.float32)


# The numpy path's FFT is float64, ours float32: float32 round-off of ~1e-7 of the peak amplitude
# becomes a relative error of ~1e-3 in bins 80 dB below the peak (just above the floor), ~2e-4
# after log10 / 4 (measured: chirps 1.9e-4, noise 1.4e-5).
TOL = 1e-3
# The extractor's torch path does the same float32 math: measured within 1.2e-7 (one ulp at 1.0).
TOL_TORCH = 1e-6


def whisper_torch_windows(wave: np.ndarray, n_mels: int = 80) -> np.ndarray:
    from transformers import WhisperFeatureExtractor
    fe, n = WhisperFeatureExtractor(feature_size=n_mels), 30 * SR
    return np.concatenate([fe(wave[i:i + n], sampling_rate=SR, return_tensors="np")["input_features"]
                           for i in range(0, len(wave), n)])


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds", [7.3, 30, 65.5])
@pytest.mark.parametrize("kind", ["noise", "tone", "chirp"])
def test_matches_whisper_feature_extractor(kind, seconds, n_mels):
    wave = signal(kind, seconds)
    got = log_mel(torch.from_numpy(wave), n_mels=n_mels)
    windows = -(-len(wave) // (30 * SR))
    assert got.shape == (windows, n_mels, 3000) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), whisper_windows(wave, n_mels), atol=TOL, rtol=0)
    np.testing.assert_allclose(got.numpy(), whisper_torch_windows(wave, n_mels), atol=TOL_TORCH, rtol=0)


def test_batch_of_clips_matches_the_extractor_batch_and_single_rows():
    clips = np.stack([signal("noise", 12), signal("chirp", 12), signal("tone", 12)])
    got = log_mel(torch.from_numpy(clips))
    assert got.shape == (3, 80, 3000)
    np.testing.assert_allclose(got.numpy(), whisper_numpy(list(clips)), atol=TOL, rtol=0)
    long = torch.from_numpy(np.stack([signal("noise", 40), signal("chirp", 40)]))
    got = log_mel(long)
    assert got.shape == (4, 80, 3000)  # row 0's two windows, then row 1's
    torch.testing.assert_close(got, torch.cat([log_mel(long[0]), log_mel(long[1])]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("n_mels", [40, 64])
def test_other_mel_counts_match_the_extractor(n_mels):
    wave = signal("chirp", 5)
    np.testing.assert_allclose(log_mel(torch.from_numpy(wave), n_mels=n_mels).numpy(),
                               whisper_numpy(wave, n_mels), atol=TOL, rtol=0)


def test_other_window_and_stft_sizes_match_the_extractor():
    wave = signal("noise", 23)
    got = log_mel(torch.from_numpy(wave), chunk_seconds=10, n_fft=512, hop_length=128)
    assert got.shape == (3, 80, 10 * SR // 128)
    np.testing.assert_allclose(got.numpy(), whisper_windows(wave, chunk_seconds=10, n_fft=512, hop_length=128),
                               atol=TOL, rtol=0)


def test_empty_and_tiny_inputs_are_one_padded_window():
    silence = log_mel(torch.zeros(30 * SR))
    np.testing.assert_allclose(silence.numpy(), whisper_numpy(np.zeros(30 * SR, np.float32)), atol=TOL, rtol=0)
    assert torch.equal(log_mel(torch.zeros(0)), silence)
    assert log_mel(torch.zeros(0, 5)).shape == (0, 80, 3000)  # no rows: no windows
    one = np.array([0.25], np.float32)
    np.testing.assert_allclose(log_mel(torch.from_numpy(one)).numpy(), whisper_numpy(one), atol=TOL, rtol=0)


def test_input_dtypes_are_computed_in_float32():
    wave = torch.from_numpy(signal("noise", 3))
    ref = log_mel(wave)
    assert torch.equal(log_mel(wave.double()), ref)  # the extractor also casts float64 to float32
    half = wave.to(torch.bfloat16)
    assert torch.equal(log_mel(half), log_mel(half.float()))
    assert torch.equal(log_mel(wave[None, ::1].expand(2, -1))[1:], ref)  # a stride-0 batch


def test_long_audio_in_several_stft_batches(monkeypatch):
    wave = torch.from_numpy(signal("chirp", 100))  # 4 windows
    whole = log_mel(wave)
    monkeypatch.setattr(features, "_WINDOWS_PER_BATCH", 3)
    torch.testing.assert_close(log_mel(wave), whole, atol=1e-6, rtol=0)


def test_filterbank_is_built_once_per_key():
    a = features._mel_filters_t(SR, 400, 80, torch.device("cpu"), torch.float32)
    assert features._mel_filters_t(SR, 400, 80, torch.device("cpu"), torch.float32) is a
    assert a.shape == (80, 201)


def test_bad_inputs():
    wave = torch.zeros(SR)
    with pytest.raises(ValueError, match="waveform: expected a 1-d"):
        log_mel(torch.zeros(1, 2, SR))
    with pytest.raises(ValueError, match="waveform: expected a 1-d"):
        log_mel(torch.tensor(0.0))
    with pytest.raises(TypeError, match="waveform: expected dtype"):
        log_mel(torch.zeros(SR, dtype=torch.int16))
    with pytest.raises(TypeError, match="waveform: expected a torch.Tensor"):
        log_mel(np.zeros(SR, np.float32))
    for rate in (8000, 22050, 44100):
        with pytest.raises(ValueError, match=f"sampling_rate: expected 16000 .*got {rate}"):
            log_mel(wave, sampling_rate=rate)
    with pytest.raises(TypeError, match="sampling_rate"):
        log_mel(wave, sampling_rate="16k")
    with pytest.raises(ValueError, match="n_mels: 1000 filters over 201 frequency bins"):
        log_mel(wave, n_mels=1000)
    with pytest.raises(ValueError, match="n_mels: expected an int >= 1"):
        log_mel(wave, n_mels=0)
    with pytest.raises(TypeError, match="n_mels: expected an int"):
        log_mel(wave, n_mels=80.0)
    with pytest.raises(ValueError, match="chunk_seconds"):
        log_mel(wave, chunk_seconds=0)
    with pytest.raises(ValueError, match="chunk_seconds"):
        log_mel(wave, chunk_seconds=1e-5)  # not whole samples
    with pytest.raises(ValueError, match="chunk_seconds: expected a window longer"):
        log_mel(wave, chunk_seconds=0.01)
    with pytest.raises(TypeError, match="hop_length"):
        log_mel(wave, hop_length=None)
    with pytest.raises(TypeError, match="device"):
        log_mel(wave, device=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("n_mels", [80, 128])
def test_gpu_matches_cpu_and_the_extractor(cuda, n_mels):
    wave = torch.from_numpy(np.stack([signal("chirp", 95), signal("noise", 95)]))  # 4 windows a row
    got = log_mel(wave.to(cuda), n_mels=n_mels)
    assert got.device.type == "cuda" and got.shape == (8, n_mels, 3000)
    torch.testing.assert_close(got.cpu(), log_mel(wave, n_mels=n_mels), atol=TOL, rtol=0)
    np.testing.assert_allclose(got[:4].cpu().numpy(), whisper_windows(wave[0].numpy(), n_mels), atol=TOL, rtol=0)
    moved = log_mel(wave, n_mels=n_mels, device=cuda)
    assert moved.device.type == "cuda"
    torch.testing.assert_close(moved, got, atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_hour_of_audio(cuda):
    wave = torch.randn(3600 * SR, device=cuda) * 0.1  # 120 windows, 4 STFT batches
    got = log_mel(wave)
    assert got.shape == (120, 80, 3000) and torch.isfinite(got).all()
    torch.testing.assert_close(got[-3:].cpu(), log_mel(wave[-3 * 30 * SR:].cpu()), atol=TOL, rtol=0)
