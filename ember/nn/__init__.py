"""Modules built on ember's ops.

Example:
    >>> layer = ember.nn.Fp8Linear.from_linear(torch.nn.Linear(256, 512), granularity="row")
"""
from ember.nn.fp8_linear import Fp8Linear

__all__ = ["Fp8Linear"]
