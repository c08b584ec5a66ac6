"""Constant padding (and cropping, with negative pads) in one kernel launch.

``pad(x, pad, value)`` follows ``torch.nn.functional.pad(x, pad, mode="constant", value=value)``:
``pad`` lists (left, right) amounts starting from the LAST dimension, negative amounts crop. Any
rank, any dtype (bool, integers, floats, fp8, complex), any strides; ``out=`` writes into a
preallocated tensor. ``value`` is a bool, int or float, taken as F.pad takes it: converted to a
Python float, then to x's dtype (``True`` pads a bool tensor with True; an int past 2**53 rounds
as a float does; a value x's dtype cannot hold is refused, as F.pad refuses it). The result is
bitwise equal to F.pad: the kernel moves the elements' bits and fills with the bits F.pad's fill has.

Why an op of our own: F.pad on a large rank-5 tensor materialises a padded copy through a generic
path, and on some backends (Apple GPUs, rank-5, H*W >= 65536) it has silently corrupted data.
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence

import torch

from ember import _dispatch
from ember.ops import _checks

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ----------------------------------------------------------------------------- validation
def _validate(x, pad, value, out) -> tuple[list[tuple[int, int]], list[int]]:
    """Per-dim (lo, hi) amounts, outermost dim first, and the output shape."""
    _checks.tensor("x", x)
    if isinstance(pad, torch.Tensor) or not isinstance(pad, Sequence) or isinstance(pad, str):
        raise TypeError(f"pad: expected a sequence of ints, got {type(pad).__name__}")
    if any(isinstance(p, bool) or not isinstance(p, int) for p in pad):
        raise TypeError(f"pad: expected ints, got {[type(p).__name__ for p in pad]}")
    if len(pad) % 2:
        raise ValueError(f"pad: expected an even number of amounts ((left, right) pairs), got {len(pad)}")
    if len(pad) // 2 > x.dim():
        raise ValueError(f"pad: expected at most {2 * x.dim()} amounts for a {x.dim()}-d x, got {len(pad)}")
    if isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
        raise TypeError(f"value: expected a bool, int or float, got {type(value).__name__}")
    amounts = [(0, 0)] * x.dim()
    for k in range(len(pad) // 2):
        amounts[x.dim() - 1 - k] = (int(pad[2 * k]), int(pad[2 * k + 1]))
    shape = [n + lo + hi for n, (lo, hi) in zip(x.shape, amounts)]
    bad = [d for d, n in enumerate(shape) if n < 0]
    if bad:
        raise ValueError(f"pad: amounts {tuple(pad)} give a negative size {shape[bad[0]]} in dim {bad[0]} "
                         f"of x with shape {tuple(x.shape)}; expected sizes >= 0")
    if out is not None:
        _checks.tensor("out", out)
        _checks.same_device(x=x, out=out)
        _checks.same_dtype(x=x, out=out)
        if list(out.shape) != shape:
            raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
        if out.numel() and x.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            raise ValueError("out: expected memory separate from x, got a tensor sharing x's storage")
    return amounts, shape


# ----------------------------------------------------------------------------- reference
def pad_reference(x: torch.Tensor, pad: Sequence[int], value: float = 0.0) -> torch.Tensor:
    """The executable spec: fill the output, then copy the overlap of input and output."""
    amounts, shape = _validate(x, pad, value, None)
    _fill_bits(x.dtype, value)  # refuses a value x's dtype cannot hold, as F.pad does
    out = torch.empty(shape, dtype=x.dtype, device=x.device).fill_(float(value))
    src, dst = [], []
    for n, (lo, hi) in zip(x.shape, amounts):
        # input index i lands at output index i + lo; keep the i that land inside [0, n + lo + hi)
        first, last = max(0, -lo), min(n, n + hi)
        if last <= first:
            return out
        src.append(slice(first, last))
        dst.append(slice(first + lo, last + lo))
    out[tuple(dst)] = x[tuple(src)]
    return out


# ----------------------------------------------------------------------------- implementation
def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory seen as signed integers of the element's width (complex128: its float64 pairs)."""
    if t.element_size() not in _INT_OF_WIDTH:
        t = torch.view_as_real(t)
    return t.view(_INT_OF_WIDTH[t.element_size()])


def _split_pairs(dtype: torch.dtype) -> bool:
    """complex128 has no integer of its width: it travels as (real, imag) int64 pairs."""
    return torch.empty((), dtype=dtype).element_size() not in _INT_OF_WIDTH


def _fill_bits(dtype: torch.dtype, value: float) -> int:
    # keyed on repr: 0.0 == -0.0 (and hash alike) but their bits differ
    return _fill_bits_cached(dtype, repr(float(value)))


@functools.lru_cache(maxsize=256)
def _fill_bits_cached(dtype: torch.dtype, text: str) -> int:
    # cached: a CPU tensor and .item() are host time every eager call would pay. F.pad's own fill
    # of a one-element tensor: its conversion (and its overflow check) is the one used.
    try:
        fill = torch.nn.functional.pad(torch.zeros((1,), dtype=dtype), (1, 0), value=float(text))[:1]
    except RuntimeError as e:  # "value cannot be converted to type ... without overflow"
        raise ValueError(f"value: {text} does not fit in {dtype} ({e})") from None
    return int(_as_bits(fill).reshape(-1)[0].item())


def _merged_dims(xb: torch.Tensor, ob: torch.Tensor, amounts, complex_pair: bool):
    """(out_size, lo, in_size, x_stride, out_stride) per dim, merging dims that need no index math."""
    dims = [(o, lo, n, xs, os) for o, (lo, _), n, xs, os in
            zip(ob.shape, amounts + ([(0, 0)] if complex_pair else []), xb.shape, xb.stride(), ob.stride())]
    dims = [d for d in dims if not (d[0] == 1 and d[2] == 1 and d[1] == 0)] or [(1, 0, 1, 0, 0)]
    merged = [dims[-1]]
    for d in reversed(dims[:-1]):
        inner = merged[0]
        o_in, lo_in, n_in, xs_in, os_in = inner
        unpadded_inner = o_in == n_in and lo_in == 0
        if unpadded_inner and n_in > 0 and d[2] > 0 and d[3] == xs_in * n_in and d[4] == os_in * o_in:
            # output index o_d * n_in + o_in maps to input index (o_d - lo_d) * n_in + o_in
            merged[0] = (d[0] * n_in, d[1] * n_in, d[2] * n_in, xs_in, os_in)
        else:
            merged.insert(0, d)
    return merged


def _impl(x: torch.Tensor, amounts, shape, value: float, out: torch.Tensor | None) -> torch.Tensor:
    fill = _fill_bits(x.dtype, value)  # first: a value x's dtype cannot hold is refused even for empty outputs
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if not _dispatch.use_triton(x):
        out.copy_(_reference_from_amounts(x, amounts, value))
        return out
    _dispatch.prepare_triton()
    from ember.kernels import pad as k
    if _split_pairs(x.dtype) and fill != 0:
        # the pairs would need two fill values (real part, +0.0 imaginary part; -0.0 too); rare
        # enough to take the plain path
        out.copy_(_reference_from_amounts(x, amounts, value))
        return out
    xb, ob = _as_bits(x), _as_bits(out)
    dims = _merged_dims(xb, ob, amounts, _split_pairs(x.dtype))
    if len(dims) > k.MAX_DIMS:
        xb = xb.contiguous()  # makes every unpadded run of dims mergeable
        dims = _merged_dims(xb, ob, amounts, _split_pairs(x.dtype))
    if len(dims) > k.MAX_DIMS:
        raise ValueError(f"pad: expected at most {k.MAX_DIMS} dims that need separate indexing after merging, "
                         f"got {len(dims)} for x of shape {tuple(x.shape)}")
    k.pad(xb, ob, fill, dims)
    return out


def _reference_from_amounts(x, amounts, value):
    flat = []
    for lo, hi in reversed(amounts):
        flat += [lo, hi]
    return pad_reference(x, flat, value)


# ----------------------------------------------------------------------------- registration
# torch.compile sees these; eager calls go straight to _impl (no custom-op host overhead).
@torch.library.custom_op("ember::pad", mutates_args=())
def _pad_op(x: torch.Tensor, pad: list[int], value: float) -> torch.Tensor:
    amounts, shape = _validate(x, pad, value, None)
    return _impl(x, amounts, shape, value, None)


@_pad_op.register_fake
def _(x, pad, value):
    amounts, shape = _validate(x, pad, value, None)
    return x.new_empty(shape)


@torch.library.custom_op("ember::pad_out", mutates_args=("out",))
def _pad_out_op(x: torch.Tensor, pad: list[int], value: float, out: torch.Tensor) -> None:
    amounts, shape = _validate(x, pad, value, out)
    _impl(x, amounts, shape, value, out)


@_pad_out_op.register_fake
def _(x, pad, value, out):
    return None


# ----------------------------------------------------------------------------- public API
def pad(x: torch.Tensor, pad: Sequence[int], value: bool | int | float = 0.0, *,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Constant padding with ``F.pad``'s convention, in one kernel launch; returns the padded tensor.

    ``pad`` = (last_left, last_right, second_last_left, ...); negative amounts crop. ``value`` (bool,
    int or float) converts to x's dtype as F.pad converts it. Works for any rank, dtype and
    strides; with ``out`` the result is written there (and ``out`` is returned).

    Example:
        >>> x = torch.ones(1, 2, 3, 4, 5, dtype=torch.bfloat16)
        >>> ember.ops.pad(x, (1, 1, 1, 1, 2, 0)).shape   # causal-conv style: time padded in front
        torch.Size([1, 2, 5, 6, 7])
    """
    amounts, shape = _validate(x, pad, value, out)
    value = float(value)  # as F.pad converts it
    if _dispatch.compiling():
        if out is None:
            return _pad_op(x, list(pad), float(value))
        _pad_out_op(x, list(pad), float(value), out)
        return out
    return _impl(x, amounts, shape, value, out)
