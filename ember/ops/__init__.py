"""Public ops. Each family lives in ``ember/ops/<family>.py`` (validation, reference, registration,
dispatch) with its kernels in ``ember/kernels/<family>.py``. Families import on first use.

Example:
    >>> import torch, ember
    >>> normed, residual = ember.ops.add_rmsnorm(torch.randn(4, 64), torch.randn(4, 64), torch.ones(64))
"""
import importlib

# public name -> module that defines it
_FAMILY_OF = {
    "add_rmsnorm": "norm", "add_rmsnorm_reference": "norm", "rmsnorm": "norm",
    "softmax": "sampling", "log_softmax": "sampling", "argmax": "sampling", "sample": "sampling",
    "quantize_fp8": "fp8", "dequantize_fp8": "fp8", "scaled_mm": "fp8",
    "pad": "pad",
    "causal_conv1d": "conv1d",
    "gated_delta_rule": "deltanet",
    "moe_route": "moe", "moe_experts": "moe", "moe": "moe",
}
__all__ = sorted(_FAMILY_OF)


def __getattr__(name):
    family = _FAMILY_OF.get(name)
    if family is None:
        raise AttributeError(f"module 'ember.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ember.ops.{family}"), name)
    globals()[name] = value
    return value
