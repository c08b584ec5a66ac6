"""``quantize_(model, config)``: convert a model's layers in place, one handler per (config, module) type.

A handler turns one module into its quantised replacement. ember registers
``(Fp8Config, nn.Linear) -> Fp8Linear``; other families add theirs with :func:`register_handler`
(e.g. a fused-experts module), and ``quantize_`` finds them by ``isinstance``.

Which modules convert: ``config.filter_fn(module, fqn)`` when given (it sees every module that has a
handler), else :func:`default_filter`: every ``nn.Linear`` except the output head and MoE routers
(last name component ``lm_head``, ``gate`` or ``router``: small, and accuracy-critical) and layers
whose weight is tied to an embedding.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ember.nn.fp8_linear import ACTIVATIONS, Fp8Linear

KEEP_NAMES = ("lm_head", "gate", "router")

Handler = Callable[[nn.Module, object, str], nn.Module]
_HANDLERS: dict[tuple[type, type], Handler] = {}


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """How :func:`quantize_` converts layers to FP8.

    granularity: ``"row"`` (one scale per output row), ``"block"`` (128x128, as Hugging Face
        fine-grained FP8 checkpoints) or ``"tensor"``.
    activations: ``None`` (weight-only: bf16 activations, fastest for one-row decode) or ``"dynamic"``
        (activations quantised per row / 1x128 block on each call, one more launch; fp8 tensor cores:
        on the H200, 16 rows of an 8192x8192 layer run 1.52x bf16 against 1.16x weight-only).
    filter_fn: ``filter_fn(module, fqn) -> bool`` deciding which modules convert (default: see module doc).

    Example:
        >>> ember.quantize_(model, ember.Fp8Config(granularity="block", filter_fn=lambda m, fqn: "mlp" in fqn))
    """
    granularity: str = "row"
    activations: str | None = None
    filter_fn: Callable[[nn.Module, str], bool] | None = None

    def __post_init__(self):
        if self.granularity not in ("tensor", "row", "block"):
            raise ValueError(f"granularity: expected 'tensor', 'row' or 'block', got {self.granularity!r}")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected None or 'dynamic', got {self.activations!r}")
        if self.filter_fn is not None and not callable(self.filter_fn):
            raise TypeError(f"filter_fn: expected a callable (module, fqn) -> bool, got {type(self.filter_fn).__name__}")


def register_handler(config_type: type, module_type: type) -> Callable[[Handler], Handler]:
    """Decorator: ``handler(module, config, fqn) -> replacement module`` for one (config, module) type pair.

    Example:
        >>> @register_handler(Fp8Config, MyExperts)
        ... def _(module, config, fqn):
        ...     return MyFp8Experts.from_float(module, config.granularity)
    """
    def deco(fn: Handler) -> Handler:
        _HANDLERS[(config_type, module_type)] = fn
        return fn
    return deco


def _handler_for(module: nn.Module, config) -> Handler | None:
    for klass in type(module).__mro__:
        h = _HANDLERS.get((type(config), klass))
        if h is not None:
            return h
    return None


def default_filter(module: nn.Module, fqn: str, *, tied: frozenset[int] = frozenset()) -> bool:
    """Convert ``nn.Linear`` layers except ``lm_head``/``gate``/``router`` and embedding-tied ones."""
    if not isinstance(module, nn.Linear):
        return False
    if fqn.rsplit(".", 1)[-1] in KEEP_NAMES:
        return False
    return id(module.weight) not in tied


@register_handler(Fp8Config, nn.Linear)
def _linear_to_fp8(module: nn.Linear, config: Fp8Config, fqn: str) -> nn.Module:
    return Fp8Linear.from_linear(module, granularity=config.granularity, activations=config.activations)


def quantize_(model: nn.Module, config: Fp8Config) -> nn.Module:
    """Replace ``model``'s convertible layers in place; returns ``model`` for chaining.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
        >>> ember.quantize_(model, ember.Fp8Config(granularity="row"))
        >>> type(model[0]).__name__
        'Fp8Linear'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not any(isinstance(config, ct) for ct, _ in _HANDLERS):
        raise TypeError(f"config: expected one of {sorted({ct.__name__ for ct, _ in _HANDLERS})}, "
                        f"got {type(config).__name__}")
    tied = frozenset(id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding))

    def select(module, fqn):
        if getattr(config, "filter_fn", None) is not None:
            return bool(config.filter_fn(module, fqn))
        return default_filter(module, fqn, tied=tied)

    replacements = list(_walk(model, config, select))
    with torch.no_grad():
        for fqn, module in replacements:
            new = _handler_for(module, config)(module, config, fqn)
            new.train(module.training)
            parent_name, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
    return model


def _walk(module: nn.Module, config, select, prefix: str = ""):
    """(fqn, module) for each selected module with a handler; selected modules are not descended into."""
    for name, child in module.named_children():
        fqn = f"{prefix}.{name}" if prefix else name
        if _handler_for(child, config) is not None and select(child, fqn):
            yield fqn, child
        else:
            yield from _walk(child, config, select, fqn)


__all__ = ["Fp8Config", "quantize_", "register_handler", "default_filter", "KEEP_NAMES"]
