"""Video VAEs: low-memory tiled decode and encode for diffusers' Wan-family autoencoders.

``decode(vae, latents, tile=..., overlap=...)`` decodes with a diffusers ``AutoencoderKLWan``
(Wan2.1, Wan2.2) or ``AutoencoderKLQwenImage`` using its own weights, without the padded copies
diffusers makes per convolution, in tiles blended like diffusers' ``tiled_decode``.
``encode(vae, video, tile=..., overlap=...)`` does the same for the encoder and returns diffusers'
``DiagonalGaussianDistribution`` (what ``vae.encode(video).latent_dist`` is). ``optimize(vae)`` makes
``vae.decode`` and ``vae.encode`` use them. diffusers is only needed to build the VAE.

Example:
    >>> from diffusers import AutoencoderKLWan
    >>> vae = ember.vae.optimize(AutoencoderKLWan().to("cuda", torch.bfloat16))
    >>> video = vae.decode(latents).sample
    >>> latents = ember.vae.encode(vae, video).mode()
"""
from ember.vae._decode import decode
from ember.vae._encode import encode
from ember.vae._optimize import optimize

__all__ = ["decode", "encode", "optimize"]
