"""Audio: exact streamed decode for neural audio codecs, and log-mel features.

``decode(model, latents_or_codes, chunk=...)`` decodes with a transformers ``DacModel`` or a
diffusers ``AutoencoderOobleck`` over chunks of latent frames, each with its exact receptive field,
so long audio decodes in bounded memory to the module's own untiled result. ``optimize(model)``
makes ``model.decode`` use it. ``log_mel`` computes Whisper-style log-mel features.

Example:
    >>> from transformers import DacModel
    >>> dac = ember.audio.optimize(DacModel.from_pretrained("descript/dac_44khz").to("cuda"))
    >>> audio = dac.decode(audio_codes=codes).audio_values
    >>> audio = ember.audio.decode(dac, codes, chunk=4096)
"""
import importlib

from ember.audio._decode import decode
from ember.audio._optimize import optimize

__all__ = ["decode", "optimize", "log_mel"]


def __getattr__(name):
    # features load on first use (and this package imports without them)
    if name == "log_mel":
        value = importlib.import_module("ember.audio.features").log_mel
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ember.audio' has no attribute {name!r}")
