"""``ember <verb>``: doctor, bench, and the verbs feature modules contribute (generate, chat, quantize, serve).

A feature verb lives in its own module defining ``HELP`` (optionally ``DESCRIPTION`` for its
``--help``), ``add_arguments(parser)`` and ``run(args) -> int``; such modules keep heavy imports
inside ``run`` so ``ember --help`` stays fast.

Errors: a verb raises ValueError / TypeError / OSError / MemoryError for what the user can fix;
``main`` prints it as one line (``ember <verb>: <message>``) and exits 2. Ctrl-C exits 130. Any
other exception is one line too, exit 1. ``--debug`` (on every verb) shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import warnings

VERB_MODULES = {
    "generate": "ember.engine.cli",
    "chat": "ember.engine.chat_cli",
    "quantize": "ember.quantize_cli",
    "tune": "ember.tuning.cli",
    "serve": "ember.serve.cli",
}


def _cmd_doctor(args) -> int:
    from ember.doctor import doctor, render
    report = doctor()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1


def _cmd_bench(args) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ember import bench

    names = bench.suites()
    if args.suite is None and not args.quick:
        print(f"ember bench: name a suite ({', '.join(names)}) or pass --quick to run every suite's quick form",
              file=sys.stderr)
        return 2
    if args.suite is not None and args.suite not in names:
        print(f"ember bench: unknown suite {args.suite!r}; expected one of {', '.join(names)}", file=sys.stderr)
        return 2
    chosen = [args.suite] if args.suite else names
    console = Console()
    results = {}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task("bench", total=None)
        for name in chosen:
            def report(msg, name=name, t0=time.perf_counter()):
                progress.update(task, description=f"[{name}] {msg}")
                if not console.is_terminal:  # a log (CI, a GPU job): how far a suite got, and when
                    print(f"[{name} {time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)
            try:
                results[name] = bench.run_suite(name, quick=args.quick, device=args.device, progress=report,
                                                hf_compile=args.hf_compile, variants=args.variants)
            except ModuleNotFoundError as e:  # a stock baseline library is missing
                print(f"ember bench {name}: needs the package {e.name!r} for its baseline; "
                      "install the bench extra: pip install 'ember[bench]' (or -e \".[bench]\")", file=sys.stderr)
                return 2
    for name, rows in results.items():
        table = Table(title=f"ember bench {name}" + (" (quick)" if args.quick else ""))
        for col in ("row", "unit", "ember", "baseline", "speedup", "target", "meets"):
            table.add_column(col, justify="right" if col in ("ember", "baseline", "speedup") else "left")
        for r in rows:
            sp = r.speedup
            table.add_row(r.name, r.unit, f"{r.ember:.2f}", "-" if r.baseline is None else f"{r.baseline:.2f}",
                          "-" if sp is None else f"{sp:.2f}x", r.target, {True: "yes", False: "NO", None: "-"}[r.meets])
        console.print(table)
    if args.json:
        if len(results) != 1:
            print("ember bench: --json writes one suite; name it", file=sys.stderr)
            return 2
        (name, rows), = results.items()
        bench.write_json(args.json, name, rows)
        console.print(f"wrote {args.json}")
    if args.plot:
        bench.plot(args.plot, results)
        console.print(f"wrote {args.plot}")
    return 0


def _suites() -> list[str]:
    from ember import bench
    return bench.suites()


def _add_debug(p: argparse.ArgumentParser) -> None:
    if not any("--debug" in a.option_strings for a in p._actions):
        p.add_argument("--debug", action="store_true", help="on an error, show the full traceback")


def build_parser() -> argparse.ArgumentParser:
    from ember import __version__
    p = argparse.ArgumentParser(prog="ember", description="Fast, small large models on the accelerator you have.")
    p.add_argument("--version", action="version", version=f"ember {__version__}", help="print ember's version")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    d = sub.add_parser("doctor", help="what this machine can run, and why not")
    d.add_argument("--json", action="store_true", help="print the structured report as JSON")
    d.set_defaults(func=_cmd_doctor)
    _add_debug(d)
    suites = _suites()
    b = sub.add_parser("bench", help="run a benchmark suite against the stock baseline",
                       description=f"Run a benchmark suite against the stock baseline. Suites: {', '.join(suites)}.")
    b.add_argument("suite", nargs="?", help=f"suite name, one of: {', '.join(suites)} (omit with --quick to run all)")
    b.add_argument("--quick", action="store_true", help="small shapes, reference paths, runs anywhere in < 1 min")
    b.add_argument("--json", metavar="PATH", help="write results as JSON")
    b.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of speedups (needs matplotlib)")
    b.add_argument("--device", help="device to run on (default: cuda if present, cpu with --quick)")
    b.add_argument("--hf-compile", action="store_true",
                   help="LLM suites: also time HF's static cache + torch.compile generate (~90 s of compiling)")
    b.add_argument("--variants", action="store_true",
                   help="LLM suites: also time the decode step's variants (generic tiles, dependent launch off)")
    b.set_defaults(func=_cmd_bench)
    _add_debug(b)
    for verb, module in VERB_MODULES.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
            continue  # feature not in this build
        v = sub.add_parser(verb, help=mod.HELP, description=getattr(mod, "DESCRIPTION", None))
        mod.add_arguments(v)
        v.set_defaults(func=mod.run)
        _add_debug(v)
    return p


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    name = f"ember {args.verb}"

    def show(message, category, filename, lineno, file=None, line=None):  # warnings as one line each
        print(f"{name}: warning: {_one_line(message)}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = show
            return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        sys.stdout.flush()
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, MemoryError) as e:
        if debug:
            raise
        print(f"{name}: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if debug:
            raise
        print(f"{name}: {type(e).__name__}: {_one_line(e)} (run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
