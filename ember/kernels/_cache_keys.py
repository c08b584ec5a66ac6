"""Triton cache keys that do not depend on which kernel a process launched first.

A kernel's on-disk cache key includes its source key (``JITFunction.cache_key``), which folds in the
constexpr globals of every ``@triton.jit`` function it calls. Triton 3.6 (beside torch 2.11 on
our H100 / H200 hosts) merges a callee's globals *before* it computes the callee's own key, so a caller
hashed before its callees misses their globals: the same kernel gets another key in a process that
launched its kernels in another order. ``Model.warmup`` compiles from a pool of threads, so the order
changed from process to process, and a warm-up over a warm cache compiled the one-launch sampler again
(H100, Qwen3-30B-A3B: 25.0 s to the first token with a warm cache, 38 s of sampler compiles summed
over threads; with the keys settled 4.0 s, every variant loaded). Triton 3.9 computes the callee's
key first (triton-lang/triton#10494 made these keys independent of the hashing order); this module
does the same for older versions.

Every kernel module ends with ``settle_cache_keys(globals())``: at import, each of its ``@triton.jit``
functions gets its key with every callee's key computed first (callees first, depth first), the key
any import or launch order then finds. Under Triton's interpreter there are no keys to settle.
"""
from __future__ import annotations

import types


def _jit_types() -> tuple[type, ...]:
    from triton.runtime import jit
    return tuple(t for t in (getattr(jit, "JITCallable", None), jit.JITFunction) if t is not None)


def _is_triton(module: str) -> bool:
    return module == "triton" or module.startswith("triton.")


def _callees(fn, jit_types) -> list:
    """The jit functions ``fn``'s body names: globals, and attributes of the modules it names
    (``helpers.f``), as Triton's dependency walk finds them."""
    names = fn.fn.__code__.co_names
    found = []
    for name in names:
        value = fn.__globals__.get(name)
        if isinstance(value, jit_types):
            found.append(value)
        elif isinstance(value, types.ModuleType) and not _is_triton(value.__name__):
            found += [v for v in (getattr(value, n, None) for n in names) if isinstance(v, jit_types)]
    return found


def _settle(fn, jit_types, seen: set[int]) -> None:
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if not hasattr(fn, "fn") or _is_triton(getattr(fn.fn, "__module__", "") or ""):
        return  # Triton's own helpers (tl.*) are not part of a kernel's key
    for callee in _callees(fn, jit_types):
        _settle(callee, jit_types, seen)
    fn.cache_key  # computed now, with every callee's key (and globals) already there


def settle_cache_keys(namespace: dict) -> int:
    """Compute the cache key of every ``@triton.jit`` function in ``namespace`` (a kernel module's
    ``globals()``), callees first; returns how many functions were visited (0 under the interpreter).

    Example:
        >>> settle_cache_keys(globals())   # the last line of a kernel module
    """
    jit_types = _jit_types()
    seen: set[int] = set()
    for value in list(namespace.values()):
        if isinstance(value, jit_types):
            _settle(value, jit_types, seen)
    return len(seen)
