"""ember: large models fast and small on the accelerator you have.

Triton kernels on NVIDIA GPUs; a pure-PyTorch reference path everywhere else. ``import ember``
never imports Triton (kernels load on first use) and imports each feature on first access.

Example:
    >>> import ember
    >>> ember.doctor()["families"]["norm"]["path"]
    'reference'
"""
import importlib

from ember import ops
from ember.doctor import doctor

__version__ = "0.1.0"

# public name -> (module, attribute); None attribute means the module itself
_LAZY = {
    "SamplingParams": ("ember.ops.sampling", "SamplingParams"),
    "Fp8Config": ("ember.quantize", "Fp8Config"),
    "quantize_": ("ember.quantize", "quantize_"),
    "load": ("ember.loading", "load"),
    "Model": ("ember.engine", "Model"),
    "nn": ("ember.nn", None),
    "vae": ("ember.vae", None),
    "audio": ("ember.audio", None),
    "train": ("ember.train", None),
    "serve": ("ember.serve", None),
}
__all__ = ["ops", "doctor", "__version__", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value
