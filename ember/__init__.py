"""ember: large models fast and small on the accelerator you have.

Triton kernels on NVIDIA GPUs; a pure-PyTorch reference path everywhere else. ``import ember``
never imports Triton: kernels load on first use.

Example:
    >>> import ember
    >>> ember.doctor()["families"]["norm"]["path"]
    'reference'
"""
from ember import ops
from ember.doctor import doctor

__version__ = "0.1.0"
__all__ = ["ops", "doctor", "__version__"]
