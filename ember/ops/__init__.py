"""Public ops. Each family lives in ``ember/ops/<family>.py`` (validation, reference, registration,
dispatch) with its kernels in ``ember/kernels/<family>.py``.

Example:
    >>> import torch, ember
    >>> normed, residual = ember.ops.add_rmsnorm(torch.randn(4, 64), torch.randn(4, 64), torch.ones(64))
"""
from ember.ops.norm import add_rmsnorm, add_rmsnorm_reference, rmsnorm

__all__ = ["add_rmsnorm", "add_rmsnorm_reference", "rmsnorm"]
