"""``ember.vae.optimize``: make a diffusers Wan-family VAE's own ``decode`` run ember's decoder."""
from __future__ import annotations

import types

import torch

from ember.vae._stream import to_channels_last
from ember.vae._decode import VaeSpec, decode


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
    out = torch.cat([decode(self, p, tile=tile, overlap=overlap, progress=self._ember_progress) for p in parts])
    return DecoderOutput(sample=out) if return_dict else (out,)


def optimize(vae, *, progress: bool = True):
    """Make ``vae.decode`` run ``ember.vae.decode``; returns the same module (weights untouched).

    The module's tiling switches keep working: ``vae.enable_tiling(...)`` tiles with those settings,
    otherwise it decodes untiled, as diffusers would. Conv weights take the channels-last layout.

    Example:
        >>> vae = ember.vae.optimize(AutoencoderKLWan().to("cuda", torch.bfloat16))
        >>> vae.enable_tiling(tile_sample_min_height=384, tile_sample_stride_height=352)
        >>> video = vae.decode(latents).sample
    """
    VaeSpec(vae)  # raises for an unsupported module
    to_channels_last(vae.decoder)
    to_channels_last(vae.post_quant_conv)
    vae._ember_progress = progress
    vae.decode = types.MethodType(_ember_decode, vae)
    return vae
