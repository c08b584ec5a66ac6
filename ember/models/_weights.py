"""Checkpoint tensors as the model files see them: :class:`TensorSource` (named tensors fetched on
demand, shape-checked against the config) and the FP8 builders the model files call (fp8 linears and
stacked fp8 experts, from a checkpoint's 128x128 block scales or quantised per row on load).

Both ``ember.loading`` and ``ember.models`` import this module; it imports neither.
"""
from __future__ import annotations

import torch

from ember.nn.fp8_linear import Fp8Linear
from ember.ops import fp8 as fp8_ops

BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TensorSource:
    """Named tensors of a checkpoint, fetched on demand and converted to the target device/dtype.

    ``get(name, shape)`` checks the shape against what the config implies and names both on a
    mismatch; ``take`` records use so the loader can report tensors the model did not consume.
    """

    def __init__(self, names: set[str], fetch, device, dtype):
        self.names, self._fetch, self.device, self.dtype = set(names), fetch, device, dtype
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.names

    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.names:
            raise missing_error([name])
        t = self._fetch(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"checkpoint tensor {name}: expected shape {tuple(shape)} from config.json, "
                             f"got {tuple(t.shape)}")
        self.used.add(name)
        return t

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = self.raw(name, shape)
        return t.to(device=self.device, dtype=dtype or self.dtype)


def missing_error(names: list[str]) -> ValueError:
    shown = ", ".join(sorted(names)[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return ValueError(f"checkpoint: missing tensor(s) the config requires: {shown}")


# ----------------------------------------------------------------------------- FP8 builders
def fp8_linear(src: TensorSource, prefix: str, out_f: int, in_f: int, bias=None):
    """Fp8Linear from a checkpoint fp8 weight + block scale, or quantised here (per row)."""
    w = src.raw(f"{prefix}.weight", (out_f, in_f))
    scale_name = f"{prefix}.weight_scale_inv"
    if src.has(scale_name):
        s = src.raw(scale_name, (_cdiv(out_f, BLOCK), _cdiv(in_f, BLOCK)))
        return Fp8Linear.from_fp8(w.to(src.device), s.to(src.device, torch.float32), bias, dtype=src.dtype)
    q, s = fp8_ops.quantize_fp8(w.to(src.device, src.dtype), "row")
    return Fp8Linear.from_fp8(q, s, bias, dtype=src.dtype, check=False)


def quantize_lm_head(net) -> None:
    """Replace ``net.lm_head`` (a Linear, possibly sharing the embedding's storage) by a row-scaled,
    weight-only Fp8Linear: what ``load(fp8_lm_head=True)`` does."""
    head = net.lm_head
    if isinstance(head, Fp8Linear):
        return
    with torch.no_grad():
        q, s = fp8_ops.quantize_fp8(head.weight, "row")
    net.lm_head = Fp8Linear.from_fp8(q, s, head.bias, dtype=head.weight.dtype, check=False)


def fp8_concat_linear(src: TensorSource, prefixes: list[str], outs: list[int], in_f: int, *, bias: bool):
    """One Fp8Linear over concatenated output rows (q,k,v or gate,up). Checkpoint block scales
    stack when every part's rows are a multiple of 128; otherwise the parts are dequantised and the
    whole weight requantised per row (one more rounding, only for odd-sized toy models)."""
    b = torch.cat([src.get(f"{p}.bias", (o,)) for p, o in zip(prefixes, outs)]) if bias else None
    parts, scales = [], []
    for p, o in zip(prefixes, outs):
        w = src.raw(f"{p}.weight", (o, in_f))
        s = src.raw(f"{p}.weight_scale_inv", (_cdiv(o, BLOCK), _cdiv(in_f, BLOCK))) \
            if src.has(f"{p}.weight_scale_inv") else None
        parts.append(w.to(src.device))
        scales.append(None if s is None else s.to(src.device, torch.float32))
    if all(s is not None for s in scales) and all(o % BLOCK == 0 for o in outs):
        return Fp8Linear.from_fp8(torch.cat(parts), torch.cat(scales), b, dtype=src.dtype)
    full = torch.cat([w.float() if s is None else fp8_ops.dequantize_fp8(w, s, torch.float32)
                      for w, s in zip(parts, scales)]).to(src.dtype)
    q, s = fp8_ops.quantize_fp8(full, "row")
    return Fp8Linear.from_fp8(q, s, b, dtype=src.dtype, check=False)


def fp8_experts(src: TensorSource, gate_up, down, gate_up_scale, down_scale):
    """Stacked expert weights -> (fp8 gate_up, fp8 down, scales) on the device for ember.ops.moe."""
    dev = src.device
    if gate_up_scale is not None:
        E, two_i, H = gate_up.shape
        gate_up, down = gate_up.to(dev), down.to(dev)
        gate_up_scale, down_scale = gate_up_scale.to(dev, torch.float32), down_scale.to(dev, torch.float32)
        if (two_i // 2) % BLOCK == 0:  # gate and up block rows stack into [E, 2I/128, H/128]
            return gate_up, down, gate_up_scale, down_scale
        I = two_i // 2
        parts = []
        for e in range(E):  # the gate and up halves each had their own partial last block
            g = fp8_ops.dequantize_fp8(gate_up[e, :I], gate_up_scale[e, : gate_up_scale.shape[1] // 2], torch.float32)
            u = fp8_ops.dequantize_fp8(gate_up[e, I:], gate_up_scale[e, gate_up_scale.shape[1] // 2:], torch.float32)
            parts.append(torch.cat([g, u]))
        q, s = fp8_ops.quantize_fp8(torch.stack(parts), "row")
        return q, down, s.squeeze(-1), down_scale
    q_gu, s_gu = fp8_ops.quantize_fp8(gate_up.to(dev, src.dtype), "row")
    q_d, s_d = fp8_ops.quantize_fp8(down.to(dev, src.dtype), "row")
    return q_gu, q_d, s_gu.squeeze(-1), s_d.squeeze(-1)
