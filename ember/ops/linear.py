"""Dense linear layer ``y = x @ weight.T + bias`` (what ``torch.nn.functional.linear`` computes).

Batch-1 decode makes every projection a GEMV (one row of x), a pure stream of weight bytes; there
ember runs its own one-launch Triton GEMV (``ember.kernels.gemv``; on CUDA for the weight shapes
where it beats cuBLAS). Batched decode (2..16 rows, bf16 / fp16, CUDA) takes a few-row tensor-core
kernel (``ember.kernels.linear``) for the weight shapes with a tuning entry for this GPU (measured
faster than cuBLAS). Every other case (more rows, a weight without unit stride
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


def _linear_one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    _dispatch.prepare_triton()
    from ember.kernels import gemv
    N, K = weight.shape
    cfg = gemv.one_row_config(N, K, weight.dtype, x.device)  # None: cuBLAS measured faster
    if cfg is None:
        return F.linear(x, weight, bias)
    return gemv.linear(x, weight, bias, config=cfg)


# Under torch.compile the whole one-row decision runs inside the custom op: dynamo cannot trace the
# lazy kernel-module import that the cuBLAS-or-GEMV choice lives behind.
@torch.library.custom_op("ember::linear_one_row", mutates_args=())
def _linear_one_row_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _linear_one_row(x, weight, bias)


@_linear_one_row_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[:-1] + (weight.shape[0],))


def _few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """2..16 rows of x on CUDA and a K-contiguous bf16 / fp16 weight with a few-row tuning entry for
    this GPU: the few-row kernel's result, else None (cuBLAS)."""
    N, K = weight.shape
    if (x.device.type != "cuda" or weight.dtype not in (torch.bfloat16, torch.float16) or K == 0 or N == 0
            or weight.stride(1) != 1 or not 2 <= x.numel() // K <= 16 or not _dispatch.use_triton(x)
            or _dispatch.compiling()):
        return None
    _dispatch.prepare_triton()
    from ember.kernels import linear as kernels
    cfg = kernels.few_rows_config(N, K, x.device)
    if cfg is None:
        return None
    y = kernels.few_rows_linear(x.reshape(-1, K), weight, bias, cfg)  # the kernel takes any strides
    return y.reshape(x.shape[:-1] + (N,))


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
    y = _few_rows(x, weight, bias)
    return F.linear(x, weight, bias) if y is None else y


__all__ = ["linear", "linear_reference"]
