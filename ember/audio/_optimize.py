"""``ember.audio.optimize``: make a DacModel's / AutoencoderOobleck's own ``decode`` run ember's."""
from __future__ import annotations

import types

import torch

from ember.audio._decode import AudioSpec, _check_chunk, decode


def _dac_decode(self, quantized_representation=None, audio_codes=None, return_dict=None):
    """Drop-in for transformers' ``DacModel.decode``: codes win over the representation, as there."""
    from transformers.models.dac.modeling_dac import DacDecoderOutput

    if quantized_representation is None and audio_codes is None:
        raise ValueError("Either `quantized_representation` or `audio_codes` must be provided.")
    return_dict = return_dict if return_dict is not None else self.config.return_dict
    x = audio_codes if audio_codes is not None else quantized_representation
    audio = decode(self, x, chunk=self._ember_chunk, progress=self._ember_progress)
    return DacDecoderOutput(audio) if return_dict else (audio,)


def _oobleck_decode(self, z, return_dict: bool = True, generator=None):
    """Drop-in for diffusers' ``AutoencoderOobleck.decode``: always the untiled result (ember's
    stream is exact, so diffusers' approximate tiling switch has nothing left to do); slicing still
    splits the batch."""
    from diffusers.models.autoencoders.autoencoder_oobleck import OobleckDecoderOutput

    parts = z.split(1) if self.use_slicing and z.shape[0] > 1 else [z]
    audio = torch.cat([decode(self, p, chunk=self._ember_chunk, progress=self._ember_progress) for p in parts])
    return OobleckDecoderOutput(sample=audio) if return_dict else (audio,)


def optimize(model, *, chunk: int | None = None, progress: bool = True):
    """Make ``model.decode`` run ``ember.audio.decode``; returns the same module, weights untouched.

    DacModel: ``decode(quantized_representation=None, audio_codes=None, return_dict=None)`` as in
    transformers. AutoencoderOobleck: ``decode(z, return_dict=True)`` as in diffusers; its
    ``enable_tiling`` is ignored (the streamed result already equals the untiled one).
    ``chunk`` / ``progress`` are passed on to ``ember.audio.decode``.

    Example:
        >>> dac = ember.audio.optimize(DacModel.from_pretrained("descript/dac_44khz").cuda())
        >>> audio = dac.decode(audio_codes=codes).audio_values
    """
    spec = AudioSpec(model)  # raises for an unsupported module
    _check_chunk(chunk)
    model._ember_chunk, model._ember_progress = chunk, progress
    fn = _dac_decode if spec.kind == "dac" else _oobleck_decode
    model.decode = types.MethodType(fn, model)
    return model
