"""``ember.vae.encode``: tiled, low-memory encode for diffusers' Wan-family video VAEs.

diffusers' encoder reads the video one frame, then chunks of 4 frames (one latent frame each),
keeping per causal Conv3d a cache of past frames. ``StreamEncoder`` does the same on the module's
own weights with the decoder's ``CausalStream`` layers (no padded copies, channels-last buffers),
plus the two encoder-only pieces, both without a padded copy:

* the stride-2 downsampling conv, which diffusers runs after ``ZeroPad2d((0, 1, 0, 1))``: its 3x3
  kernel is placed in the bottom-right corner of a zero 4x4 kernel, and the convolution padding of 1
  then reads exactly the pixels diffusers' padded copy holds (the extra top-left tap multiplies the
  implicit zero or the previous pixel by 0). 16/9 of the MACs for those three small convs;
* Wan2.2's ``AvgDown3D`` shortcut (a zero frame in front of the first chunk, then a grouped mean):
  a strided mean over the channels-last input, the zero frame entering only as its weight in the mean.

Tiles follow diffusers' ``tiled_encode`` (same tile origins, linear cross-fades of the latent
tiles, same crops), keeping one row of latent tiles instead of all of them.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ember.vae._decode import AUTO_HISTORY_BYTES, SUPPORTED, VaeSpec, _pair, check_on_vae, check_video_tensor
from ember.vae._stream import CL3, CausalStream, is_causal_conv, progress_bar, tile_starts, to_channels_last


# ----------------------------------------------------------------------------- the stream
class StreamEncoder(CausalStream):
    """Runs ``vae.encoder`` on one spatial tile, chunk by chunk (1 frame, then ``time_factor`` frames).

    Example:
        >>> s = StreamEncoder(vae.encoder)
        >>> s.reset()
        >>> parts = [s.step(x[:, :, :1])] + [s.step(x[:, :, 1 + 4 * k:5 + 4 * k]) for k in range(n)]
    """

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.enc = encoder
        self.folded: dict[int, torch.Tensor] = {}  # downsampling conv -> its 4x4 zero-padded kernel

    def fold_pad(self, conv: torch.nn.Conv2d) -> torch.Tensor:
        """The 3x3 kernel in the bottom-right of a zero 4x4 one: with padding 1 it equals pad (0, 1, 0, 1)."""
        w = self.folded.get(id(conv))
        if w is None:
            co, ci, kh, kw = conv.weight.shape
            w = conv.weight.new_zeros((co, ci, kh + 1, kw + 1)).contiguous(memory_format=torch.channels_last)
            w[:, :, 1:, 1:] = conv.weight
            self.folded[id(conv)] = w
        return w

    def downsample(self, r, x: torch.Tensor) -> torch.Tensor:
        """diffusers' ``downsample2d`` / ``downsample3d`` resample on one chunk."""
        if r.mode not in ("downsample2d", "downsample3d"):
            raise ValueError(f"vae: expected encoder resample modes downsample2d/downsample3d, got {r.mode!r}")
        B, C, T, H, W = x.shape
        x4 = x.permute(0, 2, 1, 3, 4).reshape(B * T, C, H, W)  # a view for channels-last input
        conv = r.resample[1]
        y = F.conv2d(x4, self.fold_pad(conv), conv.bias, conv.stride, 1)
        y = y.view(B, T, *y.shape[1:]).permute(0, 2, 1, 3, 4)
        if r.mode == "downsample2d":
            return y
        tc = r.time_conv  # kernel 3 over [last frame of the previous chunk | this chunk], stride 2
        hist = self.history.get(id(tc))
        if hist is None:  # diffusers' first chunk only caches its frames and passes them through
            self.history[id(tc)] = y[:, :, -1:].clone(memory_format=CL3)
            return y
        _, _, T, h, w = y.shape
        buf = torch.empty((B, C, 1 + T, h, w), dtype=y.dtype, device=y.device, memory_format=CL3)
        buf[:, :, :1].copy_(hist)
        buf[:, :, 1:].copy_(y)
        out = F.conv3d(buf, tc.weight, tc.bias, tc.stride, 0)
        hist.copy_(buf[:, :, -1:])
        return out

    @staticmethod
    def avg_down(ad, x: torch.Tensor) -> torch.Tensor:
        """diffusers' ``AvgDown3D``: zero frames in front up to a multiple of factor_t, then output channel
        o is the mean of the ``group`` consecutive entries o*group.. of (channel, t-offset, row-offset,
        col-offset) in that order. When the group is a product of trailing offsets (every Wan2.2 block),
        that is a mean over strided views of the channels-last input, no copy of it."""
        ft, fs, group = ad.factor_t, ad.factor_s, ad.group_size
        B, C, T, H, W = x.shape
        dims = (ft, fs, fs)
        split = next((m for m in range(3, -1, -1) if math.prod(dims[m:]) == group), None)
        if split is None:
            raise ValueError(f"vae: AvgDown3D with group size {group} over offsets {dims} is not supported "
                             "(expected the group to be a product of the trailing offsets)")
        pad = (-T) % ft
        Tq, Hq, Wq = (T + pad) // ft, H // fs, W // fs
        xl = x.permute(0, 2, 3, 4, 1)  # [B, T, H, W, C]
        kept = dims[:split]
        res = x.new_empty((B, Tq, Hq, Wq, C, *kept))
        reduce = tuple(range(5 + split, 8))

        def offsets(frames: torch.Tensor) -> torch.Tensor:  # [B, t, H, W, C] -> [B, t/ft', H', W', C, ft', fs, fs]
            n = frames.shape[1]
            a = min(ft, n)
            v = frames.reshape(B, n // a, a, Hq, fs, Wq, fs, C)  # a view when x is channels-last
            return v.permute(0, 1, 3, 5, 7, 2, 4, 6)

        t0 = 0
        if pad:  # the first output frame: pad zero frames, then ft - pad real ones
            head = offsets(xl[:, :ft - pad])
            if split == 0:  # the t-offset is averaged: the zero frames only count in the divisor
                res[:, :1] = head.sum(reduce) / group
            else:  # the t-offset is an output channel offset (dim 5): zero for the pad frames
                res[:, :1].narrow(5, 0, pad).zero_()
                res[:, :1].narrow(5, pad, ft - pad).copy_(head.mean(reduce) if reduce else head)
            t0 = ft - pad
        if T > t0:
            rest = offsets(xl[:, t0:])
            res[:, 1 if pad else 0:] = rest.mean(reduce) if reduce else rest
        return res.view(B, Tq, Hq, Wq, -1).permute(0, 4, 1, 2, 3)

    def down_block(self, blk, x: torch.Tensor) -> torch.Tensor:
        if hasattr(blk, "avg_shortcut"):  # Wan2.2 residual down block: x + AvgDown3D(x_in)
            x_in = x
            for r in blk.resnets:
                x = self.resblock(r, x)
            if blk.downsampler is not None:
                x = self.downsample(blk.downsampler, x)
            s = self.avg_down(blk.avg_shortcut, x_in)
            return x + s if x is x_in else x.add_(s)
        if hasattr(blk, "conv1"):
            return self.resblock(blk, x)
        if hasattr(blk, "mode"):
            return self.downsample(blk, x)
        # (diffusers 0.42.1's encoders cannot run the attention blocks attn_scales would add here either)
        raise ValueError(f"vae: expected encoder blocks with resnets or downsampling, got {type(blk).__name__}")

    @torch.no_grad()
    def step(self, x: torch.Tensor) -> torch.Tensor:
        """Encode one chunk [B, C_in, t, H, W] of (patchified) video into one latent frame [B, 2z, 1, h, w]."""
        e = self.enc
        x = self.causal(e.conv_in, x)
        for blk in e.down_blocks:
            x = self.down_block(blk, x)
        x = self.mid_block(e.mid_block, x)
        return self.causal(e.conv_out, x, norm=e.norm_out)


# ----------------------------------------------------------------------------- the VAE
class EncoderSpec:
    """What encode needs to know about a supported VAE, read from the module itself."""

    def __init__(self, vae):
        spec = VaeSpec(vae)  # raises for an unsupported module
        if not hasattr(vae, "encoder") or not hasattr(vae, "quant_conv"):
            raise TypeError(f"vae: expected a diffusers {' or '.join(SUPPORTED)} with an encoder, got one without")
        self.vae, self.patch, self.comp = vae, spec.patch, spec.comp
        self.dtype, self.device = spec.dtype, spec.device
        self.comp_in = self.comp // self.patch  # encoder-input (patchified) px per latent px
        self.channels = vae.encoder.conv_in.in_channels // (self.patch * self.patch)
        self.time_factor = 2 ** sum(1 for m in vae.encoder.modules() if getattr(m, "mode", None) == "downsample3d")

    def history_bytes_per_latent_px(self) -> float:
        """Bytes of conv history per latent pixel of a tile (2 frames per causal conv, 1 per time downsample)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        total, scale = 0.0, self.comp_in
        for m in self.vae.encoder.modules():
            if isinstance(m, torch.nn.Conv2d) and m.stride[-1] == 2:
                scale /= 2
            elif is_causal_conv(m):
                frames = m._padding[4] or (1 if m.stride[0] == 2 else 0)
                total += frames * m.in_channels * elem * scale * scale
        return total


def _validate_video(spec: EncoderSpec, x) -> None:
    check_video_tensor("video", x, spec.channels)
    F_ = x.shape[2]
    if F_ < 1 or (F_ - 1) % spec.time_factor:
        raise ValueError(f"video: expected 1 + {spec.time_factor}k frames (1, {1 + spec.time_factor}, "
                         f"{1 + 2 * spec.time_factor}, ...), got {F_}")
    if x.shape[0] < 1 or x.shape[3] < 1 or x.shape[4] < 1 or x.shape[3] % spec.comp or x.shape[4] % spec.comp:
        raise ValueError(f"video: expected a non-empty batch and height and width that are positive multiples "
                         f"of the spatial compression factor {spec.comp}, got shape {tuple(x.shape)}")
    check_on_vae("video", x, spec)


def _validate_tiles(spec: EncoderSpec, tile, overlap):
    """(tile_h, tile_w, overlap_h, overlap_w) in video pixels."""
    th, tw = _pair("tile", tile)
    c = spec.comp
    oh, ow = _pair("overlap", overlap if overlap is not None else (th // 4 // c * c, tw // 4 // c * c))
    for t in (th, tw):
        if t % c or t <= 0:
            raise ValueError(f"tile: expected a positive multiple of the spatial compression factor {c}, got {t}")
    for t, o in ((th, oh), (tw, ow)):
        if o % c:
            raise ValueError(f"overlap: expected a multiple of the spatial compression factor {c}, got {o}")
        if not 0 <= o <= t // 2:
            raise ValueError(f"overlap: expected 0 <= overlap <= tile / 2 = {t // 2}, got {o}")
    return th, tw, oh, ow


def auto_tile(spec: EncoderSpec, h_lat: int, w_lat: int):
    """None (untiled) when the whole frame's conv history fits AUTO_HISTORY_BYTES, else tiles that fit it."""
    per_px = spec.history_bytes_per_latent_px()
    if h_lat * w_lat * per_px <= AUTO_HISTORY_BYTES:
        return None
    area = max(4, int(AUTO_HISTORY_BYTES / per_px))
    th = min(h_lat, max(2, math.isqrt(area)))
    tw = min(w_lat, max(2, area // th))
    c = spec.comp
    return (th * c, tw * c), (th // 4 * c, tw // 4 * c)


# ----------------------------------------------------------------------------- tiling
def _patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """diffusers' patchify: pixel (row*p + r, col*p + q) -> channel (c, col offset q, row offset r)."""
    if p == 1:
        return x
    b, c, f, h, w = x.shape
    return x.reshape(b, c, f, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5).reshape(b, c * p * p, f, h // p, w // p)


def _blend(prev: torch.Tensor, cur: torch.Tensor, extent: int, dim: int) -> None:
    """diffusers' blend_v (dim 3) / blend_h (dim 4) in place: cur's first rows fade in from prev's last."""
    n = min(prev.shape[dim], cur.shape[dim], extent)
    if n <= 0:
        return
    shape = [1] * 5
    shape[dim] = n
    w = (torch.arange(n, device=cur.device, dtype=torch.float32) / n).view(shape)
    a, b = prev.narrow(dim, prev.shape[dim] - n, n), cur.narrow(dim, 0, n)
    b.copy_(a.float() * (1 - w) + b.float() * w)


def encode_parameters(vae, video: torch.Tensor, tile, overlap, tiled: bool, progress: bool,
                      trim: bool = False) -> torch.Tensor:
    """The posterior's parameters [B, 2z, latent frames, h, w] (what diffusers' ``_encode`` returns).

    ``tile``/``overlap`` are (height, width) video pixels, already validated; ``tiled`` is the caller's
    decision to tile (diffusers' own rule differs from the plain one for patchified VAEs); ``trim``:
    the last tile of a row / column is the first that reaches the edge and keeps all it encoded.
    """
    spec = EncoderSpec(vae)
    B, _, n_frames, H, W = video.shape
    h_lat, w_lat, c, tf = H // spec.comp, W // spec.comp, spec.comp, spec.time_factor
    T = 1 + (n_frames - 1) // tf
    if tiled:
        (th, tw), (oh, ow) = tile, overlap
        tl_h, tl_w, st_h, st_w = th // c, tw // c, (th - oh) // c, (tw - ow) // c
    else:
        tl_h, tl_w, st_h, st_w = h_lat, w_lat, h_lat, w_lat
    row_starts, col_starts = tile_starts(h_lat, tl_h, st_h, trim), tile_starts(w_lat, tl_w, st_w, trim)
    to_channels_last(vae.encoder)
    to_channels_last(vae.quant_conv)
    qc = vae.quant_conv
    out = torch.empty((B, qc.out_channels, T, h_lat, w_lat), dtype=spec.dtype, device=spec.device)
    stream = StreamEncoder(vae.encoder)
    bar = progress_bar(len(row_starts) * len(col_starts) * T, progress, "VAE encode", "tile-chunks")
    above: list[torch.Tensor] = []  # the previous row's latent tiles, blended
    try:
        for ri, i in enumerate(row_starts):
            row: list[torch.Tensor] = []
            for ci, j in enumerate(col_starts):
                stream.reset()
                rows_px, cols_px = slice(i * c, (i + tl_h) * c), slice(j * c, (j + tl_w) * c)
                lat = None
                for k in range(T):
                    f0, f1 = (0, 1) if k == 0 else (1 + tf * (k - 1), 1 + tf * k)
                    x = _patchify(video[:, :, f0:f1, rows_px, cols_px], spec.patch)
                    z = F.conv3d(stream.step(x), qc.weight, qc.bias)
                    if lat is None:
                        lat = z.new_empty((B, z.shape[1], T, z.shape[3], z.shape[4]))
                    lat[:, :, k:k + 1] = z
                    if bar is not None:
                        bar.advance(bar.task_ids[0])
                if ri > 0:
                    _blend(above[ci], lat, tl_h - st_h, 3)
                if ci > 0:
                    _blend(row[ci - 1], lat, tl_w - st_w, 4)
                row.append(lat)
                r0, c0 = ri * st_h, ci * st_w
                rh = h_lat - r0 if ri == len(row_starts) - 1 else min(st_h, h_lat - r0)
                rw = w_lat - c0 if ci == len(col_starts) - 1 else min(st_w, w_lat - c0)
                out[:, :, :, r0:r0 + rh, c0:c0 + rw] = lat[:, :, :, :rh, :rw]
            above = row
    finally:
        if bar is not None:
            bar.stop()
        stream.reset()
    return out


@torch.no_grad()
def encode(vae, video: torch.Tensor, *, tile=None, overlap=None, progress: bool = True):
    """Encode a video with a diffusers AutoencoderKLWan / AutoencoderKLQwenImage, in tiles.

    ``video`` is [B, C, 1 + 4k, H, W] in [-1, 1] with H, W multiples of the spatial compression
    factor (8; 16 for Wan2.2). ``tile`` / ``overlap`` are in video pixels, an int or an (height, width)
    pair; equal tiles give diffusers' ``tiled_encode`` result. (diffusers measures Wan2.2's encode
    tiles in patchified pixels, half of these; ``optimize`` converts.) ``tile=None`` picks tiles that
    bound memory (untiled when small); ``tile=False`` never tiles; ``overlap=None`` is a quarter tile.
    Returns what diffusers' ``vae.encode(x).latent_dist`` is: a ``DiagonalGaussianDistribution`` with
    ``.mean``, ``.logvar``, ``.std``, ``.mode()``, ``.sample(generator)`` and ``.parameters``
    [B, 2 * z_dim, 1 + k, H / comp, W / comp], in the VAE's dtype.

    Example:
        >>> posterior = ember.vae.encode(vae, video, tile=256, overlap=64)
        >>> latents = posterior.mode()
    """
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    spec = EncoderSpec(vae)
    _validate_video(spec, video)
    h_lat, w_lat = video.shape[3] // spec.comp, video.shape[4] // spec.comp
    auto = tile is None
    if auto:
        picked = auto_tile(spec, h_lat, w_lat)
        tile, overlap = picked if picked is not None else (False, None)
    if tile is False:
        h = encode_parameters(vae, video, None, None, False, progress)
    else:
        th, tw, oh, ow = _validate_tiles(spec, tile, overlap)
        tiled = video.shape[3] > th or video.shape[4] > tw
        h = encode_parameters(vae, video, (th, tw), (oh, ow), tiled, progress, trim=auto)
    return DiagonalGaussianDistribution(h)
