"""Padding (and cropping, with negative pads) in one kernel launch: constant, reflect, replicate, circular.

``pad(x, pad, mode, value)`` follows ``torch.nn.functional.pad(x, pad, mode=mode, value=value)``:
``pad`` lists (left, right) amounts starting from the LAST dimension, negative amounts crop. Any
rank, any dtype (bool, integers, floats, fp8, complex), any strides; ``out=`` writes into a
preallocated tensor. ``value`` is a bool, int or float, taken as F.pad takes it: converted to a
Python float, then to x's dtype (``True`` pads a bool tensor with True; an int past 2**53 rounds
as a float does; a value x's dtype cannot hold is refused, as F.pad refuses it). The result is
bitwise equal to F.pad: the kernel moves the elements' bits and fills with the bits F.pad's fill has.

The other modes take their padding from x, as F.pad does on CPU: "reflect" mirrors without repeating
the edge, "replicate" repeats the edge, "circular" wraps around. F.pad's rules apply (and are checked
here with errors that name the dim, the pad and the mode): they pad the last 1, 2 or 3 dims of an
input with one or two more dims (an optional batch dim and a channel dim); reflect needs each pad
below the dim's size; circular crops first (negative pads), then wraps at most once around what is
left; reflect and replicate refuse empty dims other than the batch dim, bool, fp8 and the wide
unsigned ints; ``value`` must be 0. The kernel is the same gather with another index map.

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
MODES = ("constant", "reflect", "replicate", "circular")  # index = the kernel's MODE
# the dtypes F.pad's reflection and replication kernels take (circular is slicing: every dtype)
_GATHER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
                  torch.float32, torch.float64, torch.complex64, torch.complex128)


# ----------------------------------------------------------------------------- validation
def _validate(x, pad, value, out, mode="constant") -> tuple[list[tuple[int, int]], list[int]]:
    """Per-dim (lo, hi) amounts, outermost dim first, and the output shape."""
    _checks.tensor("x", x)
    if not isinstance(mode, str) or mode not in MODES:
        hint = " (value is the 4th argument: pass it as value=)" if isinstance(mode, numbers.Real) else ""
        raise ValueError(f"mode: expected one of {', '.join(map(repr, MODES))}, got {mode!r}{hint}")
    if isinstance(pad, torch.Tensor) or not isinstance(pad, Sequence) or isinstance(pad, str):
        raise TypeError(f"pad: expected a sequence of ints, got {type(pad).__name__}")
    if any(isinstance(p, bool) or not isinstance(p, int) for p in pad):
        raise TypeError(f"pad: expected ints, got {[type(p).__name__ for p in pad]}")
    if len(pad) % 2:
        raise ValueError(f"pad: expected an even number of amounts ((left, right) pairs), got {len(pad)}")
    if mode != "constant":
        _validate_mode_shape(x, pad, mode)
    if len(pad) // 2 > x.dim():
        raise ValueError(f"pad: expected at most {2 * x.dim()} amounts for a {x.dim()}-d x, got {len(pad)}")
    if isinstance(value, torch.Tensor) or not isinstance(value, numbers.Real):
        raise TypeError(f"value: expected a bool, int or float, got {type(value).__name__}")
    if mode != "constant" and value != 0:
        raise ValueError(f"value: mode {mode!r} takes its padding from x; expected value 0 (or none), got {value!r}")
    amounts = [(0, 0)] * x.dim()
    for k in range(len(pad) // 2):
        amounts[x.dim() - 1 - k] = (int(pad[2 * k]), int(pad[2 * k + 1]))
    shape = [n + lo + hi for n, (lo, hi) in zip(x.shape, amounts)]
    bad = [d for d, n in enumerate(shape) if n < 0]
    if bad:
        raise ValueError(f"pad: amounts {tuple(pad)} give a negative size {shape[bad[0]]} in dim {bad[0]} "
                         f"of x with shape {tuple(x.shape)}; expected sizes >= 0")
    if mode != "constant":
        _validate_mode_amounts(x, pad, mode, amounts, shape)
    if out is not None:
        _checks.tensor("out", out)
        _checks.same_device(x=x, out=out)
        _checks.same_dtype(x=x, out=out)
        if list(out.shape) != shape:
            raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
        if out.numel() and x.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            raise ValueError("out: expected memory separate from x, got a tensor sharing x's storage")
    return amounts, shape


def _validate_mode_shape(x, pad, mode):
    n = len(pad) // 2
    if n not in (1, 2, 3) or x.dim() not in (n + 1, n + 2):
        raise ValueError(f"pad: mode {mode!r} pads the last 1, 2 or 3 dims of an input with 1 or 2 more dims "
                         f"(2 amounts for 2-d or 3-d x, 4 for 3-d or 4-d, 6 for 4-d or 5-d); got {len(pad)} "
                         f"amounts for a {x.dim()}-d x")
    if mode != "circular" and x.dtype not in _GATHER_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in _GATHER_DTYPES)
        raise TypeError(f"x: mode {mode!r} expected dtype in ({names}), as F.pad takes, got "
                        f"{str(x.dtype).replace('torch.', '')}")
    if mode != "circular":
        batch = 1 if x.dim() == n + 2 else 0  # the dims that may be empty
        empty = [d for d in range(batch, x.dim()) if x.shape[d] == 0]
        if empty:
            raise ValueError(f"x: mode {mode!r} expected non-empty dims (but the batch dim), got size 0 in dim "
                             f"{empty[0]} of shape {tuple(x.shape)}")


def _validate_mode_amounts(x, pad, mode, amounts, shape):
    padded = range(x.dim() - len(pad) // 2, x.dim())
    for d in padded:
        (lo, hi), size = amounts[d], x.shape[d]
        if mode == "reflect" and max(lo, hi) >= size:
            raise ValueError(f"pad: mode 'reflect' expected amounts below the size of dim {d} ({size}), got "
                             f"({lo}, {hi}) for x of shape {tuple(x.shape)}")
        kept = size + min(lo, 0) + min(hi, 0)  # circular crops first, then wraps once around what is left
        if mode == "circular" and max(lo, hi) > kept:
            raise ValueError(f"pad: mode 'circular' expected amounts of at most the size of dim {d} after "
                             f"cropping ({kept}), got ({lo}, {hi}) for x of shape {tuple(x.shape)}")
    if mode != "circular" and all(shape[d] == 0 for d in padded):
        raise ValueError(f"pad: mode {mode!r} expected an output with at least one non-empty padded dim, got "
                         f"shape {tuple(shape)} from amounts {tuple(pad)}")


def _source_index(i: torch.Tensor, lo: int, n: int, mode: str) -> torch.Tensor:
    """x's index along a dim for output indices ``i`` (circular: x already cropped, lo >= 0)."""
    s = i - lo
    if mode == "reflect":
        s = s.abs()
        return torch.where(s >= n, 2 * (n - 1) - s, s)
    if mode == "replicate":
        return s.clamp(0, n - 1)
    return torch.where(s < 0, s + n, torch.where(s >= n, s - n, s))


def _crop_for_circular(x, amounts):
    """Circular pads x after cropping it: the cropped view and the (non-negative) amounts left."""
    for d, (lo, hi) in enumerate(amounts):
        x = x.narrow(d, max(-lo, 0), x.shape[d] + min(lo, 0) + min(hi, 0))
    return x, [(max(lo, 0), max(hi, 0)) for lo, hi in amounts]


# ----------------------------------------------------------------------------- reference
def _gather(x, amounts, mode):
    """reflect / replicate / circular: each padded dim gathers x's elements through the mode's map."""
    if mode == "circular":
        x, amounts = _crop_for_circular(x, amounts)
    bits = _as_bits(x)  # a gather of bits: any dtype, and equal to F.pad bit for bit
    for d, (lo, hi) in enumerate(amounts):
        if lo or hi:
            i = torch.arange(x.shape[d] + lo + hi, device=x.device)
            bits = bits.index_select(d, _source_index(i, lo, x.shape[d], mode))
    return _from_bits(bits.contiguous(), x.dtype)


def pad_reference(x: torch.Tensor, pad: Sequence[int], mode: str = "constant", value: float = 0.0) -> torch.Tensor:
    """The executable spec: constant fills the output, then copies the overlap of input and output;
    the other modes gather x's elements along each padded dim through the mode's index map."""
    amounts, shape = _validate(x, pad, value, None, mode)
    if mode != "constant":
        return _gather(x, amounts, mode)
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


def _from_bits(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if _split_pairs(dtype):
        return torch.view_as_complex(b.view(torch.float64))
    return b.view(dtype)


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


def _merged_dims(xb: torch.Tensor, ob: torch.Tensor, amounts, complex_pair: bool, mode: str = "constant"):
    """(out_size, lo, in_size, x_stride, out_stride) per dim, merging dims that need no index math."""
    dims = [(o, lo, n, xs, os) for o, (lo, _), n, xs, os in
            zip(ob.shape, amounts + ([(0, 0)] if complex_pair else []), xb.shape, xb.stride(), ob.stride())]
    dims = [d for d in dims if not (d[0] == 1 and d[2] == 1 and d[1] == 0)] or [(1, 0, 1, 0, 0)]
    merged = [dims[-1]]
    for d in reversed(dims[:-1]):
        inner = merged[0]
        o_in, lo_in, n_in, xs_in, os_in = inner
        unpadded_inner = o_in == n_in and lo_in == 0
        # the other modes map indices per dim (a mirror of the merged index is not the merged mirror)
        mergeable_outer = mode == "constant" or (d[0] == d[2] and d[1] == 0)
        if unpadded_inner and mergeable_outer and n_in > 0 and d[2] > 0 and d[3] == xs_in * n_in \
                and d[4] == os_in * o_in:
            # output index o_d * n_in + o_in maps to input index (o_d - lo_d) * n_in + o_in
            merged[0] = (d[0] * n_in, d[1] * n_in, d[2] * n_in, xs_in, os_in)
        else:
            merged.insert(0, d)
    return merged


def _impl(x: torch.Tensor, amounts, shape, value: float, out: torch.Tensor | None,
          mode: str = "constant") -> torch.Tensor:
    fill = _fill_bits(x.dtype, value)  # first: a value x's dtype cannot hold is refused even for empty outputs
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if not _dispatch.use_triton(x):
        out.copy_(_reference_from_amounts(x, amounts, value, mode))
        return out
    _dispatch.prepare_triton()
    from ember.kernels import pad as k
    if _split_pairs(x.dtype) and fill != 0:
        # the pairs would need two fill values (real part, +0.0 imaginary part; -0.0 too); rare
        # enough to take the plain path
        out.copy_(_reference_from_amounts(x, amounts, value, mode))
        return out
    if mode == "circular":
        x, amounts = _crop_for_circular(x, amounts)  # the kernel wraps around the cropped view
    xb, ob = _as_bits(x), _as_bits(out)
    dims = _merged_dims(xb, ob, amounts, _split_pairs(x.dtype), mode)
    if len(dims) > k.MAX_DIMS:
        xb = xb.contiguous()  # makes every unpadded run of dims mergeable
        dims = _merged_dims(xb, ob, amounts, _split_pairs(x.dtype), mode)
    if len(dims) > k.MAX_DIMS:
        raise ValueError(f"pad: expected at most {k.MAX_DIMS} dims that need separate indexing after merging, "
                         f"got {len(dims)} for x of shape {tuple(x.shape)}")
    k.pad(xb, ob, fill, dims, mode=MODES.index(mode))
    return out


def _reference_from_amounts(x, amounts, value, mode="constant"):
    if mode != "constant":
        return _gather(x, amounts, mode)
    flat = []
    for lo, hi in reversed(amounts):
        flat += [lo, hi]
    return pad_reference(x, flat, value=value)


# ----------------------------------------------------------------------------- registration
# torch.compile sees these; eager calls go straight to _impl (no custom-op host overhead).
@torch.library.custom_op("ember::pad", mutates_args=())
def _pad_op(x: torch.Tensor, pad: list[int], mode: str, value: float) -> torch.Tensor:
    amounts, shape = _validate(x, pad, value, None, mode)
    return _impl(x, amounts, shape, value, None, mode)


@_pad_op.register_fake
def _(x, pad, mode, value):
    amounts, shape = _validate(x, pad, value, None, mode)
    return x.new_empty(shape)


@torch.library.custom_op("ember::pad_out", mutates_args=("out",))
def _pad_out_op(x: torch.Tensor, pad: list[int], mode: str, value: float, out: torch.Tensor) -> None:
    amounts, shape = _validate(x, pad, value, out, mode)
    _impl(x, amounts, shape, value, out, mode)


@_pad_out_op.register_fake
def _(x, pad, mode, value, out):
    return None


# ----------------------------------------------------------------------------- public API
def pad(x: torch.Tensor, pad: Sequence[int], mode: str = "constant", value: bool | int | float = 0.0, *,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """Padding with ``F.pad``'s convention and modes, in one kernel launch; returns the padded tensor.

    ``pad`` = (last_left, last_right, second_last_left, ...); negative amounts crop. ``mode`` is
    "constant" (any rank, dtype and strides; ``value``, a bool, int or float, converts to x's dtype
    as F.pad converts it), or "reflect", "replicate", "circular" (the last 1, 2 or 3 dims, with F.pad's
    rank, size and dtype rules; ``value`` stays 0). With ``out`` the result is written there (and
    ``out`` is returned).

    Example:
        >>> x = torch.ones(1, 2, 3, 4, 5, dtype=torch.bfloat16)
        >>> ember.ops.pad(x, (1, 1, 1, 1, 2, 0)).shape   # causal-conv style: time padded in front
        torch.Size([1, 2, 5, 6, 7])
        >>> wav = torch.randn(2, 1, 16000)
        >>> ember.ops.pad(wav, (200, 200), "reflect").shape   # STFT centring, n_fft = 400
        torch.Size([2, 1, 16400])
    """
    amounts, shape = _validate(x, pad, value, out, mode)
    value = float(value)  # as F.pad converts it
    if _dispatch.compiling():
        if out is None:
            return _pad_op(x, list(pad), mode, float(value))
        _pad_out_op(x, list(pad), mode, float(value), out)
        return out
    return _impl(x, amounts, shape, value, out, mode)
