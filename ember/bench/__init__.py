"""Benchmark suites: ``ember bench <suite>`` runs ``ember/bench/<suite>.py``.

A suite module defines ``run(ctx: BenchContext) -> list[Row]`` and times ember against the stock
baseline (torch, transformers, diffusers) in the same process. Modules whose name starts with an
underscore are helpers, not suites.

Example:
    >>> from ember.bench import run_suite
    >>> rows = run_suite("norm", quick=True)
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import pkgutil
from collections.abc import Callable, Iterator, Sequence

import torch

from ember.bench import _timing


@contextlib.contextmanager
def variant(spec: dict) -> Iterator[None]:
    """Run the block as a decode-step variant: ``{"switches": {NAME: value}, "tuning": {family: {key:
    entry}}}`` (either part optional) through ``ember._switches.override`` and ``ember.tuning.override``.
    Kernels read both when launched, so a CUDA graph captured inside the block keeps the variant.

    Example:
        >>> with variant({"switches": {"EMBER_TUNING": "generic"}}):
        ...     pass  # build and capture a model here: it runs the generic tiles
    """
    from ember import _switches, tuning
    unknown = set(spec) - {"switches", "tuning"}
    if unknown:
        raise ValueError(f"variant: unknown part(s) {sorted(unknown)}; expected 'switches' and/or 'tuning'")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_switches.override(**spec.get("switches", {})))
        for family, entries in spec.get("tuning", {}).items():
            stack.enter_context(tuning.override(family, entries))
        yield


@dataclasses.dataclass
class Row:
    """One measured figure. ``ember`` and ``baseline`` are in ``unit``; ``speedup`` > 1 means ember is
    better (baseline/ember for times, ember/baseline for rates)."""
    name: str
    unit: str
    ember: float
    baseline: float | None
    baseline_name: str
    target: str = ""
    meets: bool | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        if not self.baseline or not self.ember:
            return None
        higher_is_better = self.unit in ("GB/s", "tok/s", "TFLOP/s")
        return self.ember / self.baseline if higher_is_better else self.baseline / self.ember

    def as_dict(self) -> dict:
        d = {"name": self.name, "unit": self.unit, "ember": _round(self.ember), "baseline": _round(self.baseline),
             "baseline_name": self.baseline_name, "speedup": _round(self.speedup), "target": self.target,
             "meets": self.meets}
        d.update({k: _round(v) for k, v in self.extra.items()})
        return d


def _round(v):
    return round(v, 4) if isinstance(v, float) else v


@dataclasses.dataclass
class BenchContext:
    """What a suite's ``run`` gets. ``hf_compile``: also time HF's static cache + torch.compile generate
    (the fastest stock setting, ~90 s of compiling on the H200); ``variants``: also time the decode
    step's variants (``ember bench moe --variants``)."""
    quick: bool
    device: torch.device
    progress: Callable[[str], None] = lambda msg: None
    hf_compile: bool = False
    variants: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def time_us(self, calls: Sequence[Callable[[], object]]) -> float:
        """Per-call time: graph-replay events on CUDA, wall clock elsewhere."""
        if self.on_gpu:
            return _timing.graph_time_us(calls)
        return _timing.host_time_us(calls, iters=5 if self.quick else 20)


def suites() -> list[str]:
    import ember.bench as pkg
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def run_suite(name: str, *, quick: bool = False, device: str | None = None,
              progress: Callable[[str], None] = lambda msg: None, hf_compile: bool = False,
              variants: bool = False) -> list[Row]:
    if name not in suites():
        raise ValueError(f"suite: expected one of {suites()}, got {name!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and not quick else "cpu"))
    module = importlib.import_module(f"ember.bench.{name}")
    return module.run(BenchContext(quick=quick, device=dev, progress=progress, hf_compile=hf_compile,
                                   variants=variants))


def versions() -> dict:
    out = {"torch": torch.__version__}
    for mod in ("triton", "transformers", "diffusers"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception:
            out[mod] = None
    return out


def to_json(suite: str, rows: list[Row]) -> dict:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"suite": suite, "date": datetime.date.today().isoformat(), "gpu": gpu, "versions": versions(),
            "rows": [r.as_dict() for r in rows]}


def write_json(path: str, suite: str, rows: list[Row]) -> None:
    with open(path, "w") as f:
        json.dump(to_json(suite, rows), f, indent=2)
        f.write("\n")


def plot(path: str, results: dict[str, list[Row]]) -> None:
    """A horizontal bar chart of speedups (log scale), one bar per row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [(f"{s}: {r.name}", r.speedup) for s, rs in results.items() for r in rs if r.speedup]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ax.barh([n for n, _ in rows], [v for _, v in rows], color=["#d9480f" if v >= 1 else "#868e96" for _, v in rows])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("speedup over the stock baseline (x, log scale)")
    for i, (_, v) in enumerate(rows):
        ax.text(v, i, f" {v:.2f}x", va="center", fontsize=8)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
