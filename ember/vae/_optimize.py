"""``ember.vae.optimize``: make a diffusers Wan-family VAE's own ``decode`` / ``encode`` run ember's."""
from __future__ import annotations

import types

import torch

from ember.vae._stream import to_channels_last
from ember.vae._decode import _frames_per_chunk, decode
from ember.vae._encode import EncoderSpec, _validate_tiles, _validate_video, encode_parameters


def _ember_decode(self, z: torch.Tensor, return_dict: bool = True):
    """Drop-in for diffusers' ``decode``: same tiling switch and settings, ember's decoder."""
    from diffusers.models.autoencoders.vae import DecoderOutput

    if self.use_tiling:
        tile = (self.tile_sample_min_height, self.tile_sample_min_width)
        overlap = (self.tile_sample_min_height - self.tile_sample_stride_height,
                   self.tile_sample_min_width - self.tile_sample_stride_width)
    else:
        tile, overlap = False, None
    parts = z.split(1) if self.use_slicing and z.shape[0] > 1 else [z]
    out = torch.cat([decode(self, p, tile=tile, overlap=overlap, frames_per_chunk=self._ember_frames_per_chunk,
                            progress=self._ember_progress) for p in parts])
    return DecoderOutput(sample=out) if return_dict else (out,)


def _ember_encode(self, x: torch.Tensor, return_dict: bool = True):
    """Drop-in for diffusers' ``encode``: same tiling switch, settings and tile grid, ember's encoder."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.models.modeling_outputs import AutoencoderKLOutput

    spec = EncoderSpec(self)
    _validate_video(spec, x)
    # diffusers tiles when the video is larger than the tile, but measures its encode tiles in
    # patchified pixels (Wan2.2: half the video's); ember's tiles are video pixels.
    tiled = self.use_tiling and (x.shape[-1] > self.tile_sample_min_width or x.shape[-2] > self.tile_sample_min_height)
    tile = overlap = None
    if tiled:
        p = spec.patch
        th, tw, oh, ow = _validate_tiles(spec, (self.tile_sample_min_height * p, self.tile_sample_min_width * p),
                                         ((self.tile_sample_min_height - self.tile_sample_stride_height) * p,
                                          (self.tile_sample_min_width - self.tile_sample_stride_width) * p))
        tile, overlap = (th, tw), (oh, ow)
    parts = x.split(1) if self.use_slicing and x.shape[0] > 1 else [x]
    h = torch.cat([encode_parameters(self, v, tile, overlap, tiled, self._ember_progress) for v in parts])
    posterior = DiagonalGaussianDistribution(h)
    return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)


def optimize(vae, *, frames_per_chunk: int | None = None, progress: bool = True):
    """Make ``vae.decode`` / ``vae.encode`` run ``ember.vae.decode`` / ``encode``; returns the same module.

    The module's tiling switches keep working: ``vae.enable_tiling(...)`` tiles with those settings
    (the same tile grid as diffusers' ``tiled_decode`` / ``tiled_encode``), otherwise it runs untiled,
    as diffusers would; ``enable_slicing`` still splits the batch. Weights are untouched; conv weights
    take the channels-last layout. ``frames_per_chunk`` is passed on to ``ember.vae.decode``.

    Example:
        >>> vae = ember.vae.optimize(AutoencoderKLWan().to("cuda", torch.bfloat16))
        >>> vae.enable_tiling(tile_sample_min_height=384, tile_sample_stride_height=352)
        >>> video = vae.decode(latents).sample
        >>> posterior = vae.encode(video).latent_dist
    """
    EncoderSpec(vae)  # raises for an unsupported module (VaeSpec's check, and an encoder)
    if frames_per_chunk is not None:
        _frames_per_chunk(frames_per_chunk)  # validated now, not at the first decode
    to_channels_last(vae.decoder)
    to_channels_last(vae.post_quant_conv)
    to_channels_last(vae.encoder)
    to_channels_last(vae.quant_conv)
    vae._ember_progress = progress
    vae._ember_frames_per_chunk = frames_per_chunk
    vae.decode = types.MethodType(_ember_decode, vae)
    vae.encode = types.MethodType(_ember_encode, vae)
    return vae
