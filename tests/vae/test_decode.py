"""ember.vae.decode against diffusers' own decode on tiny random Wan-family VAEs (CPU)."""
import pytest
import torch

import ember

diffusers = pytest.importorskip("diffusers")
from diffusers import AutoencoderKLWan  # noqa: E402

from tests.vae import tiny  # noqa: E402

from ember.vae._decode import VaeSpec  # noqa: E402

CONFIGS = tiny.configs(num_res_blocks=0)


def psnr(a, b):
    """PSNR in dB of a against b for videos in [-1, 1] (peak-to-peak 2), float64 math."""
    mse = (((a.double() - b.double()) / 2) ** 2).mean()
    return (10 * torch.log10(1 / mse.clamp_min(1e-30))).item()


def make_vae(name, dtype=torch.float32):
    return tiny.make_vae(CONFIGS, name, dtype)


def diffusers_decode(vae, z, tile=None, overlap=None):
    tiny.set_diffusers_tiling(vae, tile, overlap)
    with torch.no_grad():
        return vae.decode(z).sample


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiled_matches_diffusers_tiled_fp32(name):
    vae = make_vae(name)
    comp = VaeSpec(vae).comp
    tile, overlap = 10 * comp, 2 * comp  # latent 14x18 -> 2 x 3 tiles, the last column cut short
    z = torch.randn(1, 4, 2, 14, 18)
    ref = diffusers_decode(vae, z, tile, overlap)
    out = ember.vae.decode(vae, z, tile=tile, overlap=overlap, progress=False)
    assert out.shape == ref.shape == (1, 3, 5, 14 * comp, 18 * comp)
    assert psnr(out, ref) >= 70


@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_untiled_matches_diffusers_fp32(name):
    vae = make_vae(name)
    z = torch.randn(2, 4, 3, 6, 5)  # batch 2, 3 latent frames -> 9 frames
    ref = diffusers_decode(vae, z)
    out = ember.vae.decode(vae, z, tile=False)
    assert out.shape == ref.shape
    assert psnr(out, ref) >= 70


def test_tiled_bf16_matches_diffusers():
    vae = make_vae("wan21", torch.bfloat16)
    z = torch.randn(1, 4, 2, 14, 18, dtype=torch.bfloat16)
    ref = diffusers_decode(vae, z, 80, 16)
    out = ember.vae.decode(vae, z, tile=80, overlap=16, progress=False)
    assert psnr(out, ref) >= 45


def test_optimize_makes_module_decode_use_ember(monkeypatch):
    vae = make_vae("wan21")
    z = torch.randn(1, 4, 2, 14, 18)
    ref = diffusers_decode(vae, z, 80, 16)
    calls = []
    import ember.vae._optimize as opt
    real = opt.decode
    monkeypatch.setattr(opt, "decode", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert ember.vae.optimize(vae, progress=False) is vae
    with torch.no_grad():
        out = vae.decode(z).sample  # tiling still enabled from diffusers_decode above
    assert calls and calls[0]["tile"] == (80, 80) and calls[0]["overlap"] == (16, 16)
    assert psnr(out, ref) >= 70
    assert vae.decode(z, return_dict=False)[0].shape == ref.shape


def test_no_padded_copies(monkeypatch):
    import torch.nn.functional as F
    vae = make_vae("wan22")
    pads = []
    real_pad = F.pad
    monkeypatch.setattr(F, "pad", lambda *a, **k: pads.append(1) or real_pad(*a, **k))
    ember.vae.decode(vae, torch.randn(1, 4, 2, 4, 4), tile=False)
    assert pads == []


def test_auto_tiles_bound_history(monkeypatch):
    import ember.vae._decode as dec
    vae = make_vae("wan21")
    spec = VaeSpec(vae)
    per_px = dec._history_bytes_per_latent_px(vae.decoder, 4)
    monkeypatch.setattr(dec, "AUTO_HISTORY_BYTES", per_px * 12 * 12)
    tile, overlap = dec.auto_tile(spec, 20, 20)
    assert tile[0] // spec.comp * tile[1] // spec.comp <= 144 and min(tile) >= 10 * spec.comp
    z = torch.randn(1, 4, 1, 20, 20)
    out = ember.vae.decode(vae, z, progress=False)  # tile=None -> auto
    ref = diffusers_decode(vae, z, None)
    assert psnr(out, ref) > 20


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("z, kwargs, exc, words", [
    (torch.randn(1, 5, 2, 14, 18), {}, ValueError, "latents: expected 4 channels"),
    (torch.randn(4, 2, 14, 18), {}, ValueError, "latents: expected a 5-d tensor"),
    (torch.randn(1, 4, 0, 14, 18), {}, ValueError, "latents: expected at least 1 latent frame"),
    (torch.randn(1, 4, 2, 14, 18, dtype=torch.float64), {}, TypeError, "latents: expected dtype torch.float32"),
    (torch.randn(1, 4, 2, 14, 18), {"tile": 84}, ValueError, "tile: expected a multiple of the spatial compression factor 8"),
    (torch.randn(1, 4, 2, 14, 18), {"tile": 32}, ValueError, "tile: expected at least 80 px"),
    (torch.randn(1, 4, 2, 14, 18), {"tile": 80, "overlap": 12}, ValueError, "overlap: expected a multiple"),
    (torch.randn(1, 4, 2, 14, 18), {"tile": 80, "overlap": 48}, ValueError, "overlap: expected 0 <= overlap <= tile / 2"),
    (torch.randn(1, 4, 2, 14, 18), {"tile": "big"}, TypeError, "tile: expected an int"),
])
def test_bad_input(z, kwargs, exc, words):
    vae = make_vae("wan21")
    with pytest.raises(exc) as info:
        ember.vae.decode(vae, z, **kwargs)
    assert words in str(info.value)


def test_unsupported_module():
    with pytest.raises(TypeError, match="vae: expected a diffusers AutoencoderKLWan or AutoencoderKLQwenImage, got Linear"):
        ember.vae.decode(torch.nn.Linear(2, 2), torch.randn(1, 4, 1, 2, 2))
    with pytest.raises(TypeError, match="got Linear"):
        ember.vae.optimize(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------ GPU (H200, diffusers wheel carried)
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_gpu_bf16_matches_diffusers_same_tiles(cuda, name):
    from ember.bench.vae import WAN_CONFIGS
    with torch.device(cuda):
        vae = AutoencoderKLWan(**WAN_CONFIGS[name]).to(torch.bfloat16).eval()
    comp = VaeSpec(vae).comp
    tile, overlap = 20 * comp, 4 * comp
    z = torch.randn(1, vae.config.z_dim, 5, 28, 40, device=cuda, dtype=torch.bfloat16)
    ref = diffusers_decode(vae, z, tile, overlap)
    out = ember.vae.decode(vae, z, tile=tile, overlap=overlap, progress=False)
    assert psnr(out, ref) >= 45


@pytest.mark.gpu
def test_gpu_fp32_matches_cpu_fp32(cuda):
    vae = make_vae("wan22")
    z = torch.randn(1, 4, 3, 14, 18)
    cpu = ember.vae.decode(vae, z, tile=160, overlap=32, progress=False)
    gpu = ember.vae.decode(vae.to(cuda), z.to(cuda), tile=160, overlap=32, progress=False)
    assert psnr(gpu.cpu(), cpu) >= 70


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frame_chunked_tail_equals_whole_chunks(name):
    """The up blocks after the last temporal upsampler, run a frame at a time (the default) and on
    all of a step's frames at once, give the same frames (fp32, CPU)."""
    from ember.vae._stream import StreamDecoder
    vae = make_vae(name)
    z = torch.randn(1, vae.config.z_dim, 3, 8, 8)
    z = torch.nn.functional.conv3d(z, vae.post_quant_conv.weight, vae.post_quant_conv.bias)
    out = {}
    for c in (1, 2, None):
        s = StreamDecoder(vae.decoder, frames_per_chunk=c)
        s.reset()
        out[c] = torch.cat([s.step(z[:, :, k:k + 1], first=(k == 0)) for k in range(3)], dim=2)
    assert out[None].shape[2] == 9  # 1 + 4 + 4 frames: the later steps really were split
    torch.testing.assert_close(out[1], out[None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2], out[None], rtol=1e-5, atol=1e-5)


def test_frames_per_chunk_argument_same_video():
    vae = make_vae("wan21")
    z = torch.randn(1, 4, 3, 12, 12)
    whole = ember.vae.decode(vae, z, tile=False, progress=False)
    for c in (1, 2):
        torch.testing.assert_close(ember.vae.decode(vae, z, tile=False, frames_per_chunk=c, progress=False), whole,
                                   rtol=1e-5, atol=1e-5)
    opt = ember.vae.optimize(make_vae("wan21"), frames_per_chunk=2, progress=False)
    opt.load_state_dict(vae.state_dict())
    torch.testing.assert_close(opt.decode(z).sample, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, True, "2", 1.5])
def test_frames_per_chunk_bad(bad):
    vae = make_vae("wan21")
    with pytest.raises(ValueError, match="frames_per_chunk: expected None or a positive integer"):
        ember.vae.decode(vae, torch.randn(1, 4, 1, 4, 4), frames_per_chunk=bad)
    with pytest.raises(ValueError, match="frames_per_chunk"):
        ember.vae.optimize(make_vae("wan21"), frames_per_chunk=bad)


def test_axis_trim_drops_the_tile_inside_the_last_one():
    """diffusers' layout starts a tile at every stride below the size; trimmed (auto) tiles stop at
    the first that reaches the end, which keeps every remaining row."""
    from ember.vae._decode import _Axis
    spec = VaeSpec(make_vae("wan22"))
    c = spec.comp
    full = _Axis(44, 24 * c, 4 * c, spec, True)
    trimmed = _Axis(44, 24 * c, 4 * c, spec, True, trim=True)
    assert full.starts == [0, 20, 40] and trimmed.starts == [0, 20]
    assert [full.keep_o(i) for i in range(2)] == [trimmed.keep_o(0), full.stride_o] == [20 * spec.comp_out] * 2
    assert trimmed.keep_o(1) == 24 * spec.comp_out  # the last tile keeps all it decoded
    assert _Axis(40, 24 * c, 4 * c, spec, True, trim=True).starts == [0, 20]  # exact fit: unchanged
    assert _Axis(45, 24 * c, 4 * c, spec, True, trim=True).starts == [0, 20, 40]  # 21 rows left: needed


@pytest.mark.parametrize("patch", [1, 2])
def test_axis_kept_rows_partition_the_output(patch):
    """Both layouts: origins increase from 0, every tile starts inside the latent, and the rows the
    tiles keep (clipped at the edge) cover the decoder output exactly once; trimmed, only the last
    tile reaches the edge."""
    from types import SimpleNamespace

    from ember.vae._decode import _Axis
    comp = 8 * patch
    spec = SimpleNamespace(comp=comp, patch=patch, comp_out=comp // patch)
    for n in range(1, 70):
        for tile in range(1, 40):
            for overlap in range(0, tile // 2 + 1):
                for trim in (False, True):
                    ax = _Axis(n, tile * comp, overlap * comp, spec, True, trim=trim)
                    starts = ax.starts
                    assert starts[0] == 0 and all(a < b < n for a, b in zip(starts, starts[1:]))
                    assert starts[-1] + tile >= n
                    if trim:
                        assert all(s + tile < n for s in starts[:-1]) and starts[-1] + tile >= n
                    covered = []
                    for i, s in enumerate(starts):
                        r0 = i * ax.stride_o
                        assert r0 == s * spec.comp_out
                        covered += range(r0, min(r0 + ax.keep_o(i), n * spec.comp_out, r0 + tile * spec.comp_out))
                    assert covered == list(range(n * spec.comp_out)), (n, tile, overlap, trim)


def test_auto_tiles_skip_diffusers_redundant_edge_tiles(monkeypatch):
    """Auto tiles decode 20 x 10 latents as 2 tiles where diffusers' layout of the same tiles takes 6
    (a 4-row strip below and a 2-column strip beside, inside the others). Rows the dropped tiles did
    not touch equal the diffusers-layout decode; the rest is the last tile's own decode, exactly."""
    import ember.vae._decode as dec
    vae = make_vae("wan21")
    c = VaeSpec(vae).comp
    monkeypatch.setattr(dec, "auto_tile", lambda spec, h, w: ((12 * c, 12 * c), (4 * c, 4 * c)))
    tiles = []
    real_reset = dec.StreamDecoder.reset
    monkeypatch.setattr(dec.StreamDecoder, "reset", lambda self: tiles.append(1) or real_reset(self))
    z = torch.randn(1, 4, 2, 20, 10)
    out = ember.vae.decode(vae, z, progress=False)
    n_auto = len(tiles) - 1  # decode resets once more on its way out
    tiles.clear()
    layout = ember.vae.decode(vae, z, tile=12 * c, overlap=4 * c, progress=False)
    assert (n_auto, len(tiles) - 1) == (2, 6)
    assert torch.equal(out[..., :16 * c, :8 * c], layout[..., :16 * c, :8 * c])
    last = ember.vae.decode(vae, z[..., 8:, :], tile=False)
    assert torch.equal(out[..., 16 * c:, :], last[..., 8 * c:, :])
    assert psnr(out, diffusers_decode(vae, z)) > 20


def test_auto_tiles_take_smaller_budget_only_when_nearly_free(monkeypatch):
    """auto_tile's choice keeps its history within the budget and decodes at most
    AUTO_MAX_EXTRA_WORK more latent pixels than the full budget's tiling; on some shapes it does
    take the smaller tiles."""
    import ember.vae._decode as dec
    vae = make_vae("wan21")
    spec = VaeSpec(vae)
    per_px = dec._history_bytes_per_latent_px(vae.decoder, 4)
    budget = per_px * 60 * 50
    monkeypatch.setattr(dec, "AUTO_HISTORY_BYTES", budget)
    smaller = 0
    for h, w in [(16, 40), (16, 90), (30, 30), (60, 104), (40, 100), (64, 64)]:
        full_work = dec._tiling(spec, h, w, per_px, budget)[0]
        got = dec.auto_tile(spec, h, w)
        if got is None:
            th, tw = h, w
            work = h * w
        else:
            (th, tw), (oh, ow) = [(a // spec.comp, b // spec.comp) for a, b in got]
            nh = 1 if th >= h else -(-(h - oh) // (th - oh))
            nw = 1 if tw >= w else -(-(w - ow) // (tw - ow))
            work = nh * nw * th * tw
        assert th * tw * per_px <= budget
        assert work <= full_work * (1 + dec.AUTO_MAX_EXTRA_WORK) + 1e-9, (h, w, got)
        smaller += th * tw * per_px <= budget / 2
    assert smaller > 0


def test_frame_chunk_switch(monkeypatch):
    from ember.vae import _decode
    assert _decode._frames_per_chunk() is None  # default: all of a step's frames at once
    monkeypatch.setenv("EMBER_VAE_FRAME_CHUNK", "1")
    assert _decode._frames_per_chunk() == 1
    monkeypatch.setenv("EMBER_VAE_FRAME_CHUNK", "one")
    with pytest.raises(ValueError, match="EMBER_VAE_FRAME_CHUNK"):
        _decode._frames_per_chunk()


def test_fused_norm_silu_and_row_bias_match_the_two_step_path_interpreter(interpreter):
    """The stream's one-pass norm + SiLU into a conv buffer slice and its row-wise conv bias give the
    bits of the two-step path (rms_norm, then silu; torch's broadcast bias add), on channels-last data."""
    from ember.vae import _stream
    vae = make_vae("wan21")
    norm = vae.decoder.mid_block.resnets[0].norm1  # a WanRMS_norm
    C = norm.gamma.numel()
    x = torch.randn(1, C, 3, 4, 5).contiguous(memory_format=_stream.CL3)
    buf = torch.full((1, C, 5, 4, 5), 7.0).contiguous(memory_format=_stream.CL3)
    _stream.norm_silu(norm, x, out=buf[:, :, 2:])
    assert torch.equal(buf[:, :, :2], torch.full_like(buf[:, :, :2], 7.0))   # the history frames untouched
    exp = torch.nn.functional.silu(_stream.rms_norm(norm, x))
    torch.testing.assert_close(buf[:, :, 2:], exp, atol=1e-6, rtol=1e-6)  # interpreter exp vs torch's: ulps
    y = torch.randn(1, C, 3, 4, 5).contiguous(memory_format=_stream.CL3)
    bias = torch.randn(C)
    assert torch.equal(_stream.add_conv_bias_(y.clone(), bias), y + bias.view(1, C, 1, 1, 1))


def test_folded_conv_biases_same_bits_interpreter(interpreter):
    """conv1's bias folded into norm2's pass and conv2's into the shortcut add give the bits of the
    separate adds (bf16: each sum rounded as torch stores it), with and without a shortcut."""
    from ember.vae import _stream
    vae = make_vae("wan21", torch.bfloat16)
    norm = vae.decoder.mid_block.resnets[0].norm2
    C = norm.gamma.numel()
    cl = dict(memory_format=_stream.CL3)
    x = torch.randn(1, C, 3, 4, 5, dtype=torch.bfloat16).contiguous(**cl)
    bias = torch.randn(C, dtype=torch.bfloat16)
    got = torch.zeros(1, C, 5, 4, 5, dtype=torch.bfloat16).contiguous(**cl)
    _stream.norm_silu(norm, x, out=got[:, :, 2:], bias=bias)
    assert torch.equal(got[:, :, 2:], _stream.norm_silu(norm, (x + bias.view(1, C, 1, 1, 1)).contiguous(**cl)))
    h = torch.randn(1, C, 3, 4, 5, dtype=torch.bfloat16).contiguous(**cl)
    assert torch.equal(_stream.add_conv_bias_(x.clone(), bias, residual=h), (x + bias.view(1, C, 1, 1, 1)) + h)
    assert torch.equal(_stream.add_conv_bias_(x.clone(), None, residual=h), x + h)
    strided = torch.randn(1, C, 3, 4, 5, dtype=torch.bfloat16)  # not channels-last: the torch path
    assert torch.equal(_stream.add_conv_bias_(strided.clone(), bias, residual=h), (strided + bias.view(1, C, 1, 1, 1)) + h)


@pytest.mark.parametrize("name", ["wan21", "wan22"])
def test_decode_through_kernels_matches_diffusers_interpreter(interpreter, name):
    """The whole decode with the Triton norm and bias kernels (interpreted) against diffusers."""
    vae = make_vae(name)
    z = torch.randn(1, 4, 2, 3, 4)
    ref = diffusers_decode(vae, z)
    out = ember.vae.decode(vae, z, tile=False)
    assert out.shape == ref.shape
    assert psnr(out, ref) >= 70


def test_graph_switch(monkeypatch):
    from ember.vae import _decode
    spec = VaeSpec(make_vae("wan21"))
    assert not _decode._use_graphs(spec, 9)  # CPU: eager
    monkeypatch.setenv("EMBER_VAE_GRAPHS", "maybe")
    with pytest.raises(ValueError, match="EMBER_VAE_GRAPHS"):
        _decode._use_graphs(spec, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["wan21", "wan22"])
@pytest.mark.parametrize("tile", [None, False])
def test_gpu_graph_replays_equal_eager_steps(cuda, monkeypatch, name, tile):
    """Steps replayed from a CUDA graph give the eager steps' bits, tiled (a graph per tile, tiles of
    different sizes) and untiled, and with the full-resolution tail in 2-frame chunks."""
    vae = make_vae(name, torch.bfloat16).to(cuda)
    comp = VaeSpec(vae).comp
    z = torch.randn(1, 4, 6, 14, 18, device=cuda, dtype=torch.bfloat16)
    kw = dict(tile=10 * comp, overlap=2 * comp) if tile is None else dict(tile=False)
    for chunk in (None, 2):
        monkeypatch.setenv("EMBER_VAE_GRAPHS", "0")
        eager = ember.vae.decode(vae, z, frames_per_chunk=chunk, progress=False, **kw)
        monkeypatch.setenv("EMBER_VAE_GRAPHS", "1")
        graphed = ember.vae.decode(vae, z, frames_per_chunk=chunk, progress=False, **kw)
        assert torch.equal(graphed, eager), (name, tile, chunk)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("hw", [(6, 7), (1, 1), (3, 2)])
def test_subpixel_upsample_conv_equals_upsample_then_conv(bias, hw):
    """The 2x2 sub-pixel form of 2x nearest upsample + 3x3 conv (padding 1) is the same function:
    float64 to rounding, borders included; the kernels are re-derived when the weight changes."""
    from ember.vae import _stream
    conv = torch.nn.Conv2d(5, 3, 3, padding=1, bias=bias).double()
    x = torch.randn(2, 5, *hw, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    s = _stream.StreamDecoder(make_vae("wan21").decoder)
    with torch.no_grad():
        for _ in range(2):
            ref = conv(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest-exact"))
            got = s._subpixel_upsample_conv(x, conv)
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
            conv.weight.mul_(-0.5)  # an in-place update: new kernels, not the cached ones


def test_subpixel_switch_and_exact_path(monkeypatch):
    """EMBER_VAE_SUBPIXEL=0 keeps the upsample-then-conv path (diffusers' op order)."""
    from ember.vae import _stream
    vae = make_vae("wan22")
    z = torch.randn(1, 4, 2, 4, 5)
    ref = diffusers_decode(vae, z)
    monkeypatch.setenv("EMBER_VAE_SUBPIXEL", "0")
    assert psnr(ember.vae.decode(vae, z, tile=False), ref) >= 70
    monkeypatch.setenv("EMBER_VAE_SUBPIXEL", "maybe")
    with pytest.raises(ValueError, match="EMBER_VAE_SUBPIXEL"):
        _stream.subpixel_enabled()


@pytest.mark.parametrize("ft,fs,cin,cout,t,first", [(2, 2, 16, 16, 1, True), (2, 2, 16, 16, 2, False),
                                                     (1, 2, 16, 8, 2, False), (2, 2, 8, 16, 3, True),
                                                     (2, 1, 12, 6, 2, False)])
def test_dup_up_add_kernel_equals_the_gather_interpreter(interpreter, monkeypatch, ft, fs, cin, cout, t, first):
    """The one-pass DupUp3D shortcut add gives the bits of the torch gather + add and of diffusers'
    module + add (bf16), first chunk or not, on a channels-last source."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D
    from ember import _dispatch
    from ember.vae import _stream
    du = DupUp3D(cin, cout, ft, fs)
    s = _stream.StreamDecoder(make_vae("wan21").decoder)
    x_in = torch.randn(2, cin, t, 3, 5, dtype=torch.bfloat16).contiguous(memory_format=_stream.CL3)
    frames = t * ft - (ft - 1 if first else 0)  # diffusers drops the first chunk's first ft - 1 frames
    x = torch.randn(2, cout, frames, 3 * fs, 5 * fs, dtype=torch.bfloat16).contiguous(memory_format=_stream.CL3)
    got = s.dup_up_add(du, x_in, x.clone(), first)
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: False)
    assert torch.equal(got, s.dup_up_add(du, x_in, x.clone(), first))
    ref = du(x_in, first_chunk=first)  # diffusers' own module
    assert torch.equal(got, (x.float() + ref.float()).to(torch.bfloat16))


def test_steady_steps_fall_back_to_eager_when_capture_fails(monkeypatch):
    """A CUDA-graph capture that raises costs the replay, not the result: the step runs eagerly
    (with a warning) and the tile's later steps stay eager."""
    from ember.vae import _decode, _stream
    vae = make_vae("wan21")
    z = torch.randn(1, 4, 4, 3, 4)

    class Boom:
        def __init__(self, graph):
            pass

        def __enter__(self):
            raise RuntimeError("capture not permitted")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", Boom)
    eager = _decode._SteadySteps(_stream.StreamDecoder(vae.decoder), vae.post_quant_conv, graphs=False)
    steady = _decode._SteadySteps(_stream.StreamDecoder(vae.decoder), vae.post_quant_conv, graphs=True)
    with torch.no_grad():
        for k in range(4):
            want = eager.step(z[:, :, k:k + 1], k)
            if k == _decode.GRAPH_FROM_FRAME:
                with pytest.warns(UserWarning, match="capture failed"):
                    got = steady.step(z[:, :, k:k + 1], k)
            else:
                got = steady.step(z[:, :, k:k + 1], k)
            assert torch.equal(got, want), k
    assert steady.graph is None and not steady.graphs
