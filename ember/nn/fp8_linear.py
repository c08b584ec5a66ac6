"""``Fp8Linear``: an ``nn.Linear`` whose weight is stored in float8_e4m3fn with fp32 decode scales.

State dict (all tensors round-trip through safetensors):

* ``weight``       float8_e4m3fn [out, in]
* ``weight_scale`` fp32 decode scale (``w ~= weight.float() * weight_scale``): ``[]`` (tensor),
  ``[out, 1]`` (row) or ``[ceil(out/128), ceil(in/128)]`` (block). When loading, the Hugging Face
  fine-grained FP8 name ``weight_scale_inv`` (same meaning, despite the name) is accepted too.
* ``bias``         [out] in the module's dtype, when the layer has one.

``activations=None`` is weight-only: ``x`` stays bf16/fp16 and the kernel upcasts weight tiles in
registers (the fast decode path: every weight byte read once). ``activations="dynamic"`` quantises
``x`` per row (per 1x128 block for block weights) on every call and multiplies fp8 x fp8 on the
tensor cores (the fast path for large batches).
"""
from __future__ import annotations

import torch
from torch import nn

from ember.ops import fp8 as fp8_ops

ACTIVATIONS = (None, "dynamic")
BLOCK = fp8_ops.SCALE_BLOCK


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_shape(granularity: str, out_features: int, in_features: int) -> tuple[int, ...]:
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return (out_features, 1)
    if granularity == "block":
        return (_cdiv(out_features, BLOCK), _cdiv(in_features, BLOCK))
    raise ValueError(f"granularity: expected one of {fp8_ops.GRANULARITIES}, got {granularity!r}")


class Fp8Linear(nn.Module):
    """``y = x @ (weight * weight_scale).T + bias`` with an fp8 weight. Inference only (no gradients).

    Build one from a float layer with :meth:`from_linear`, or from an already-quantised weight (a
    Hugging Face fine-grained FP8 checkpoint) with :meth:`from_fp8`.

    Example:
        >>> lin = torch.nn.Linear(256, 512, dtype=torch.bfloat16)
        >>> f = ember.nn.Fp8Linear.from_linear(lin, granularity="row")
        >>> y = f(torch.randn(2, 7, 256, dtype=torch.bfloat16))      # [2, 7, 512] bf16
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, granularity: str = "row",
                 activations: str | None = None, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected None or 'dynamic', got {activations!r}")
        if dtype not in fp8_ops.OUT_DTYPES:
            raise TypeError(f"dtype: expected bfloat16, float16 or float32, got {dtype}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.granularity, self.activations, self.dtype = granularity, activations, dtype
        shape = _scale_shape(granularity, self.out_features, self.in_features)
        self.weight = nn.Parameter(torch.zeros(self.out_features, self.in_features, dtype=fp8_ops.FP8_DTYPE,
                                               device=device), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        self.bias = (nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_linear(cls, linear: nn.Linear, granularity: str = "row", activations: str | None = None,
                    block_size: int = BLOCK) -> "Fp8Linear":
        """Quantise ``linear.weight`` (saturating, amax scaling); bias kept in the layer's dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        if block_size != BLOCK:
            raise ValueError(f"block_size: scaled_mm uses {BLOCK}x{BLOCK} weight blocks, got {block_size}")
        w = linear.weight.detach()
        dtype = w.dtype if w.dtype in fp8_ops.OUT_DTYPES else torch.bfloat16
        q, s = fp8_ops.quantize_fp8(w, granularity, (BLOCK, BLOCK))
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, granularity=granularity,
                activations=activations, dtype=dtype, device="meta")
        m.weight = nn.Parameter(q, requires_grad=False)
        m.weight_scale = s
        if linear.bias is not None:
            m.bias = nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        return m

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None, *,
                 activations: str | None = None, dtype: torch.dtype = torch.bfloat16,
                 check: bool = True) -> "Fp8Linear":
        """Wrap an already-quantised weight without a bf16 detour (no copy of ``weight``).

        ``weight``: float8_e4m3fn [out, in]. ``weight_scale_inv``: its decode scale, as Hugging Face
        fine-grained FP8 checkpoints ship it ([ceil(out/128), ceil(in/128)]), or [out, 1] (row) or
        a single value (tensor); fp32, or bf16/fp16 (widened to fp32 exactly). ``check`` verifies the
        scales are finite and > 0 (a device sync).

        Example:
            >>> w = torch.randn(300, 200).to(torch.float8_e4m3fn)
            >>> f = ember.nn.Fp8Linear.from_fp8(w, torch.full((3, 2), 0.01))
        """
        if not isinstance(weight, torch.Tensor) or weight.dtype != fp8_ops.FP8_DTYPE or weight.dim() != 2:
            got = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise TypeError(f"weight: expected a 2-d float8_e4m3fn tensor [out, in], got {got}")
        if not isinstance(weight_scale_inv, torch.Tensor) or not weight_scale_inv.dtype.is_floating_point \
                or weight_scale_inv.dtype.itemsize < 2:
            got = weight_scale_inv.dtype if isinstance(weight_scale_inv, torch.Tensor) else type(weight_scale_inv).__name__
            raise TypeError(f"weight_scale_inv: expected an fp32 (or bf16/fp16) tensor, got {got}")
        out_f, in_f = weight.shape
        shape = tuple(weight_scale_inv.shape)
        if shape == _scale_shape("block", out_f, in_f):
            granularity = "block"
        elif shape == (out_f, 1):
            granularity = "row"
        elif weight_scale_inv.numel() == 1:
            granularity = "tensor"
        else:
            raise ValueError(f"weight_scale_inv: expected shape {list(_scale_shape('block', out_f, in_f))} "
                             f"(128x128 blocks), [{out_f}, 1] (row) or [] (tensor) for weight {list(weight.shape)}, "
                             f"got {list(shape)}")
        if weight_scale_inv.device != weight.device:
            raise ValueError(f"weight_scale_inv: expected device {weight.device} (the device of weight), "
                             f"got {weight_scale_inv.device}")
        scale = weight_scale_inv.to(torch.float32).reshape(_scale_shape(granularity, out_f, in_f))
        if check and not bool(torch.all(torch.isfinite(scale) & (scale > 0))):
            raise ValueError("weight_scale_inv: expected finite scales > 0, got non-finite or non-positive values")
        m = cls(in_f, out_f, bias=bias is not None, granularity=granularity, activations=activations,
                dtype=dtype, device="meta")
        m.weight = nn.Parameter(weight, requires_grad=False)
        m.weight_scale = scale
        if bias is not None:
            if bias.shape != (out_f,):
                raise ValueError(f"bias: expected shape [{out_f}], got {list(bias.shape)}")
            m.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return m

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Hugging Face fine-grained FP8 checkpoints name the decode scale `weight_scale_inv`.
        alias = prefix + "weight_scale_inv"
        if alias in state_dict and prefix + "weight_scale" not in state_dict:
            state_dict[prefix + "weight_scale"] = state_dict.pop(alias).to(torch.float32)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ forward
    def scale_b(self) -> torch.Tensor:
        """``weight_scale`` laid out for ``scaled_mm``'s ``b = weight.t()``."""
        return self.weight_scale if self.granularity == "tensor" else self.weight_scale.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected last dimension {self.in_features} (in_features), got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        out_dtype = x.dtype if x.dtype in fp8_ops.OUT_DTYPES else self.dtype
        # Scales were checked when the layer was built; a per-call check would sync the device.
        if self.activations == "dynamic":
            if self.granularity == "block":
                qx, sx = fp8_ops.quantize_fp8(x2, "block", (1, BLOCK))
            else:
                qx, sx = fp8_ops.quantize_fp8(x2, "row")
            y = fp8_ops.scaled_mm(qx, self.weight.t(), sx, self.scale_b(), bias=self.bias, out_dtype=out_dtype,
                                  check=False)
        else:
            y = fp8_ops.scaled_mm(x2, self.weight.t(), None, self.scale_b(), bias=self.bias, out_dtype=out_dtype,
                                  check=False)
        return y.reshape(*lead, self.out_features)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as ``dtype`` (default: the module's dtype), e.g. to compare with the original."""
        return fp8_ops.dequantize_fp8(self.weight, self.weight_scale, dtype or self.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"granularity={self.granularity!r}, activations={self.activations!r}, dtype={self.dtype}")
