"""Public ops. Each family lives in ``ember/ops/<family>.py`` (validation, reference, registration,
dispatch) with its kernels in ``ember/kernels/<family>.py`` (Triton, imported on first launch).

The families are imported here, eagerly: two public functions share their module's name
(``ember.ops.moe``, ``ember.ops.pad``), and a lazily imported submodule would replace the function
on the package the first time anything imported the module. Importing costs no Triton.

Example:
    >>> import torch, ember
    >>> normed, residual = ember.ops.add_rmsnorm(torch.randn(4, 64), torch.randn(4, 64), torch.ones(64))
"""
from ember.ops.conv1d import causal_conv1d
from ember.ops.cross_entropy import linear_cross_entropy
from ember.ops.deltanet import gated_delta_rule
from ember.ops.fp8 import dequantize_fp8, quantize_fp8, scaled_mm
from ember.ops.linear import linear
from ember.ops.moe import (add_rmsnorm_route_hidden, moe, moe_experts,
                           moe_experts_add_scale, moe_route, moe_route_hidden)
from ember.ops.moe_train import moe_experts_train
from ember.ops.norm import add_rmsnorm, add_rmsnorm_reference, rmsnorm, rmsnorm_gated, rmsnorm_silu
from ember.ops.pad import pad
from ember.ops.sampling import argmax, log_softmax, sample, softmax
from ember.ops.snake import snake
from ember.ops.swiglu import swiglu

__all__ = [
    "add_rmsnorm", "add_rmsnorm_reference", "add_rmsnorm_route_hidden", "argmax", "causal_conv1d",
    "dequantize_fp8", "gated_delta_rule", "linear", "linear_cross_entropy", "log_softmax", "moe",
    "moe_experts", "moe_experts_add_scale", "moe_experts_train", "moe_route", "moe_route_hidden", "pad",
    "quantize_fp8", "rmsnorm",
    "rmsnorm_gated", "rmsnorm_silu", "sample", "scaled_mm", "snake", "softmax", "swiglu",
]
