"""FP8 (float8_e4m3fn) quantisation and scaled matrix multiplication.

e4m3fn stores a value in one byte: max 448, no infinity, NaN = 0x7F/0xFF. ember always clamps to
+-448 before the cast (a plain cast is not guaranteed to saturate: on CUDA |x| >= 480 becomes NaN).

Scales are fp32 *decode* scales everywhere: ``x ~= q.float() * scale``, broadcast per granularity:

=============  ======================================  ==========================================
granularity    quantize_fp8 scale of x [R, C]          what it means
=============  ======================================  ==========================================
``"tensor"``   shape ``[]``                            one scale for the tensor
``"row"``      shape ``[R, 1]`` (``x.shape[:-1]+(1,)``)  one scale per row (last dim reduced)
``"block"``    ``[ceil(R/br), ceil(C/bc)]``            one per ``block_size=(br, bc)`` tile
=============  ======================================  ==========================================

``scaled_mm(a, b, scale_a, scale_b)`` computes ``(a * scale_a) @ (b * scale_b) + bias`` with fp32
accumulation. ``a`` is [M, K], ``b`` is [K, N] in any layout (the column-major ``w.t()`` of an
``nn.Linear`` weight, as ``torch._scaled_mm`` wants, is the fast one). Accepted scales:

* ``scale_a``: ``None`` (weight-only: ``a`` is bf16/fp16/fp32), ``[]``/``[1, 1]`` (tensor),
  ``[M, 1]`` (row), ``[M, ceil(K/128)]`` (1x128 activation blocks).
* ``scale_b``: ``[]``/``[1, 1]`` (tensor), ``[1, N]`` (per output column), ``[ceil(K/128),
  ceil(N/128)]`` (128x128 weight blocks, laid out like ``b``: for a Hugging Face fine-grained FP8
  weight ``w`` [N, K] with ``weight_scale_inv`` [ceil(N/128), ceil(K/128)], pass ``b = w.t()`` and
  ``scale_b = weight_scale_inv.t()``).

Any granularity of ``a`` combines with any of ``b``. Value checks on scales (finite, > 0) need a
device sync: they run unless ``check=False`` and are skipped during CUDA-graph capture.
"""
from __future__ import annotations

import torch

from ember import _dispatch
from ember.ops import _checks

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# amax is floored at this so an all-zero row/block gets a finite, positive scale (q = 0 there).
AMAX_EPS = 1e-12
SCALE_BLOCK = 128  # scaled_mm's block granularity: 128x128 weight blocks, 1x128 activation blocks
GRANULARITIES = ("tensor", "row", "block")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ============================================================================= quantize / dequantize
def _validate_quantize(x, granularity, block_size) -> tuple[int, int]:
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "row" and x.dim() < 1:
        raise ValueError(f"x: expected at least 1 dimension for granularity='row', got shape {tuple(x.shape)}")
    if granularity == "block" and x.dim() != 2:
        raise ValueError(f"x: expected a 2-d tensor for granularity='block', got shape {tuple(x.shape)}")
    try:
        br, bc = (int(v) for v in block_size)
    except (TypeError, ValueError):
        raise TypeError(f"block_size: expected a pair of ints, got {block_size!r}") from None
    if br < 1 or bc < 1:
        raise ValueError(f"block_size: expected positive sizes, got {tuple(block_size)}")
    return br, bc


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp_min(AMAX_EPS) / FP8_MAX


def _finite_abs(xf: torch.Tensor) -> torch.Tensor:
    # NaN and +-inf do not set the scale: NaN stays NaN in q, +-inf saturates to +-448.
    return torch.where(torch.isfinite(xf), xf.abs(), torch.zeros((), dtype=xf.dtype, device=xf.device))


def _expand_blocks(s: torch.Tensor, br: int, bc: int, rows: int, cols: int) -> torch.Tensor:
    """[ceil(rows/br), ceil(cols/bc)] per-block values -> [rows, cols]."""
    return s.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def quantize_fp8_reference(x: torch.Tensor, granularity: str = "tensor",
                           block_size: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The executable spec of :func:`quantize_fp8`: float32 math, plain PyTorch."""
    xf = x.float()
    ax = _finite_abs(xf)
    if granularity == "tensor":
        scale = _scale_from_amax(ax.amax() if ax.numel() else torch.zeros((), device=x.device))
        full = scale
    elif granularity == "row":
        scale = _scale_from_amax(ax.amax(dim=-1, keepdim=True) if x.shape[-1] else
                                 torch.zeros(x.shape[:-1] + (1,), device=x.device))
        full = scale
    else:
        br, bc = block_size
        R, C = x.shape
        nr, nc = _cdiv(R, br), _cdiv(C, bc)
        padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=x.device)
        padded[:R, :C] = ax
        scale = _scale_from_amax(padded.view(nr, br, nc, bc).amax(dim=(1, 3)))
        full = _expand_blocks(scale, br, bc, R, C)
    return saturating_cast(xf / full), scale


def saturating_cast(x: torch.Tensor) -> torch.Tensor:
    """Clamp to +-448, then cast to float8_e4m3fn (600 -> 448, +-inf -> +-448, NaN stays NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _fp8_kernels(t: torch.Tensor) -> bool:
    """Whether the Triton fp8 kernels run for ``t``: the Triton path, and on CUDA a GPU with
    float8_e4m3fn support in Triton (sm_89+; older GPUs take the reference)."""
    if not _dispatch.use_triton(t):
        return False
    return t.device.type != "cuda" or torch.cuda.get_device_capability(t.device) >= (8, 9)


def _quantize_impl(x, granularity, block_size):
    if x.numel() and _kernel_quantizes(x, granularity, block_size) and _fp8_kernels(x):
        _dispatch.prepare_triton()
        from ember.kernels import fp8 as kernels
        return kernels.quantize(x, granularity, block_size)
    return quantize_fp8_reference(x, granularity, block_size)


def _kernel_quantizes(x, granularity, block_size) -> bool:
    """The Triton quantiser handles per-row and 1 x bc blocks (activations); weights take the reference."""
    return granularity == "row" or (granularity == "block" and block_size[0] == 1)


@torch.library.custom_op("ember::quantize_fp8", mutates_args=())
def _quantize_op(x: torch.Tensor, granularity: str, block_rows: int, block_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_impl(x, granularity, (block_rows, block_cols))


@_quantize_op.register_fake
def _(x, granularity, block_rows, block_cols):
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    return q, x.new_empty(_quantize_scale_shape(x.shape, granularity, (block_rows, block_cols)), dtype=torch.float32)


def _quantize_scale_shape(shape, granularity, block_size) -> tuple[int, ...]:
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return tuple(shape[:-1]) + (1,)
    return (_cdiv(shape[0], block_size[0]), _cdiv(shape[1], block_size[1]))


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor",
                 block_size: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Saturating quantisation to float8_e4m3fn; returns ``(q, scale)`` with ``x ~= q.float() * scale``.

    ``scale = max(amax, 1e-12) / 448`` per group (fp32), so all-zero groups get finite scales.
    Values are clamped to +-448 before the cast (600 -> 448, never NaN); +-inf saturates; NaN stays
    NaN in ``q`` and does not affect the scale.

    Example:
        >>> q, s = ember.ops.quantize_fp8(torch.randn(4, 256), "row")   # s: [4, 1]
        >>> x = ember.ops.dequantize_fp8(q, s, torch.float32)
    """
    br, bc = _validate_quantize(x, granularity, block_size)
    if _dispatch.compiling():
        return _quantize_op(x, granularity, br, bc)
    return _quantize_impl(x, granularity, (br, bc))


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``q.float() * scale`` broadcast per granularity (inferred from ``scale``'s shape), cast to ``dtype``.

    Block scales are read as ``block_size`` tiles (the size given to :func:`quantize_fp8`). A
    composite of torch ops on every device (torch.compile fuses it; it is not on a hot path).

    Example:
        >>> q, s = ember.ops.quantize_fp8(torch.randn(300, 200), "block")
        >>> w = ember.ops.dequantize_fp8(q, s)   # bf16 [300, 200]
    """
    _checks.tensor("q", q, dtypes=(FP8_DTYPE,))
    _checks.tensor("scale", scale, dtypes=(torch.float32,))
    _checks.same_device(q=q, scale=scale)
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dtype: expected one of ({_checks._names(OUT_DTYPES)}), got {dtype}")
    qf = q.float()
    if scale.numel() == 1 and scale.dim() <= max(q.dim(), 1):
        return (qf * scale.reshape(())).to(dtype)
    if q.dim() >= 1 and scale.shape == q.shape[:-1] + (1,):
        return (qf * scale).to(dtype)
    br, bc = (int(v) for v in block_size)
    if q.dim() == 2 and tuple(scale.shape) == (_cdiv(q.shape[0], br), _cdiv(q.shape[1], bc)):
        return (qf * _expand_blocks(scale, br, bc, *q.shape)).to(dtype)
    grid = [_cdiv(q.shape[0], br), _cdiv(q.shape[1], bc)] if q.dim() == 2 else "n/a (q is not 2-d)"
    raise ValueError(f"scale: expected shape [] (tensor), {list(q.shape[:-1]) + [1]} (row) or {grid} "
                     f"({br}x{bc} blocks) for q of shape {list(q.shape)}, got {list(scale.shape)}")


# ============================================================================= scaled_mm
def _scale_kind(name: str, scale: torch.Tensor, operand: str, M: int, K: int, N: int) -> str:
    """Classify a scale as "tensor", "row" or "block" from its shape, or raise naming it."""
    _checks.tensor(name, scale, dtypes=(torch.float32,))
    kb = _cdiv(K, SCALE_BLOCK)
    shape = tuple(scale.shape)
    if scale.numel() == 1 and scale.dim() <= 2:
        return "tensor"
    if operand == "a":
        if shape == (M, 1):
            return "row"
        if shape == (M, kb):
            return "block"
        expected = f"[] or [1, 1] (tensor), [{M}, 1] (row), [{M}, {kb}] (1x{SCALE_BLOCK} blocks)"
    else:
        if shape == (1, N):
            return "row"
        if shape == (kb, _cdiv(N, SCALE_BLOCK)):
            return "block"
        expected = (f"[] or [1, 1] (tensor), [1, {N}] (per column), [{kb}, {_cdiv(N, SCALE_BLOCK)}] "
                    f"({SCALE_BLOCK}x{SCALE_BLOCK} blocks)")
    raise ValueError(f"{name}: expected shape {expected} for a [{M}, {K}] @ [{K}, {N}] product, got {list(shape)}")


def _check_scale_values(name: str, scale: torch.Tensor) -> None:
    if not bool(torch.all(torch.isfinite(scale) & (scale > 0))):
        raise ValueError(f"{name}: expected finite scales > 0, got non-finite or non-positive values "
                         "(pass check=False to skip this device sync)")


def _validate_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, check) -> tuple[str | None, str]:
    _checks.tensor("a", a, ndim=2)
    _checks.tensor("b", b, ndim=2)
    if b.dtype == torch.float8_e5m2 or a.dtype == torch.float8_e5m2:
        name = "b" if b.dtype == torch.float8_e5m2 else "a"
        raise TypeError(f"{name}: float8_e5m2 is not supported; expected float8_e4m3fn")
    _checks.tensor("b", b, dtypes=(FP8_DTYPE,))
    _checks.tensor("a", a, dtypes=(FP8_DTYPE, *_checks.FLOAT_DTYPES))
    M, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"b: expected {K} rows (a.shape[1] = K), got shape {tuple(b.shape)}")
    N = b.shape[1]
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of ({_checks._names(OUT_DTYPES)}), got {out_dtype}")
    if a.dtype == FP8_DTYPE:
        if scale_a is None:
            raise TypeError("scale_a: expected an fp32 scale tensor because a is float8_e4m3fn, got None "
                            "(scale_a=None is the weight-only mode for bf16/fp16/fp32 a)")
        kind_a = _scale_kind("scale_a", scale_a, "a", M, K, N)
    else:
        if scale_a is not None:
            raise TypeError(f"scale_a: expected None because a is {str(a.dtype).replace('torch.', '')} "
                            "(weight-only mode); quantise a to float8_e4m3fn to give it a scale")
        kind_a = None
    if scale_b is None:
        raise TypeError("scale_b: expected an fp32 scale tensor for the float8 b, got None")
    kind_b = _scale_kind("scale_b", scale_b, "b", M, K, N)
    if bias is not None:
        _checks.tensor("bias", bias, dtypes=_checks.FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != N:
            raise ValueError(f"bias: expected length {N} (b.shape[1]), got {bias.shape[0]}")
    _checks.same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    if check and not _checks.capturing() and not _dispatch.compiling():
        if scale_a is not None:
            _check_scale_values("scale_a", scale_a)
        _check_scale_values("scale_b", scale_b)
    return kind_a, kind_b


def _expand_scale_a(scale_a: torch.Tensor, kind: str, M: int, K: int) -> torch.Tensor:
    if kind == "tensor":
        return scale_a.reshape(())
    if kind == "row":
        return scale_a
    return _expand_blocks(scale_a, 1, SCALE_BLOCK, M, K)


def _expand_scale_b(scale_b: torch.Tensor, kind: str, K: int, N: int) -> torch.Tensor:
    if kind == "tensor":
        return scale_b.reshape(())
    if kind == "row":
        return scale_b
    return _expand_blocks(scale_b, SCALE_BLOCK, SCALE_BLOCK, K, N)


def _kind_of(scale: torch.Tensor | None, operand: str, M: int, K: int, N: int) -> str | None:
    return None if scale is None else _scale_kind("scale_" + operand, scale, operand, M, K, N)


def scaled_mm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor,
                        bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The executable spec of :func:`scaled_mm`: dequantise both operands in fp32, fp32 matmul, add bias."""
    M, K = a.shape
    N = b.shape[1]
    a_f = a.float()
    if scale_a is not None:
        a_f = a_f * _expand_scale_a(scale_a, _kind_of(scale_a, "a", M, K, N), M, K)
    b_f = b.float() * _expand_scale_b(scale_b, _kind_of(scale_b, "b", M, K, N), K, N)
    out = a_f @ b_f
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _scaled_mm_impl(a, b, scale_a, scale_b, bias, out_dtype):
    if not _fp8_kernels(a):
        return scaled_mm_reference(a, b, scale_a, scale_b, bias, out_dtype)
    _dispatch.prepare_triton()
    from ember.kernels import fp8 as kernels
    M, K = a.shape
    N = b.shape[1]
    return kernels.scaled_mm(a, b, scale_a, _kind_of(scale_a, "a", M, K, N), scale_b,
                             _kind_of(scale_b, "b", M, K, N), bias, out_dtype)


@torch.library.custom_op("ember::scaled_mm", mutates_args=())
def _scaled_mm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _scaled_mm_impl(a, b, scale_a, scale_b, bias, out_dtype)


@_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor, *,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              check: bool = True) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` with fp32 accumulation, returned in ``out_dtype``.

    ``a`` [M, K] is float8_e4m3fn with an fp32 ``scale_a``, or bf16/fp16/fp32 with ``scale_a=None``
    (weight-only); ``b`` [K, N] is float8_e4m3fn in any layout. The module docstring lists the scale
    shapes. Any M, K, N >= 1. ``check=False`` skips the finite/positive scale check (a device sync).

    Example:
        >>> w = torch.randn(512, 256)                              # nn.Linear weight [N, K]
        >>> qw, sw = ember.ops.quantize_fp8(w, "row")              # sw: [512, 1]
        >>> x = torch.randn(3, 256, dtype=torch.bfloat16)
        >>> y = ember.ops.scaled_mm(x, qw.t(), None, sw.t())       # weight-only, [3, 512] bf16
        >>> qx, sx = ember.ops.quantize_fp8(x, "row")
        >>> y8 = ember.ops.scaled_mm(qx, qw.t(), sx, sw.t())       # fp8 x fp8 rowwise
    """
    _validate_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, check)
    if _dispatch.compiling():
        return _scaled_mm_op(a, b, scale_a, scale_b, bias, out_dtype)
    return _scaled_mm_impl(a, b, scale_a, scale_b, bias, out_dtype)


__all__ = ["quantize_fp8", "dequantize_fp8", "scaled_mm", "quantize_fp8_reference", "scaled_mm_reference",
           "FP8_DTYPE", "FP8_MAX", "AMAX_EPS", "SCALE_BLOCK"]
