"""``ember doctor``: what this machine can run, and why not.

Each probe is a module-level function returning a plain dict, so tests can simulate every failure
class by monkeypatching one probe. ``doctor()`` assembles the report; ``render()`` prints it.

Example:
    >>> report = ember.doctor()
    >>> report["ok"], report["families"]["norm"]["path"]
    (True, 'reference')
"""
from __future__ import annotations

import importlib
import platform
import sys
import warnings

import torch

from ember import _dispatch, _switches, tuning

# Op families and the module that implements each; doctor reports the path each takes here.
FAMILIES = {
    "norm": "ember.ops.norm",
    "sampling": "ember.ops.sampling",
    "fp8": "ember.ops.fp8",
    "moe": "ember.ops.moe",
    "pad": "ember.ops.pad",
    "conv1d": "ember.ops.conv1d",
    "deltanet": "ember.ops.deltanet",
    "attention": "ember.ops.attention",
    "linear": "ember.ops.linear",
    "snake": "ember.ops.snake",
    "cross_entropy": "ember.ops.cross_entropy",
    "swiglu": "ember.ops.swiglu",
    "moe_train": "ember.ops.moe_train",
}
# Families whose fast path needs more than "a GPU Triton can compile for".
FP8_TENSOR_CORE_MIN_CC = (8, 9)
PDL_MIN_CC = (9, 0)  # programmatic dependent launch (Hopper+), as kernels._common.use_pdl decides
ROCM_WHY = ("AMD GPU (ROCm build of torch): ember's Triton kernels target NVIDIA GPUs (inline PTX, dependent "
            "launch, float8_e4m3fn) and are untested on ROCm, so the op runs its reference (plain PyTorch) path "
            "on the GPU")


def probe_cuda() -> dict:
    info = {"built": torch.backends.cuda.is_built(), "torch_cuda_version": torch.version.cuda,
            "available": False, "device_count": 0, "devices": [], "warning": None, "error": None}
    if not info["built"]:
        info["error"] = "this torch build has no CUDA support (a CPU-only build)"
        return info
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            info["available"] = torch.cuda.is_available()
        except Exception as e:  # a broken driver can raise here
            info["error"] = f"{type(e).__name__}: {e}"
    texts = [str(w.message) for w in caught]
    if texts:
        info["warning"] = " ".join(texts)
    if info["available"]:
        info["device_count"] = torch.cuda.device_count()
        for i in range(info["device_count"]):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"name": p.name, "capability": [p.major, p.minor],
                                    "memory_GB": round(p.total_memory / 1e9, 1),
                                    "sms": p.multi_processor_count})
    return info


def probe_triton(cuda_available: bool) -> dict:
    """Import Triton and, where a CUDA device exists, compile and run a trivial kernel."""
    info = {"importable": False, "version": None, "runs_kernel": None, "error": None}
    err = _dispatch.triton_import_error()
    if err is not None:
        info["error"] = err
        return info
    import triton
    info["importable"], info["version"] = True, triton.__version__
    if not cuda_available:
        return info
    try:
        from ember.kernels import probe
        info["runs_kernel"] = probe.add_one_matches()
        if not info["runs_kernel"]:
            info["error"] = "a trivial kernel ran but produced wrong values"
    except Exception as e:  # report the compiler's or driver's exact words
        info["runs_kernel"] = False
        info["error"] = f"{type(e).__name__}: {str(e).strip()[:500]}"
    return info


def probe_mps() -> dict:
    built = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_built())
    info = {"built": built, "available": False, "macos": platform.mac_ver()[0] or None, "error": None}
    if built:
        try:
            info["available"] = torch.backends.mps.is_available()
            if not info["available"]:
                info["error"] = "MPS is built but no Metal device is reachable (macOS 12.3+ on Apple silicon needed)"
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
    return info


# Packages a core install brings for text in / text out (ember generate / chat, ember.load of a hub id).
TEXT_PACKAGES = {"tokenizers": "read tokenizer.json", "jinja2": "render chat templates",
                 "huggingface_hub": "fetch hub ids"}
def _no_triton_why(error) -> str:
    return (f"CUDA GPU but Triton is not installed ({error}): ops run their reference (plain PyTorch) path on "
            "the GPU; `pip install triton` for ember's kernels (CUDA builds of torch normally bring it)")


def probe_packages() -> dict:
    """Version (or None when missing) of each package in TEXT_PACKAGES."""
    from importlib import metadata
    found = {}
    for name in TEXT_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def _family_path(module: str, cuda: dict, triton_info: dict) -> dict:
    try:
        importlib.import_module(module)
    except ImportError as e:
        return {"path": "unavailable", "why": f"not in this ember build ({e})"}
    if not cuda["available"]:
        return {"path": "reference", "why": "no CUDA device: the op runs on the reference (plain PyTorch) path"}
    if _dispatch.rocm():
        return {"path": "reference", "why": ROCM_WHY}
    if not triton_info["importable"]:
        if "No module named 'triton'" in str(triton_info["error"]):
            return {"path": "reference", "why": _no_triton_why(triton_info["error"])}
        return {"path": "reference", "why": f"Triton cannot be imported ({triton_info['error']})"}
    if not triton_info["runs_kernel"]:
        return {"path": "reference", "why": f"Triton cannot run kernels here ({triton_info['error']})"}
    return {"path": "triton", "why": "CUDA device and a working Triton"}


def doctor() -> dict:
    """A structured report of what ember can run on this machine, and why not.

    Keys: ``python``, ``torch``, ``cuda``, ``triton``, ``mps``, ``families`` (op family -> path and
    reason), ``notes`` (plain-language lines) and ``ok`` (ember can run at all: CPU counts).

    Example:
        >>> report = ember.doctor()
        >>> report["notes"]   # e.g. ["no CUDA device: ops run on the reference path"]
    """
    cuda = probe_cuda()
    tri = probe_triton(cuda["available"])
    mps = probe_mps()
    notes = []
    if cuda["warning"] and "too old" in cuda["warning"].lower():
        notes.append(f"the NVIDIA driver is too old for this torch build: {cuda['warning'].strip()}")
    elif cuda["warning"]:
        notes.append(f"torch warned while probing CUDA: {cuda['warning'].strip()}")
    if not cuda["available"]:
        notes.append("no CUDA device: ops run on the reference path")
    if cuda["available"] and _dispatch.rocm():
        notes.append(ROCM_WHY)
    for d in (cuda["devices"] if not _dispatch.rocm() else []):  # sm_ capabilities: NVIDIA only
        cc = tuple(d["capability"])
        if cc >= FP8_TENSOR_CORE_MIN_CC:
            notes.append(f"{d['name']} (sm_{cc[0]}{cc[1]}): FP8 tensor-core kernels enabled")
        else:
            notes.append(f"{d['name']} (sm_{cc[0]}{cc[1]}): FP8 tensor-core kernels need compute capability >= 8.9; "
                         "FP8 weights are upcast in the kernel instead")
        # the decode kernels' programmatic dependent launch (kernels._common.use_pdl)
        if cc < PDL_MIN_CC:
            notes.append(f"{d['name']} (sm_{cc[0]}{cc[1]}): decode kernels launch one after another "
                         "(overlapped launches need compute capability >= 9.0)")
        elif not _dispatch.pdl_allowed():
            notes.append(f"{d['name']}: EMBER_PDL=0: decode kernels launch one after another")
        else:
            notes.append(f"{d['name']}: decode kernels overlap their launches (programmatic dependent launch; "
                         "EMBER_PDL=0 turns it off)")
    if cuda["available"] and not _dispatch.rocm() and not tri["importable"] and \
            "No module named 'triton'" in str(tri["error"]):
        notes.append(_no_triton_why(tri["error"]))
    elif cuda["available"] and tri["error"]:
        notes.append(f"Triton problem: {tri['error']}")
    packages = probe_packages()
    for name, version in packages.items():
        if version is None:
            notes.append(f"the {name} package is missing: ember cannot {TEXT_PACKAGES[name]} (ember generate / "
                         f"chat need it); pip install {name}")
    if mps["available"]:
        notes.append("Apple GPU (MPS) reachable: ops run there on the reference path")
    families = {name: _family_path(mod, cuda, tri) for name, mod in FAMILIES.items()}
    if _dispatch.force_triton():
        notes.append("EMBER_FORCE_TRITON=1: CPU tensors take Triton kernels through the interpreter (slow; for tests)")
    tuning_info = [dict(tuning.summary(tuning.DeviceInfo(d["name"], tuple(d["capability"]))), gpu=d["name"])
                   for d in (cuda["devices"] if not _dispatch.rocm() else [])]
    for t in tuning_info:
        if t["mode"] == "generic":
            notes.append(f"{t['gpu']}: EMBER_TUNING=generic: kernels use the generic tile entries")
        elif t["shipped"] is None and not t["cached_families"]:
            notes.append(f"{t['gpu']}: no measured tile data for this GPU: kernels use the generic entries "
                         "(`ember tune <family>` measures and caches tiles for it)")
    return {
        "ok": True,  # the reference path needs only torch, which imported to get here
        "packages": packages,
        "switches": _switches.describe(),
        "tuning": tuning_info,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": cuda,
        "triton": tri,
        "mps": mps,
        "families": families,
        "notes": notes,
    }


def render(report: dict) -> str:
    cuda, tri, mps = report["cuda"], report["triton"], report["mps"]
    lines = [f"python {report['python']}  torch {report['torch']}  platform {report['platform']}"]
    if cuda["available"]:
        devs = ", ".join(f"{d['name']} sm_{d['capability'][0]}{d['capability'][1]} {d['memory_GB']} GB"
                         for d in cuda["devices"])
        lines.append(f"cuda: {cuda['device_count']} device(s): {devs} (torch built for CUDA {cuda['torch_cuda_version']})")
    else:
        why = cuda["error"] or ("torch is built with CUDA but found no usable device" if cuda["built"] else "")
        lines.append(f"cuda: unavailable ({why})")
    if tri["importable"]:
        ran = {True: "compiles and runs kernels", False: "cannot run kernels", None: "not tried (no CUDA device)"}
        lines.append(f"triton {tri['version']}: {ran[tri['runs_kernel']]}" + (f" ({tri['error']})" if tri["error"] else ""))
    else:
        lines.append(f"triton: not importable ({tri['error']})")
    lines.append(f"mps: built={mps['built']} available={mps['available']}" + (f" macOS {mps['macos']}" if mps["macos"] else ""))
    if report.get("packages"):
        lines.append("text: " + ", ".join(f"{n} {v or 'MISSING'}" for n, v in report["packages"].items()))
    lines.append("op families:")
    width = max(map(len, report["families"]), default=0)
    for name, fam in report["families"].items():
        lines.append(f"  {name:<{width}} {fam['path']:<11} {fam['why']}")
    for t in report.get("tuning", []):
        cached = ", ".join(t["cached_families"]) or "none"
        lines.append(f"tuning: {t['gpu']}: mode {t['mode']}, shipped data {t['shipped'] or 'none (generic entries)'}, "
                     f"tuned here: {cached} ({t['cache']})")
    lines.append("switches (environment):")
    for sw in report.get("switches", []):
        shown = str(int(sw["value"])) if isinstance(sw["value"], bool) else repr(sw["value"])
        value = f"error: {sw['error']}" if sw["error"] else shown + (" (set)" if sw["set"] else "")
        lines.append(f"  {sw['name']:<24} {sw['category']:<9} {value:<14} {sw['doc']}")
    for n in report["notes"]:
        lines.append(f"- {n}")
    lines.append("ember can run here" if report["ok"] else "ember cannot run here")
    return "\n".join(lines)
