"""``ember tune <family>``: measure a kernel family's tiles on this GPU and cache the fastest
(``ember.tuning.tuner``); the kernels read the cache from then on."""
from __future__ import annotations

import sys

HELP = "sweep a kernel family's tiles on this GPU and cache the fastest for it"


def add_arguments(p) -> None:
    p.add_argument("family", nargs="?", help="kernel family to tune (omit with --list)")
    p.add_argument("--keys", default="", help="comma-separated keys to tune (default: the shapes of the supported "
                                              "models), e.g. bf16:4096x4096,fp8:14336x4096")
    p.add_argument("--device", default="cuda", help="CUDA device to tune on (default: cuda)")
    p.add_argument("--dry-run", action="store_true", help="time and report, but write no cache file")
    p.add_argument("--list", action="store_true", help="list the tunable families and their default keys")


def run(args) -> int:
    import torch

    from ember import tuning
    from ember.tuning import tuner
    if args.list or args.family is None:
        for name, t in sorted(tuner.TUNABLES.items()):
            print(f"{name}: {t.doc}\n  default keys: {', '.join(t.keys)}")
        if args.family is None and not args.list:
            print("ember tune: name a family to tune", file=sys.stderr)
            return 2
        return 0
    if args.family not in tuner.TUNABLES:
        print(f"ember tune: unknown family {args.family!r}; expected one of {', '.join(sorted(tuner.TUNABLES))}",
              file=sys.stderr)
        return 2
    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"ember tune: --device {args.device!r} is not a device name (expected cuda or cuda:N)", file=sys.stderr)
        return 2
    if device.type != "cuda" or not torch.cuda.is_available():
        print(f"ember tune: needs a CUDA GPU (tiles are measured on the GPU they are for); --device {args.device} "
              f"{'has no CUDA device here' if device.type == 'cuda' else 'is not a CUDA device'}", file=sys.stderr)
        return 2
    keys = [k for k in args.keys.split(",") if k] or None
    try:
        report = tuner.tune(args.family, device, keys=keys, write=not args.dry_run,
                            progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"ember tune: {e}", file=sys.stderr)
        return 2
    for key, r in report.items():
        if key.startswith("_"):
            continue
        gain = r["current_us"] / r["best_us"] if r["best"] else float("nan")
        print(f"{key}: {r['best']} {r['best_us']:.2f} us (current {r['current_us']:.2f} us, {gain:.2f}x)")
    if "_file" in report:
        print(f"wrote {report['_file']} ({tuning.device_info(device).name})")
    return 0
