"""The one registry of ember's environment switches: the only module in ``ember/`` that reads
``os.environ``.

Each switch is declared once (name, type, default, allowed values, one-line doc, category) and read
with :func:`get`. A value is parsed and validated the first time it is seen; a bad value is a
``ValueError`` naming the variable, what it allows and what it got. The raw text is compared on every
read (a dict lookup), so a test's ``monkeypatch.setenv`` or a shell ``export`` between two calls is
seen without a restart. Python code that wants another value for a block uses :func:`override`
(no environment writes).

Categories:
  * ``trade-off``: a real choice a user makes (speed against precision or memory).
  * ``tuning``: which tile data the kernels read (``ember tune`` writes it).
  * ``debug``: kill switches and test hooks.

Example:
    >>> from ember import _switches
    >>> _switches.get("EMBER_PDL")
    True
    >>> with _switches.override(EMBER_PDL=False):
    ...     _switches.get("EMBER_PDL")
    False
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator

CATEGORIES = ("trade-off", "tuning", "debug")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Switch:
    """One environment switch. ``kind`` is ``bool``, ``int`` or ``str``; ``choices`` (str) or
    ``minimum`` (int) restrict the value."""
    name: str
    kind: type
    default: object
    doc: str
    category: str
    choices: tuple[str, ...] | None = None
    minimum: int | None = None

    def allowed(self) -> str:
        if self.kind is bool:
            return "0 or 1"
        if self.kind is int:
            return f"an integer >= {self.minimum}" if self.minimum is not None else "an integer"
        if self.choices:
            return " | ".join(self.choices)
        return "a non-empty string"

    def parse(self, raw: str) -> object:
        text = raw.strip()
        if self.kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
        elif self.kind is int:
            try:
                value = int(text)
            except ValueError:
                value = None
            if value is not None and (self.minimum is None or value >= self.minimum):
                return value
        elif text and (not self.choices or text in self.choices):
            return text
        raise ValueError(f"environment variable {self.name}={raw!r}: expected {self.allowed()} ({self.doc})")


REGISTRY: dict[str, Switch] = {}


def _declare(name: str, kind: type, default: object, doc: str, category: str, **kw) -> Switch:
    assert category in CATEGORIES and name not in REGISTRY
    s = REGISTRY[name] = Switch(name, kind, default, doc, category, **kw)
    return s


# ----------------------------------------------------------------------------- the switches
_declare("EMBER_FP8_MAX_IMPRECISE", int, 0,
         "K products an fp8 tensor-core MMA may sum before promoting to fp32 (0: Triton's default; a "
         "smaller interval is more precise and slower)", "trade-off", minimum=0)
_declare("EMBER_VAE_SUBPIXEL", bool, True,
         "VAE decode runs the 2x upsample + 3x3 conv as one 2x2 sub-pixel conv (faster; 0: the stock "
         "upsample-then-conv order, bitwise like diffusers at bf16)", "trade-off")
_declare("EMBER_VAE_FRAME_CHUNK", int, 0,
         "frames the VAE decoder's full-resolution tail takes at once (0: a latent frame's 4; 1 or 2 use "
         "less memory and more time)",
         "trade-off", minimum=0)
_declare("EMBER_TUNING", str, "auto",
         "tile data the kernels read: auto (this GPU's measured entries, else the generic ones) or generic "
         "(the generic entries even where measured ones exist)", "tuning", choices=("auto", "generic"))
_declare("EMBER_TUNING_CACHE", str, "",
         "folder of the tile files `ember tune` writes and the kernels read first (default: "
         "~/.cache/ember/tuning)", "tuning")
_declare("EMBER_PDL", bool, True,
         "decode kernels use programmatic dependent launch on sm_90+ (0: a kill switch for debugging)", "debug")
_declare("EMBER_VAE_GRAPHS", bool, True,
         "VAE decode replays each tile's frame loop as a CUDA graph on long videos (0: eager, for debugging)",
         "debug")
_declare("EMBER_FORCE_TRITON", bool, False,
         "run Triton kernels on CPU tensors through Triton's interpreter (how CI tests kernels)", "debug")


# ----------------------------------------------------------------------------- reading
_parsed: dict[str, tuple[str | None, object]] = {}
_local = threading.local()


def _overrides() -> list[dict[str, object]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def switch(name: str) -> Switch:
    """The declaration of ``name`` (a ``KeyError`` naming the known switches if it has none)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not an ember switch; known: {', '.join(sorted(REGISTRY))}") from None


def raw(name: str) -> str | None:
    """The environment's text for switch ``name`` (None when unset or empty)."""
    switch(name)
    text = os.environ.get(name)
    return text if text not in (None, "") else None


def get(name: str) -> object:
    """The value of switch ``name``: an active :func:`override`, else the environment (parsed once per
    distinct text), else the default. A bad value raises ``ValueError`` naming the variable."""
    for layer in reversed(_overrides()):
        if name in layer:
            return layer[name]
    s = switch(name)
    text = raw(name)
    cached = _parsed.get(name)
    if cached is not None and cached[0] == text:
        return cached[1]
    value = s.default if text is None else s.parse(text)
    _parsed[name] = (text, value)
    return value


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Give switches other values inside the block (this thread only), without touching the
    environment: how benchmarks and tests time both sides of a trade-off in one process."""
    for name, value in values.items():
        s = switch(name)
        if not isinstance(value, s.kind) or (s.kind is int and isinstance(value, bool)):
            raise TypeError(f"override {name}: expected {s.kind.__name__}, got {type(value).__name__}")
        if isinstance(value, str):
            s.parse(value)
        elif s.kind is int:
            s.parse(str(value))
    _overrides().append(dict(values))
    try:
        yield
    finally:
        _overrides().pop()


def describe() -> list[dict]:
    """Every switch with its current value, whether the environment set it, and its doc (for
    ``ember doctor``). A bad value shows as its error instead of raising."""
    rows = []
    for name, s in REGISTRY.items():
        try:
            value, error = get(name), None
        except ValueError as e:
            value, error = None, str(e)
        rows.append({"name": name, "category": s.category, "type": s.kind.__name__, "default": s.default,
                     "allowed": s.allowed(), "value": value, "set": raw(name) is not None, "error": error,
                     "doc": s.doc})
    return rows


def set_process_env(name: str, value: str) -> None:
    """Set a variable for this process and the libraries it loads (``TRITON_INTERPRET`` before the first
    ``import triton``): the one place ember writes the environment."""
    os.environ.setdefault(name, value)
