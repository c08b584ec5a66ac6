"""ember.vae.encode against diffusers' own encode on tiny random Wan-family VAEs (CPU)."""
import pytest
import torch
import torch.nn.functional as F

import ember

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402

from tests.vae import tiny  # noqa: E402
from diffusers.models.autoencoders.autoencoder_kl_wan import AvgDown3D  # noqa: E402
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution  # noqa: E402
from diffusers.models.modeling_outputs import AutoencoderKLOutput  # noqa: E402

import ember.vae._encode as enc  # noqa: E402
from ember.vae._encode import EncoderSpec, StreamEncoder  # noqa: E402

# num_res_blocks=1: with 0, diffusers' own Wan2.1 encoder cannot run (its resample expects out_dim channels)
CONFIGS = tiny.configs(num_res_blocks=1)


def psnr(a, ref, peak=None):
    """PSNR in dB of a against ref, peak = ref's peak-to-peak range unless given, float64 math."""
    ref = ref.double()
    peak = (ref.max() - ref.min()).item() if peak is None else peak
    mse = ((a.double() - ref) ** 2).mean()
    return (10 * torch.log10(peak ** 2 / mse.clamp_min(1e-30))).item()


def make_vae(name, dtype=torch.float32):
    return tiny.make_vae(CONFIGS, name, dtype)


def make_video(vae, frames, h_lat, w_lat, batch=1, dtype=torch.float32):
    spec = EncoderSpec(vae)
    return (torch.rand(batch, spec.channels, frames, h_lat * spec.comp, w_lat * spec.comp) * 2 - 1).to(dtype)


def diffusers_encode(vae, x, tile=None, overlap=None):
    """diffusers' posterior; tile/overlap in diffusers' own encode units (patchified px for Wan2.2)."""
    tiny.set_diffusers_tiling(vae, tile, overlap)
    with torch.no_grad():
        return vae.encode(x).latent_dist


def assert_same_posterior(got, ref, db):
    assert isinstance(got, DiagonalGaussianDistribution)
    assert got.mean.shape == ref.mean.shape and got.logvar.shape == ref.logvar.shape
    assert psnr(got.mean, ref.mean) >= db
    assert psnr(got.logvar, ref.logvar) >= db


def count_steps(monkeypatch):
    steps = []
    real = StreamEncoder.step
    monkeypatch.setattr(StreamEncoder, "step", lambda self, x: steps.append(x.shape) or real(self, x))
    return steps


# ------------------------------------------------------------------ pieces
@pytest.mark.parametrize("cin, cout, ft, fs", [(4, 8, 1, 2), (8, 16, 2, 2), (16, 16, 2, 2), (8, 8, 1, 1),
                                               (4, 32, 2, 2), (4, 16, 2, 2)])
@pytest.mark.parametrize("frames", [1, 2, 4])
def test_avg_down_matches_diffusers(cin, cout, ft, fs, frames):
    """Every group split (mean over t/row/col offsets or none), with and without diffusers' zero frame."""
    ad = AvgDown3D(cin, cout, ft, fs)
    x = torch.randn(2, cin, frames, 4, 6).contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(StreamEncoder.avg_down(ad, x), ad(x), rtol=1e-6, atol=1e-6)


def test_folded_downsample_conv_equals_zero_pad_then_conv():
    conv = torch.nn.Conv2d(3, 5, 3, stride=2)
    x = torch.randn(2, 3, 10, 14, dtype=torch.float64)
    conv = conv.double()
    ref = conv(F.pad(x, (0, 1, 0, 1)))
    got = F.conv2d(x, StreamEncoder(None).fold_pad(conv), conv.bias, 2, 1)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ against diffusers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_untiled_matches_diffusers_fp32(name):
    vae = make_vae(name)
    x = make_video(vae, 9, 6, 5, batch=2)  # 9 frames -> 3 latent frames
    ref = diffusers_encode(vae, x)
    got = ember.vae.encode(vae, x, tile=False)
    assert got.mean.shape == (2, 4, 3, 6, 5)
    assert_same_posterior(got, ref, 70)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiled_matches_diffusers_tiled_fp32(name, monkeypatch):
    vae = make_vae(name)
    spec = EncoderSpec(vae)
    x = make_video(vae, 5, 14, 18)  # latent 14x18 -> 2 x 3 tiles of 10 with stride 8, the last ones cut short
    p = spec.patch
    ref = diffusers_encode(vae, x, 10 * spec.comp // p, 2 * spec.comp // p)
    steps = count_steps(monkeypatch)
    got = ember.vae.encode(vae, x, tile=10 * spec.comp, overlap=2 * spec.comp, progress=False)
    assert len(steps) == 6 * 2  # 6 tiles x 2 chunks: it really tiled
    assert_same_posterior(got, ref, 70)
    untiled = diffusers_encode(vae, x)
    assert psnr(got.mean, untiled.mean) < 60  # tiling changed the result, as it does in diffusers


def test_tiled_bf16_matches_diffusers():
    vae = make_vae("wan21", torch.bfloat16)
    x = make_video(vae, 5, 14, 18, dtype=torch.bfloat16)
    ref = diffusers_encode(vae, x, 80, 16)
    got = ember.vae.encode(vae, x, tile=80, overlap=16, progress=False)
    assert_same_posterior(got, ref, 45)


def test_auto_tiles_bound_history(monkeypatch):
    vae = make_vae("wan21")
    spec = EncoderSpec(vae)
    monkeypatch.setattr(enc, "AUTO_HISTORY_BYTES", spec.history_bytes_per_latent_px() * 12 * 12)
    tile, overlap = enc.auto_tile(spec, 20, 20)
    assert tile == (96, 96) and overlap == (24, 24)  # 12 x 12 latent px, a quarter overlap
    assert enc.auto_tile(spec, 12, 12) is None
    x = make_video(vae, 1, 20, 20)
    steps = count_steps(monkeypatch)
    got = ember.vae.encode(vae, x, progress=False)  # tile=None -> auto
    # 2 x 2 tiles at latent 0 and 9 (diffusers' layout of the same tiles adds strips at 18: 3 x 3)
    assert len(steps) == 4
    ref = diffusers_encode(vae, x, 96, 24)
    assert psnr(got.mean[..., :18, :18], ref.mean[..., :18, :18]) >= 70  # where the strips were not
    c = spec.comp
    crop = ember.vae.encode(vae, x[..., 9 * c:, 9 * c:], tile=False).parameters
    assert torch.equal(got.parameters[..., 18:, 18:], crop[..., 9:, 9:])  # the last tile's own rows


# ------------------------------------------------------------------ optimize
@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_optimize_makes_module_encode_use_ember(name, monkeypatch):
    vae = make_vae(name)
    spec = EncoderSpec(vae)
    x = make_video(vae, 5, 14, 18, batch=2)
    tile, overlap = 10 * spec.comp // spec.patch, 2 * spec.comp // spec.patch  # diffusers' units
    ref = diffusers_encode(vae, x, tile, overlap)
    ref_untiled = diffusers_encode(vae, x)
    assert ember.vae.optimize(vae, progress=False) is vae
    steps = count_steps(monkeypatch)
    vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                      tile_sample_stride_height=tile - overlap, tile_sample_stride_width=tile - overlap)
    vae.enable_slicing()
    with torch.no_grad():
        out = vae.encode(x)
    assert isinstance(out, AutoencoderKLOutput)
    assert len(steps) == 2 * 6 * 2  # batch sliced, 6 tiles x 2 chunks each
    assert_same_posterior(out.latent_dist, ref, 70)
    vae.disable_tiling()
    vae.disable_slicing()
    with torch.no_grad():
        (post,) = vae.encode(x, return_dict=False)
    assert_same_posterior(post, ref_untiled, 70)


def test_optimize_follows_diffusers_tiling_rule_for_patchified_input():
    """diffusers tiles a Wan2.2 video wider than tile_sample_min (patchified px) into 2 tiles here,
    though the video (144 px) is narrower than the tile in video px (160): ember must tile too."""
    vae = make_vae("wan22")
    x = make_video(vae, 1, 9, 9)
    ref = diffusers_encode(vae, x, 80, 32)
    assert psnr(ref.mean, diffusers_encode(vae, x).mean) < 60  # diffusers really tiled
    ember.vae.optimize(vae, progress=False)
    vae.enable_tiling(80, 80, 48, 48)
    with torch.no_grad():
        got = vae.encode(x).latent_dist
    assert_same_posterior(got, ref, 70)


# ------------------------------------------------------------------ round trip and copies
@pytest.mark.parametrize("name", ["wan21", "wan22", "qwen"])
def test_round_trip_equals_diffusers_round_trip(name):
    vae = make_vae(name)
    spec = EncoderSpec(vae)
    x = make_video(vae, 5, 14, 20)
    c = spec.comp
    ref_z = diffusers_encode(vae, x, 10 * c // spec.patch, 2 * c // spec.patch).mode()
    vae.enable_tiling(14 * c, 14 * c, 12 * c, 12 * c)  # decode tiles cover the decoder's 13.5 px radius
    with torch.no_grad():
        ref = vae.decode(ref_z).sample
    z = ember.vae.encode(vae, x, tile=10 * c, overlap=2 * c, progress=False).mode()
    got = ember.vae.decode(vae, z, tile=14 * c, overlap=2 * c, progress=False)
    assert got.shape == ref.shape == x.shape
    assert psnr(got, ref, peak=2.0) >= 70


@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_no_padded_copies(name, monkeypatch):
    vae = make_vae(name)
    x = make_video(vae, 5, 6, 6)
    pads = []
    real_pad = F.pad
    monkeypatch.setattr(F, "pad", lambda *a, **k: pads.append(1) or real_pad(*a, **k))
    diffusers_encode(vae, x)
    assert pads, "the counter sees diffusers' pads"
    pads.clear()
    ember.vae.encode(vae, x, tile=False)
    ember.vae.encode(vae, x, tile=4 * EncoderSpec(vae).comp, overlap=EncoderSpec(vae).comp, progress=False)
    assert pads == []


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("shape, kwargs, exc, words", [
    ((1, 4, 5, 32, 32), {}, ValueError, "video: expected 3 channels"),
    ((3, 5, 32, 32), {}, ValueError, "video: expected a 5-d tensor"),
    ((1, 3, 6, 32, 32), {}, ValueError, "video: expected 1 + 4k frames"),
    ((1, 3, 0, 32, 32), {}, ValueError, "video: expected 1 + 4k frames"),
    ((1, 3, 5, 36, 32), {}, ValueError, "multiples of the spatial compression factor 8"),
    ((1, 3, 5, 32, 32), {"tile": 20}, ValueError, "tile: expected a positive multiple of the spatial compression factor 8"),
    ((1, 3, 5, 32, 32), {"tile": 16, "overlap": 4}, ValueError, "overlap: expected a multiple"),
    ((1, 3, 5, 32, 32), {"tile": 16, "overlap": 16}, ValueError, "overlap: expected 0 <= overlap <= tile / 2"),
    ((1, 3, 5, 32, 32), {"tile": "big"}, TypeError, "tile: expected an int"),
])
def test_bad_input(shape, kwargs, exc, words):
    vae = make_vae("wan21")
    with pytest.raises(exc) as info:
        ember.vae.encode(vae, torch.rand(shape), **kwargs)
    assert words in str(info.value)


def test_bad_dtype_and_wan22_sizes():
    vae = make_vae("wan22")
    with pytest.raises(TypeError, match="video: expected dtype torch.float32"):
        ember.vae.encode(vae, torch.rand(1, 3, 1, 32, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="spatial compression factor 16"):
        ember.vae.encode(vae, torch.rand(1, 3, 1, 24, 32))
    with pytest.raises(ValueError, match="tile: expected a positive multiple of the spatial compression factor 16"):
        ember.vae.encode(vae, torch.rand(1, 3, 1, 32, 32), tile=40)


def test_unsupported_module():
    with pytest.raises(TypeError, match="vae: expected a diffusers AutoencoderKLWan or AutoencoderKLQwenImage, got Linear"):
        ember.vae.encode(torch.nn.Linear(2, 2), torch.rand(1, 3, 1, 8, 8))


# ------------------------------------------------------------------ GPU (H200, diffusers wheel carried)
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_gpu_bf16_matches_diffusers_same_tiles(cuda, name):
    from ember.bench.vae import WAN_CONFIGS
    with torch.device(cuda):
        vae = AutoencoderKLWan(**WAN_CONFIGS[name]).to(torch.bfloat16).eval()
    spec = EncoderSpec(vae)
    x = (torch.rand(1, 3, 9, 28 * spec.comp, 40 * spec.comp, device=cuda) * 2 - 1).to(torch.bfloat16)
    tile, overlap = 20 * spec.comp, 4 * spec.comp
    ref = diffusers_encode(vae, x, tile // spec.patch, overlap // spec.patch)
    got = ember.vae.encode(vae, x, tile=tile, overlap=overlap, progress=False)
    assert_same_posterior(got, ref, 45)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_gpu_fp32_round_trip_matches_cpu_fp32(cuda, name, monkeypatch):
    # fp32 means fp32: cuDNN would otherwise run these convolutions in TF32 (PyTorch's default)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    vae = make_vae(name)
    comp = EncoderSpec(vae).comp
    x = make_video(vae, 9, 14, 18)
    ekw = dict(tile=10 * comp, overlap=2 * comp, progress=False)
    dkw = dict(tile=14 * comp, overlap=2 * comp, progress=False)
    cpu = ember.vae.decode(vae, ember.vae.encode(vae, x, **ekw).mode(), **dkw)
    vae = vae.to(cuda)
    gpu = ember.vae.decode(vae, ember.vae.encode(vae, x.to(cuda), **ekw).mode(), **dkw)
    assert psnr(gpu.cpu(), cpu, peak=2.0) >= 70
