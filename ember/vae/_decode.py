"""``ember.vae.decode``: tiled, low-memory decode for diffusers' Wan-family video VAEs.

Tiles follow diffusers' ``tiled_decode`` exactly (same tile origins, the same linear cross-fade of a
tile's top rows with the tile above and its left columns with the tile to the left, same crops), so
with the same tile settings the result matches diffusers' to rounding. What differs is the work:
each tile is streamed latent frame by latent frame through ``StreamDecoder`` (no padded copies,
channels-last), and each decoded chunk is blended against thin strips kept from its neighbours and
written straight into the output, instead of keeping every decoded tile until the end. Peak memory
is one tile's conv histories and activations plus the output.
"""
from __future__ import annotations

import math
import warnings

import torch

from ember import _switches
from ember.vae._stream import (StreamDecoder, env_switch, is_causal_conv, progress_bar, tile_starts,
                               to_channels_last)

SUPPORTED = ("AutoencoderKLWan", "AutoencoderKLQwenImage")
# Auto tiling: at most this many bytes of conv history (2 frames per causal conv) per tile. 1 GB
# keeps Wan2.2 at 704x1280 in 2x2 tiles; a smaller share of it where that is nearly free (auto_tile).
AUTO_HISTORY_BYTES = 1.0e9
AUTO_OVERLAP_LATENT = 4  # latent pixels of overlap between auto tiles
AUTO_MAX_EXTRA_WORK = 0.10  # smaller auto tiles when they decode at most 10% more latent pixels
GRAPH_FROM_FRAME = 2  # latent frame from which a tile's steps replay a CUDA graph (_SteadySteps)
GRAPH_MIN_FRAMES = 4  # fewer latent frames: at most one replay, not worth a capture


# ----------------------------------------------------------------------------- the VAE
class VaeSpec:
    """What decode needs to know about a supported VAE, read from the module itself."""

    def __init__(self, vae):
        name = type(vae).__name__
        if name not in SUPPORTED or not hasattr(vae, "decoder") or not hasattr(vae, "post_quant_conv"):
            raise TypeError(f"vae: expected a diffusers {' or '.join(SUPPORTED)}, got {name}")
        self.vae = vae
        self.z_dim = vae.post_quant_conv.in_channels
        self.patch = getattr(vae.config, "patch_size", None) or 1
        self.comp = int(vae.spatial_compression_ratio)  # latent px -> sample px
        self.comp_out = self.comp // self.patch  # latent px -> decoder output px
        dec = vae.decoder
        self.time_up = 2 ** sum(1 for m in dec.modules() if getattr(m, "mode", None) == "upsample3d")
        p = next(vae.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.radius = _receptive_radius(dec)

    def frames(self, latent_frames: int) -> int:
        return 1 + self.time_up * (latent_frames - 1)


def _receptive_radius(dec) -> float:
    """Spatial receptive radius of the decoder in latent pixels (each kxk conv adds (k-1)/2 at its scale)."""
    radius, scale = 0.0, 1
    for m in dec.modules():
        if isinstance(m, torch.nn.Upsample):  # the Conv2d after it runs at the doubled scale
            scale *= 2
        elif is_causal_conv(m) or isinstance(m, torch.nn.Conv2d):
            radius += (m.kernel_size[-1] - 1) / 2 / scale
    return radius


def _history_bytes_per_latent_px(dec, elem: int) -> float:
    """Bytes of conv history (2 frames per causal conv) per latent pixel of a tile."""
    total, scale = 0.0, 1
    for m in dec.modules():
        if isinstance(m, torch.nn.Upsample):
            scale *= 2
        elif is_causal_conv(m) and m._padding[4] > 0:
            total += m._padding[4] * m.in_channels * elem * scale * scale
    return total


# ----------------------------------------------------------------------------- validation
def _pair(name: str, v) -> tuple[int, int]:
    if isinstance(v, bool) or not isinstance(v, (int, tuple, list)):
        raise TypeError(f"{name}: expected an int or an (height, width) pair of ints, got {type(v).__name__}")
    pair = (v, v) if isinstance(v, int) else tuple(v)
    if len(pair) != 2 or any(isinstance(p, bool) or not isinstance(p, int) for p in pair):
        raise TypeError(f"{name}: expected an int or an (height, width) pair of ints, got {v!r}")
    return pair


def check_video_tensor(name: str, t, channels: int, channels_note: str = "") -> None:
    """A torch.Tensor [batch, channels, frames, height, width] (the checks encode and decode share)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 5:
        raise ValueError(f"{name}: expected a 5-d tensor [batch, {channels}, frames, height, width], "
                         f"got shape {tuple(t.shape)}")
    if t.shape[1] != channels:
        raise ValueError(f"{name}: expected {channels} channels{channels_note} in dim 1, got shape {tuple(t.shape)}")


def check_on_vae(name: str, t: torch.Tensor, spec) -> None:
    """``t`` has the VAE's dtype and device."""
    if t.dtype != spec.dtype:
        raise TypeError(f"{name}: expected dtype {spec.dtype} (the VAE's), got {t.dtype}")
    if t.device != spec.device:
        raise ValueError(f"{name}: expected device {spec.device} (the VAE's), got {t.device}")


def _validate_latents(spec: VaeSpec, z) -> None:
    check_video_tensor("latents", z, spec.z_dim, " (the VAE's z_dim)")
    if z.shape[2] < 1:
        raise ValueError(f"latents: expected at least 1 latent frame (a video of 1 + "
                         f"{spec.time_up}k frames decodes from k + 1), got {z.shape[2]}")
    if z.shape[0] < 1 or z.shape[3] < 1 or z.shape[4] < 1:
        raise ValueError(f"latents: expected non-empty batch, height and width, got shape {tuple(z.shape)}")
    check_on_vae("latents", z, spec)


def _validate_tiles(spec: VaeSpec, tile, overlap):
    """(tile_h, tile_w, overlap_h, overlap_w) in sample pixels."""
    th, tw = _pair("tile", tile)
    oh, ow = _pair("overlap", overlap if overlap is not None else (th // 4 // spec.comp * spec.comp,
                                                                  tw // 4 // spec.comp * spec.comp))
    min_tile = math.ceil(spec.radius) * spec.comp
    for name, t in (("tile", th), ("tile", tw)):
        if t % spec.comp:
            raise ValueError(f"{name}: expected a multiple of the spatial compression factor {spec.comp}, got {t}")
        if t < min_tile:
            raise ValueError(f"{name}: expected at least {min_tile} px (the decoder's receptive radius, "
                             f"{spec.radius:.1f} latent px x {spec.comp}), got {t}")
    for t, o in ((th, oh), (tw, ow)):
        if o % spec.comp:
            raise ValueError(f"overlap: expected a multiple of the spatial compression factor {spec.comp}, got {o}")
        if not 0 <= o <= t // 2:
            raise ValueError(f"overlap: expected 0 <= overlap <= tile / 2 = {t // 2}, got {o}")
    return th, tw, oh, ow


def _tiling(spec: VaeSpec, h_lat: int, w_lat: int, per_px: float, budget: float) -> tuple[int, int, int]:
    """(latent pixels decoded, tile_h, tile_w) of the cheapest tiling whose tiles keep at most
    ``budget`` bytes of conv history (tiles of the whole latent when it fits)."""
    if h_lat * w_lat * per_px <= budget:
        return h_lat * w_lat, h_lat, w_lat
    ov = AUTO_OVERLAP_LATENT
    best = None
    for nh in range(1, h_lat + 1):
        for nw in range(1, w_lat + 1):
            th = math.ceil((h_lat + (nh - 1) * ov) / nh) if nh > 1 else h_lat
            tw = math.ceil((w_lat + (nw - 1) * ov) / nw) if nw > 1 else w_lat
            if th * tw * per_px > budget or min(th, tw) < math.ceil(spec.radius):
                continue
            work = nh * nw * th * tw
            if best is None or work < best[0]:
                best = (work, th, tw)
        if best is not None and nh > 4:
            break
    if best is None:
        t = max(math.ceil(spec.radius), int(math.sqrt(budget / per_px)))
        best = (math.ceil(h_lat / t) * math.ceil(w_lat / t) * t * t, t, t)
    return best


def auto_tile(spec: VaeSpec, h_lat: int, w_lat: int):
    """Tile settings for ``tile=None``: None (untiled) or ((tile_h, tile_w), (overlap_h, overlap_w)).

    Tiles keep each tile's conv history within AUTO_HISTORY_BYTES; of the budgets AUTO_HISTORY_BYTES
    / 4, / 2 and / 1 the smallest whose tiling decodes at most AUTO_MAX_EXTRA_WORK more latent pixels
    than the full budget's wins: smaller tiles for (almost) free. Wan2.1 at 480x832 thereby decodes in
    full-height strips (1.58 -> 1.08 GB peak, same 1.7 s on the H200); Wan2.2 at 704x1280 keeps its
    2x2 tiles (its half-budget strips would decode 19% more pixels: measured 6.27 -> 6.98 s, both
    with diffusers' tile layout, before ``_Axis(trim=True)``).
    """
    per_px = _history_bytes_per_latent_px(spec.vae.decoder, torch.empty((), dtype=spec.dtype).element_size())
    full = _tiling(spec, h_lat, w_lat, per_px, AUTO_HISTORY_BYTES)
    for budget in (AUTO_HISTORY_BYTES / 4, AUTO_HISTORY_BYTES / 2):
        cand = _tiling(spec, h_lat, w_lat, per_px, budget)
        if cand[0] <= full[0] * (1 + AUTO_MAX_EXTRA_WORK):
            full = cand
            break
    _, th, tw = full
    if th >= h_lat and tw >= w_lat:
        return None
    ov, c = AUTO_OVERLAP_LATENT, spec.comp
    return (th * c, tw * c), (min(ov, th // 2) * c if th < h_lat else 0, min(ov, tw // 2) * c if tw < w_lat else 0)


def _frames_per_chunk(arg: int | None = None) -> int | None:
    """Frames the full-resolution tail of the decoder takes at once: ``arg`` (decode's
    ``frames_per_chunk``) if given, else ``EMBER_VAE_FRAME_CHUNK`` (default 0 = all of a latent
    frame's 4 at once). A memory-for-time knob, H200 bf16 (bench/results/h200/vae_frame_chunk.json,
    vae_wan2*_memory_sweep.json): 1 frame: Wan2.1 81x480x832 1.58 -> 1.16 GB but 1.67 -> 2.06 s;
    Wan2.2 121x704x1280 2.90 -> 2.22 GB, 5.83 -> 7.91 s (each 1-frame conv reads 2 frames of history
    for 1 new one, and launches quadruple). 2 frames: Wan2.1 (strips) 1.08 -> 0.90 GB, 1.74 -> 1.87 s;
    Wan2.2 2.90 -> 2.45 GB, 6.27 -> 6.84 s (Wan2.2 figures with diffusers' tile layout, 9 tiles)."""
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, int) or arg < 1:
            raise ValueError(f"frames_per_chunk: expected None or a positive integer, got {arg!r}")
        return arg
    return _switches.get("EMBER_VAE_FRAME_CHUNK") or None


# ----------------------------------------------------------------------------- tiling
class _Axis:
    """Tile origins and sizes along one axis, in latent and decoder-output pixels (diffusers' rules).

    diffusers starts a tile at every multiple of the stride below the latent size, even past a tile
    that already reaches the end: with 44 latent rows, 24-row tiles and stride 20 it decodes rows
    0-24, 20-44 and 40-44, a 4-row tile (little context, and a whole decoder pass of small, slow
    convolutions) inside the second one, which then keeps only its first 20 rows. ``trim`` (auto
    tiles) stops at the first tile that reaches the end and lets it keep every remaining row: 2 tiles
    there. Without ``trim`` (explicit tile settings) the layout is diffusers', so equal settings give
    its result.
    """

    def __init__(self, n_lat: int, tile_s: int, overlap_s: int, spec: VaeSpec, tiled: bool, trim: bool = False):
        self.comp_out = spec.comp_out
        if not tiled:
            self.starts, self.tile_lat, self.stride_o, self.blend_o = [0], n_lat, n_lat * spec.comp_out, 0
            return
        stride_s = tile_s - overlap_s
        self.tile_lat, stride_lat = tile_s // spec.comp, stride_s // spec.comp
        self.stride_o = stride_s // spec.patch
        self.blend_o = tile_s // spec.patch - self.stride_o
        self.starts = tile_starts(n_lat, self.tile_lat, stride_lat, trim)

    def keep_o(self, index: int) -> int:
        """Decoder-output rows (columns) tile ``index`` contributes from its start: the stride, the
        last tile all of its own (the caller clips them at the output's edge; in diffusers' layout
        that leaves at most the stride)."""
        return self.stride_o if index < len(self.starts) - 1 else self.tile_lat * self.comp_out


def _blend_weights(n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device, dtype=torch.float32) / n


def _unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """diffusers' unpatchify: channel (c, col offset q, row offset r) -> pixel (row*p + r, col*p + q)."""
    if p == 1:
        return x
    b, cpp, f, h, w = x.shape
    c = cpp // (p * p)
    return x.view(b, c, p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2).reshape(b, c, f, h * p, w * p)


@torch.no_grad()
def decode(vae, latents: torch.Tensor, *, tile=None, overlap=None, frames_per_chunk: int | None = None,
           progress: bool = True) -> torch.Tensor:
    """Decode video latents with a diffusers AutoencoderKLWan / AutoencoderKLQwenImage, in tiles.

    ``tile`` / ``overlap`` are in sample (output) pixels, an int or an (height, width) pair, like
    diffusers' ``enable_tiling(tile_sample_min_*, tile_sample_stride_* = tile - overlap)``; with the
    same settings the output matches diffusers' decode to rounding (its 2x upsample + 3x3 convs run
    as 2x2 sub-pixel convs with summed weights: ~50-55 dB from diffusers' op order at full size in
    bf16; ``EMBER_VAE_SUBPIXEL=0`` keeps that order). ``tile=None`` picks tiles that bound memory
    (untiled when small), laid out without diffusers' redundant edge strips (``_Axis``: Wan2.2 at
    704x1280 in 4 tiles, not 9); ``tile=False`` never tiles. ``overlap=None`` is a quarter of the tile.
    ``frames_per_chunk`` (1 or 2; default all 4 of a latent frame's): the decoder's full-resolution
    layers take that many output frames at a time, less peak memory for some time (Wan2.1 at
    81x480x832 on an H200: 2 -> 0.90 instead of 1.08 GB, 1.87 instead of 1.74 s); same result.
    Returns the clamped video [B, C, 1 + 4 * (frames - 1), H, W] in the VAE's dtype. Conv weights are
    given the channels-last layout in place on first use (same parameters, same values).

    Example:
        >>> vae = AutoencoderKLWan().to("cuda", torch.bfloat16)
        >>> video = ember.vae.decode(vae, latents, tile=(384, 672), overlap=32)
        >>> small = ember.vae.decode(vae, latents, frames_per_chunk=2)  # auto tiles, less memory
    """
    spec = VaeSpec(vae)
    _validate_latents(spec, latents)
    chunk = _frames_per_chunk(frames_per_chunk)
    B, _, T, h_lat, w_lat = latents.shape
    auto = tile is None
    if auto:
        picked = auto_tile(spec, h_lat, w_lat)
        tile, overlap = picked if picked is not None else (False, None)
    if tile is False:
        tiled, th, tw, oh, ow = False, 0, 0, 0, 0
    else:
        th, tw, oh, ow = _validate_tiles(spec, tile, overlap)
        tiled = w_lat > tw // spec.comp or h_lat > th // spec.comp  # diffusers' condition
    rows = _Axis(h_lat, th, oh, spec, tiled, trim=auto)
    cols = _Axis(w_lat, tw, ow, spec, tiled, trim=auto)
    to_channels_last(vae.decoder)
    to_channels_last(vae.post_quant_conv)

    H_o, W_o = h_lat * spec.comp_out, w_lat * spec.comp_out  # decoder-output (patch) space
    F_out = spec.frames(T)
    out_channels = vae.decoder.conv_out.out_channels // (spec.patch * spec.patch)
    out = torch.empty((B, out_channels, F_out, H_o * spec.patch, W_o * spec.patch), dtype=spec.dtype,
                      device=spec.device)
    # diffusers 0.42.1 clamps to [-1, 1] everywhere except in AutoencoderKLQwenImage.tiled_decode;
    # we follow it so that equal settings give equal results.
    clamp = not (tiled and type(vae).__name__ == "AutoencoderKLQwenImage")
    stream = StreamDecoder(vae.decoder, frames_per_chunk=chunk)
    pq = vae.post_quant_conv
    graphs = _use_graphs(spec, T)
    bottom: dict[int, torch.Tensor] = {}  # column -> bottom strip of the tile above (all frames)
    bar = progress_bar(len(rows.starts) * len(cols.starts) * T, progress, "VAE decode", "tile-frames")
    try:
        for ri, i in enumerate(rows.starts):
            right = None  # right strip of the tile to the left
            for ci, j in enumerate(cols.starts):
                stream.reset()
                above = bottom.get(ci) if ri > 0 else None
                new_bottom = new_right = None
                f0 = 0
                steady = _SteadySteps(stream, pq, graphs)
                for k in range(T):
                    t = steady.step(latents[:, :, k:k + 1, i:i + rows.tile_lat, j:j + cols.tile_lat], k)
                    f1 = f0 + t.shape[2]
                    th_o, tw_o = t.shape[3], t.shape[4]
                    if above is not None:
                        be = min(above.shape[3], th_o, rows.blend_o)
                        if be > 0:
                            w = _blend_weights(be, t.device).view(1, 1, 1, be, 1)
                            a = above[:, :, f0:f1, -be:]
                            t[:, :, :, :be] = (a.float() * (1 - w) + t[:, :, :, :be].float() * w).to(t.dtype)
                    if right is not None:
                        be = min(right.shape[4], tw_o, cols.blend_o)
                        if be > 0:
                            w = _blend_weights(be, t.device).view(1, 1, 1, 1, be)
                            a = right[:, :, f0:f1, :, -be:]
                            t[:, :, :, :, :be] = (a.float() * (1 - w) + t[:, :, :, :, :be].float() * w).to(t.dtype)
                    if tiled:  # keep what the neighbours below and to the right will blend with
                        if new_bottom is None:
                            nb, nr = min(th_o, rows.blend_o), min(tw_o, cols.blend_o)
                            new_bottom = t.new_empty((B, t.shape[1], F_out, nb, tw_o))
                            new_right = t.new_empty((B, t.shape[1], F_out, th_o, nr))
                        new_bottom[:, :, f0:f1] = t[:, :, :, th_o - new_bottom.shape[3]:]
                        new_right[:, :, f0:f1] = t[:, :, :, :, tw_o - new_right.shape[4]:]
                    crop = t[:, :, :, :rows.keep_o(ri), :cols.keep_o(ci)]
                    r0, c0 = ri * rows.stride_o, ci * cols.stride_o
                    crop = crop[:, :, :, :H_o - r0, :W_o - c0]
                    p = spec.patch
                    crop = _unpatchify(crop, p)
                    out[:, :, f0:f1, r0 * p:r0 * p + crop.shape[3], c0 * p:c0 * p + crop.shape[4]] = \
                        crop.clamp(-1.0, 1.0) if clamp else crop
                    f0 = f1
                    del t, crop
                    if bar is not None:
                        bar.advance(bar.task_ids[0])
                bottom[ci] = new_bottom
                right = new_right
                steady.close()
    finally:
        if bar is not None:
            bar.stop()
        stream.reset()
    return out


def _use_graphs(spec: VaeSpec, T: int) -> bool:
    """Whether decode replays a tile's steady latent-frame step as a CUDA graph: on CUDA with at least
    GRAPH_MIN_FRAMES latent frames, unless EMBER_VAE_GRAPHS=0 (read per call)."""
    return env_switch("EMBER_VAE_GRAPHS") and spec.device.type == "cuda" and T >= GRAPH_MIN_FRAMES


class _SteadySteps:
    """One tile's latent-frame steps (post-quant conv + ``StreamDecoder.step``). From the third
    frame on every step has the same shapes and every causal conv already has its history (the
    temporal upsampler's conv starts at the second), so with ``graphs`` the third is captured in a
    CUDA graph and it and the rest are replays: the same kernels on the same buffers, without the
    host issuing each launch (several hundred a step). The graph's output is overwritten by the
    next replay: the caller consumes it first."""

    def __init__(self, stream: StreamDecoder, pq, graphs: bool):
        self.stream, self.pq, self.graphs = stream, pq, graphs
        self.graph = self.z_in = self.out = None

    def _eager(self, z: torch.Tensor, first: bool) -> torch.Tensor:
        return self.stream.step(torch.nn.functional.conv3d(z, self.pq.weight, self.pq.bias), first=first)

    def step(self, z: torch.Tensor, k: int) -> torch.Tensor:
        if not self.graphs or k < GRAPH_FROM_FRAME:
            return self._eager(z, first=(k == 0))
        if self.graph is None:
            self.z_in = z.clone()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):  # records, runs nothing: the replay below runs it
                    self.out = self._eager(self.z_in, first=False)
            except RuntimeError as e:  # a capture failure costs speed, never the result
                warnings.warn(f"ember.vae.decode: CUDA-graph capture failed, decoding eagerly ({e})")
                self.graphs = False
                return self._eager(z, first=False)
            self.graph = graph
        else:
            self.z_in.copy_(z)
        self.graph.replay()
        return self.out

    def close(self) -> None:
        """Drop the graph and hand its memory pool back to the driver: the next tile's eager steps
        allocate from the ordinary pool, and an idle cached graph pool beside it would add its size
        to the footprint (H200 Wan2.2: 4.05 -> 5.68 GB reserved before this)."""
        if self.graph is not None:
            self.graph = self.out = self.z_in = None
            torch.cuda.empty_cache()
