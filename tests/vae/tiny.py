"""Tiny random diffusers Wan-family VAEs (Wan2.1, Wan2.2 with patchified I/O, Qwen-Image) for CPU tests."""
import torch
from diffusers import AutoencoderKLQwenImage, AutoencoderKLWan


def configs(num_res_blocks: int) -> dict:
    tiny = dict(base_dim=4, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=num_res_blocks,
                latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return {
        "wan21": (AutoencoderKLWan, tiny),
        "wan22": (AutoencoderKLWan, dict(tiny, decoder_base_dim=6, is_residual=True, in_channels=12,
                                         out_channels=12, patch_size=2, scale_factor_spatial=16)),
        "qwen": (AutoencoderKLQwenImage, tiny),
    }


def make_vae(configs: dict, name: str, dtype=torch.float32):
    cls, cfg = configs[name]
    vae = cls(**cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so every parameter matters
        for n, p in vae.named_parameters():
            if "gamma" in n:
                p.normal_(1.0, 0.2)
            elif "bias" in n:
                p.normal_(0.0, 0.1)
    return vae.to(dtype)


def set_diffusers_tiling(vae, tile=None, overlap=None):
    """diffusers' own tiling switch: off for tile=None, else tiles of `tile` px overlapping by `overlap`."""
    if tile is None:
        vae.disable_tiling()
    else:
        vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile,
                          tile_sample_stride_height=tile - overlap, tile_sample_stride_width=tile - overlap)
