"""Per-device tile data: what the kernels launch with, kept out of kernel source.

Layout (one folder per device, one JSON file per kernel family)::

    ember/tuning/data/<device>/device.json     {"name": "NVIDIA H200", "capability": [9, 0]}
    ember/tuning/data/<device>/<family>.json   {"<key>": {<tile parameters>}, ...}
    ember/tuning/data/generic/<family>.json    entries for a GPU without its own folder

A kernel asks :func:`lookup` for ``(family, key)`` (the key is the family's own string, e.g. the weight
shape ``"bf16:2048x4096"``) and gets, in this order:

  1. an :func:`override` block's entry (tile sweeps);
  2. the user's cache for this GPU, written by ``ember tune <family>`` (``EMBER_TUNING_CACHE`` or
     ``~/.cache/ember/tuning/<device>/<family>.json``);
  3. the shipped entry of a folder whose ``device.json`` matches this GPU (name and compute capability);
  4. the generic entry;
  5. ``None``: the kernel's own rule (every family has one, so any shape runs on any GPU).

``EMBER_TUNING=generic`` skips 2 and 3, which is how the generic path is tested and measured on a GPU
that has measured entries. CPU tensors (the interpreter) get ``None``: kernels keep their small
interpreter tiles in code, since they exist to exercise masks and loops in CI, not for speed.

Example:
    >>> from ember import tuning
    >>> h200 = tuning.DeviceInfo("NVIDIA H200", (9, 0))
    >>> tuning.lookup("gemv", "bf16:2048x4096", h200)      # doctest: +SKIP
    {'BLOCK_N': 8, 'CHUNKS': 16, 'num_warps': 8, 'STEP_REDUCE': True}
    >>> tuning.lookup("gemv", "bf16:7x13", h200) is None     # no entry: the kernel's rule
    True
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ember import _switches

DATA_DIR = Path(__file__).parent / "data"
GENERIC = "generic"


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What tile data is keyed by: the GPU's name as CUDA reports it and its compute capability."""
    name: str
    capability: tuple[int, int]

    @property
    def slug(self) -> str:
        """A folder name for this GPU, e.g. ``sm_90-nvidia-h200``."""
        name = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        return f"sm_{self.capability[0]}{self.capability[1]}-{name}"


@functools.lru_cache(maxsize=None)
def _device_info_cached(index: int) -> DeviceInfo:
    return DeviceInfo(torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)))


def device_info(device: torch.device | DeviceInfo | None) -> DeviceInfo | None:
    """The :class:`DeviceInfo` of a CUDA device (None for CPU and other devices)."""
    if isinstance(device, DeviceInfo) or device is None:
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _device_info_cached(device.index if device.index is not None else torch.cuda.current_device())


# ----------------------------------------------------------------------------- files
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"tuning file {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"tuning file {path}: expected a JSON object of entries, got {type(data).__name__}")
    return data


@functools.lru_cache(maxsize=None)
def _shipped_devices() -> dict[str, DeviceInfo]:
    found = {}
    for folder in sorted(DATA_DIR.iterdir()) if DATA_DIR.is_dir() else ():
        meta = folder / "device.json"
        if folder.name != GENERIC and meta.is_file():
            d = _read_json(meta)
            found[folder.name] = DeviceInfo(d["name"], tuple(d["capability"]))
    return found


@functools.lru_cache(maxsize=None)
def _family_file(folder: str, family: str) -> dict:
    path = Path(folder) / f"{family}.json"
    return _read_json(path) if path.is_file() else {}


def shipped_folder(info: DeviceInfo) -> Path | None:
    """The shipped data folder measured on this GPU (same name and capability), if any."""
    for name, d in _shipped_devices().items():
        if d == info:
            return DATA_DIR / name
    return None


def cache_dir() -> Path:
    """Where ``ember tune`` writes: ``EMBER_TUNING_CACHE`` or ``~/.cache/ember/tuning``."""
    custom = _switches.get("EMBER_TUNING_CACHE")
    return Path(custom).expanduser() if custom else Path.home() / ".cache" / "ember" / "tuning"


def cache_file(info: DeviceInfo, family: str) -> Path:
    return cache_dir() / info.slug / f"{family}.json"


def _cached_entries(info: DeviceInfo, family: str) -> dict:
    path = cache_file(info, family)
    if not path.is_file():
        return {}
    return _cache_read(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _cache_read(path: str, mtime: int) -> dict:  # keyed by mtime: a new `ember tune` run is seen
    return _read_json(Path(path))


# ----------------------------------------------------------------------------- lookup
_local = threading.local()


def _override_stack() -> list[tuple[str, dict]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def lookup_with_source(family: str, key: str, device) -> tuple[dict | None, str]:
    """:func:`lookup`'s entry and where it came from: ``override``, ``cache:<path>``,
    ``shipped:<folder>``, ``generic`` or ``rule`` (no entry)."""
    for fam, entries in reversed(_override_stack()):
        if fam == family and key in entries:
            return entries[key], "override"
    info = device_info(device)
    if info is None:
        return None, "rule"
    memo_key = (family, key, info, _switches.get("EMBER_TUNING"), _switches.get("EMBER_TUNING_CACHE"))
    found = _memo.get(memo_key)
    if found is None:
        found = _memo[memo_key] = _resolve(family, key, info, memo_key[3])
    return found


# Resolved entries, per (family, key, device, mode, cache folder): a launch looks up its tile on every
# call (eager decode too), and walking the files took ~27 us a call on a CPU host. A cache file written
# by another process is seen after a restart; ``write_cache`` here clears the memo.
_memo: dict[tuple, tuple[dict | None, str]] = {}


def _resolve(family: str, key: str, info: DeviceInfo, mode: str) -> tuple[dict | None, str]:
    if mode != GENERIC:
        cached = _cached_entries(info, family)
        if key in cached:
            return cached[key], f"cache:{cache_file(info, family)}"
        folder = shipped_folder(info)
        if folder is not None:
            entries = _family_file(str(folder), family)
            if key in entries:
                return entries[key], f"shipped:{folder.name}"
    entries = _family_file(str(DATA_DIR / GENERIC), family)
    if key in entries:
        return entries[key], GENERIC
    return None, "rule"


def lookup(family: str, key: str, device) -> dict | None:
    """The tile entry for ``(family, key)`` on ``device`` (a torch device or :class:`DeviceInfo`), or
    None when the kernel should use its own rule. See the module docstring for the order."""
    return lookup_with_source(family, key, device)[0]


@contextlib.contextmanager
def override(family: str, entries: dict[str, dict]) -> Iterator[None]:
    """Use ``entries`` for ``family`` inside the block (this thread): how sweeps time a tile, and how
    a CUDA graph is captured with one (kernels read their tiles when launched)."""
    _override_stack().append((family, dict(entries)))
    try:
        yield
    finally:
        _override_stack().pop()


def write_cache(info: DeviceInfo, family: str, entries: dict[str, dict]) -> Path:
    """Merge ``entries`` into this GPU's cache file for ``family`` (what ``ember tune`` does)."""
    path = cache_file(info, family)
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**(_read_json(path) if path.is_file() else {}), **entries}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    _memo.clear()
    return path


def summary(device) -> dict:
    """What ``ember doctor`` prints: the shipped folder for this GPU (or none), the cache folder and
    the families it holds, and the ``EMBER_TUNING`` mode."""
    info = device_info(device)
    if info is None:
        return {"device": None, "mode": _switches.get("EMBER_TUNING")}
    folder = shipped_folder(info)
    cache = cache_dir() / info.slug
    return {"device": info.slug, "mode": _switches.get("EMBER_TUNING"),
            "shipped": folder.name if folder else None,
            "cache": str(cache), "cached_families": sorted(p.stem for p in cache.glob("*.json")) if cache.is_dir() else []}
