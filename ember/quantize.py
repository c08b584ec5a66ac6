"""``quantize_(model, config)``: convert a model's layers in place, one handler per (config, module) type.

A handler turns one module into its quantised replacement. ember registers
``(Fp8Config, nn.Linear) -> Fp8Linear``; other families add theirs with :func:`register_handler`
(e.g. a fused-experts module), and ``quantize_`` finds them by ``isinstance``.

Which modules convert: ``config.filter_fn(module, fqn)`` when given (it sees every module that has a
handler), else :func:`default_filter`: every ``nn.Linear`` except the output head and MoE routers
(last name component ``lm_head``, ``gate`` or ``router``: small, and accuracy-critical) and layers
whose weight is tied to an embedding.

Nothing is skipped silently: :func:`plan` lists every module that has a handler with what
``quantize_`` does to it and why, and ``quantize_`` warns (naming the modules and the reasons) when
it converts nothing. A model that is itself a convertible layer (``quantize_(nn.Linear(7, 13), cfg)``)
cannot be replaced in place: its replacement is returned, with a warning to use the return value.
"""
from __future__ import annotations

import dataclasses
import warnings
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


@dataclasses.dataclass(frozen=True)
class Decision:
    """What :func:`quantize_` does with one module that has a handler: ``fqn`` ("" for the model
    itself), its type name, whether it converts, and why not when it does not."""
    fqn: str
    module: str
    converts: bool
    reason: str = ""


def _check_args(model, config) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not any(isinstance(config, ct) for ct, _ in _HANDLERS):
        raise TypeError(f"config: expected one of {sorted({ct.__name__ for ct, _ in _HANDLERS})}, "
                        f"got {type(config).__name__}")


def _decide(module: nn.Module, fqn: str, config, tied: frozenset[int]) -> Decision:
    kind = type(module).__name__
    if getattr(config, "filter_fn", None) is not None:
        ok = bool(config.filter_fn(module, fqn))
        return Decision(fqn, kind, ok, "" if ok else "filter_fn returned False")
    if default_filter(module, fqn, tied=tied):
        return Decision(fqn, kind, True)
    if not isinstance(module, nn.Linear):
        return Decision(fqn, kind, False, "the default filter converts nn.Linear only (pass filter_fn to select it)")
    last = fqn.rsplit(".", 1)[-1]
    if last in KEEP_NAMES:
        return Decision(fqn, kind, False, f"the default filter keeps '{last}' layers (output head, MoE router) "
                                          "in their dtype")
    return Decision(fqn, kind, False, "its weight is tied to an embedding")


def plan(model: nn.Module, config) -> list[Decision]:
    """What :func:`quantize_` would do with each module of ``model`` that has a handler for ``config``
    (a selected module's children are not visited). Nothing is changed.

    Example:
        >>> [(d.fqn, d.converts, d.reason) for d in plan(model, ember.Fp8Config()) if not d.converts]
        [('lm_head', False, "the default filter keeps 'lm_head' layers (output head, MoE router) in their dtype")]
    """
    _check_args(model, config)
    tied = frozenset(id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding))
    decisions: list[Decision] = []

    def walk(module: nn.Module, fqn: str) -> None:
        if _handler_for(module, config) is not None:
            d = _decide(module, fqn, config, tied)
            decisions.append(d)
            if d.converts:
                return
        for name, child in module.named_children():
            walk(child, f"{fqn}.{name}" if fqn else name)

    walk(model, "")
    return decisions


def quantize_(model: nn.Module, config: Fp8Config) -> nn.Module:
    """Replace ``model``'s convertible layers in place; returns ``model`` for chaining (or, when
    ``model`` is itself a convertible layer, its replacement, with a warning: it cannot change in
    place). Warns naming each skipped module and why when nothing converts; :func:`plan` lists
    every decision.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
        >>> ember.quantize_(model, ember.Fp8Config(granularity="row"))
        >>> type(model[0]).__name__
        'Fp8Linear'
    """
    decisions = plan(model, config)
    chosen = [d for d in decisions if d.converts]
    with torch.no_grad():
        if chosen and chosen[0].fqn == "":  # the model itself
            new = _handler_for(model, config)(model, config, "")
            new.train(model.training)
            warnings.warn(f"quantize_: the model is itself a {type(model).__name__}, which cannot be replaced in "
                          f"place; use the returned {type(new).__name__} (model = ember.quantize_(model, config))",
                          stacklevel=2)
            return new
        for d in chosen:
            module = model.get_submodule(d.fqn)
            new = _handler_for(module, config)(module, config, d.fqn)
            new.train(module.training)
            parent_name, _, child = d.fqn.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
    if not chosen:
        if decisions:
            shown = "; ".join(f"{d.fqn or '<model>'} ({d.module}): {d.reason}" for d in decisions[:4])
            more = f"; and {len(decisions) - 4} more" if len(decisions) > 4 else ""
            warnings.warn(f"quantize_: converted nothing; skipped {shown}{more}", stacklevel=2)
        else:
            kinds = sorted({mt.__name__ for ct, mt in _HANDLERS if isinstance(config, ct)})
            warnings.warn(f"quantize_: converted nothing; {type(model).__name__} has no module of a type "
                          f"{type(config).__name__} converts ({', '.join(kinds)})", stacklevel=2)
    return model


__all__ = ["Fp8Config", "quantize_", "plan", "Decision", "register_handler", "default_filter", "KEEP_NAMES"]
