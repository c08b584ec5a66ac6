"""Host-side argument validation shared by every op (the op contract's first clause).

Each helper raises ``TypeError`` for a wrong kind of thing (dtype, type) and ``ValueError`` for a
wrong value (shape, device, range), always naming the argument, what was expected and what came.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(name: str, t, *, dtypes: Iterable[torch.dtype] | None = None, ndim: int | None = None,
           min_ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype in ({_names(dtypes)}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    return t


def same_device(**named: torch.Tensor) -> None:
    items = [(k, v) for k, v in named.items() if v is not None]
    first_name, first = items[0]
    for k, v in items[1:]:
        if v.device != first.device:
            raise ValueError(f"{k}: expected device {first.device} (the device of {first_name}), got {v.device}")


def same_dtype(**named: torch.Tensor) -> None:
    items = list(named.items())
    first_name, first = items[0]
    for k, v in items[1:]:
        if v.dtype != first.dtype:
            raise TypeError(f"{k}: expected dtype {first.dtype} (the dtype of {first_name}), got {v.dtype}")


def same_shape(**named: torch.Tensor) -> None:
    items = list(named.items())
    first_name, first = items[0]
    for k, v in items[1:]:
        if v.shape != first.shape:
            raise ValueError(f"{k}: expected shape {tuple(first.shape)} (the shape of {first_name}), got {tuple(v.shape)}; "
                             "no broadcasting")


def positive_float(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(f"{name}: expected a finite value > 0, got {v}")
    return float(v)


def capturing() -> bool:
    """True inside CUDA-graph capture or torch.compile tracing, where syncing value checks are skipped.

    The compile test comes first: dynamo cannot trace ``is_current_stream_capturing`` (it returns a
    Python bool), which broke fullgraph compiles on the GPU.
    """
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """A 2-d [rows, n] view of ``t`` over its last dim with unit stride there, for row kernels
    (copies only when no such view exists)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1]).contiguous()
