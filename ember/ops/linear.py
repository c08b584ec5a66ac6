"""Dense linear layer ``y = x @ weight.T + bias`` (what ``torch.nn.functional.linear`` computes).

Batch-1 decode makes every projection a GEMV (one row of x), a pure stream of weight bytes; there
ember runs its own one-launch Triton GEMV (``ember.kernels.gemv``). Batched decode (2..16 rows, bf16 /
fp16, CUDA) takes a few-row tensor-core kernel for the weight shapes measured faster than cuBLAS
(``ember.kernels.fp8.FEW_ROWS_MEASURED``). Every other case (more rows, a weight without unit stride
along K, non-CUDA tensors) calls ``F.linear``: a real GEMM is cuBLAS's job, and on CPU this keeps
results bit-identical to the stock layer (the model oracle tests compare greedy tokens with
transformers).

The reference, :func:`linear_reference`, is the executable spec: ``F.linear`` on fp32 copies of the
operands, rounded once to the input dtype (fp32 accumulation, one rounding). For fp32 inputs it is
exactly ``F.linear``; for bf16/fp16 ``F.linear`` on CUDA (cuBLAS) also accumulates in fp32, so the
two agree to within one rounding of the output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember import _dispatch
from ember.ops import _checks
from ember.ops import norm as norm_ops


def _validate(x, weight, bias) -> None:
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    _checks.tensor("weight", weight, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    if weight.dtype != x.dtype:
        _checks.same_dtype(x=x, weight=weight)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight: expected {x.shape[-1]} columns (x.shape[-1] = K), got shape {tuple(weight.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES, ndim=1)
        if bias.dtype != x.dtype:
            _checks.same_dtype(x=x, bias=bias)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias: expected length {weight.shape[0]} (weight.shape[0] = N), got {bias.shape[0]}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        _checks.same_device(x=x, weight=weight, bias=bias)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The executable spec of :func:`linear`: fp32 ``F.linear``, rounded once to ``x.dtype``."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _gemv_shape(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One row of x, a K-contiguous weight, a non-empty product and the Triton path on x's device."""
    N, K = weight.shape
    return K > 0 and N > 0 and x.numel() == K and weight.stride(1) == 1 and _dispatch.use_triton(x)


def _gemv_beats_cublas(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Off CUDA (the interpreter) always; on CUDA only where the GEMV measured faster than cuBLAS
    (``ember.kernels.gemv.beats_cublas``)."""
    N, K = weight.shape
    return x.device.type != "cuda" or _dispatch.kernels("gemv").beats_cublas(N, K, weight.element_size())


def _linear_one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if _gemv_beats_cublas(x, weight):
        return _dispatch.kernels("gemv").linear(x, weight, bias)
    return F.linear(x, weight, bias)


# Under torch.compile the whole one-row decision runs inside the custom op: dynamo cannot trace the
# lazy kernel-module import that the cuBLAS-or-GEMV table lives behind.
@torch.library.custom_op("ember::linear_one_row", mutates_args=())
def _linear_one_row_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _linear_one_row(x, weight, bias)


@_linear_one_row_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[:-1] + (weight.shape[0],))


def _few_rows_config(x: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """2..16 rows of x on CUDA, a K-contiguous bf16 / fp16 weight of a shape measured to beat cuBLAS
    there (``ember.kernels.fp8.few_rows_config``): the few-row kernel's tiles, else None."""
    N, K = weight.shape
    if (x.device.type != "cuda" or weight.dtype not in (torch.bfloat16, torch.float16) or K == 0 or N == 0
            or weight.stride(1) != 1 or not 2 <= x.numel() // K <= 16 or not _dispatch.use_triton(x)
            or _dispatch.compiling()):
        return None
    return _dispatch.kernels("fp8").few_rows_config(N, K)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with fp32 accumulation, like ``torch.nn.functional.linear``.

    ``x`` [..., K] and ``weight`` [N, K] (an ``nn.Linear`` weight) share a dtype (bf16, fp16 or fp32)
    and device; ``bias`` is [N] of the same dtype, or None. Returns [..., N] in x's dtype. A single
    row of x (batch-1 decode) on CUDA runs ember's Triton GEMV; 2..16 rows of bf16 / fp16 on CUDA
    take ember's few-row kernel for the weight shapes where it measured faster than cuBLAS (batched
    decode's projections); anything else calls ``F.linear``.

    Example:
        >>> w = torch.randn(512, 256, dtype=torch.bfloat16)
        >>> x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
        >>> y = ember.ops.linear(x, w)          # [1, 1, 512] bf16
    """
    _validate(x, weight, bias)
    if _gemv_shape(x, weight):
        if _dispatch.compiling():
            return _linear_one_row_op(x, weight, bias)
        return _linear_one_row(x, weight, bias)
    cfg = _few_rows_config(x, weight)
    if cfg is not None:
        x2 = x.reshape(-1, x.shape[-1])  # the kernel takes any strides
        y = _dispatch.kernels("fp8").few_rows_linear(x2, weight, bias, cfg)
        return y.reshape(x.shape[:-1] + (weight.shape[0],))
    return F.linear(x, weight, bias)


def add_rmsnorm_linear_reference(x, residual, norm_weight, weight, bias=None, eps: float = 1e-6):
    """The spec of :func:`add_rmsnorm_linear`: ``add_rmsnorm_reference`` then ``linear_reference``."""
    normed, new_residual = norm_ops.add_rmsnorm_reference(x, residual, norm_weight, eps)
    return linear_reference(normed, weight, bias), new_residual


def _add_norm_linear_impl(x, residual, norm_weight, weight, bias, eps):
    if _gemv_shape(x, weight) and _gemv_beats_cublas(x, weight):
        K = weight.shape[1]
        new_residual = torch.empty_like(x)
        y = _dispatch.kernels("gemv").linear(x, weight, bias, add_norm=(
            residual.reshape(K).contiguous(), norm_weight.contiguous(), eps, new_residual.view(K)))
        return y, new_residual
    normed, new_residual = norm_ops.add_rmsnorm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), new_residual


@torch.library.custom_op("ember::add_rmsnorm_linear", mutates_args=())
def _add_norm_linear_op(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, new_residual = _add_norm_linear_impl(x, residual, norm_weight, weight, bias, eps)
    return y, new_residual


@_add_norm_linear_op.register_fake
def _(x, residual, norm_weight, weight, bias, eps):
    return x.new_empty(x.shape[:-1] + (weight.shape[0],)), torch.empty_like(x)


def add_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(add_rmsnorm(x, residual, norm_weight, eps)[0], weight, bias)`` and the new residual.

    A decoder layer's pre-attention norm and its qkv projection: for one row of x on CUDA (batch-1
    decode) one GEMV launch that normalises each K slice as it multiplies it (the normalised row is
    never stored); anything else runs the two ops. Returns ``(y, new_residual)``.

    Example:
        >>> x, res, w = torch.randn(1, 64), torch.randn(1, 64), torch.randn(96, 64)
        >>> y, res = ember.ops.add_rmsnorm_linear(x, res, torch.ones(64), w)
    """
    _checks.tensor("residual", residual)
    eps = norm_ops._validate(x, residual, norm_weight, eps)
    _validate(x, weight, bias)
    if _dispatch.compiling():
        return _add_norm_linear_op(x, residual, norm_weight, weight, bias, eps)
    return _add_norm_linear_impl(x, residual, norm_weight, weight, bias, eps)


__all__ = ["add_rmsnorm_linear", "add_rmsnorm_linear_reference", "linear", "linear_reference"]
