"""``ember serve``: load a checkpoint once, warm the scheduler up, serve the OpenAI API on a port.

Binds 127.0.0.1 unless ``--host`` says otherwise (a wider bind without ``--api-key`` is warned
about). Every request works on the model in memory: nothing is read from disk after startup.

Example:
    $ ember serve --model Qwen/Qwen3-30B-A3B --max-batch-size 16 --api-key "$KEY"
    $ curl -H "Authorization: Bearer $KEY" localhost:8000/v1/models
"""
from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

from ember.engine.cli import add_model_arguments, resolve_device, resolve_path

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (continuous batching)"
DESCRIPTION = ("Serve a checkpoint over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, "
               "/v1/models, /health, /metrics. Needs the serve extra: pip install 'ember[serve]'.")
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_MAX_BATCH_SIZE = 8


def add_arguments(p) -> None:
    add_model_arguments(p, f"KV cache length per request in tokens: prompt + max_tokens must fit (default: the "
                           f"model's max_position_embeddings, at most {DEFAULT_MAX_SEQ_LEN})")
    p.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                   help=f"requests decoded together (cache rows, the scheduler's slots; default "
                        f"{DEFAULT_MAX_BATCH_SIZE})")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="longest prompt piece prefilled between two decode steps, in tokens (default: the model's "
                        "weight-read ridge, 4096 for Qwen3-30B-A3B, 512 for dense models; shorter chunks stall "
                        "running streams for less time each but more often)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests waiting for a slot before new ones get 429 (default 256)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body accepted (default 8 MiB; larger ones get 413)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the --model value's name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info: one access line per request)")


def _check(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: expected a TCP port in [0, 65535], got {args.port}")
    for flag, v in (("--max-batch-size", args.max_batch_size), ("--max-queue", args.max_queue),
                    ("--max-body-bytes", args.max_body_bytes), ("--max-seq-len", args.max_seq_len),
                    ("--prefill-chunk", args.prefill_chunk)):
        if v is not None and v < 1:
            raise ValueError(f"{flag}: expected an int >= 1, got {v}")
    if args.api_key is not None and (not args.api_key or args.api_key != args.api_key.strip()):
        raise ValueError("--api-key: expected a non-empty key without surrounding whitespace")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    _check(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as e:
        print(f"ember serve: needs {e.name!r}; install the serve extra: pip install 'ember[serve]'", file=sys.stderr)
        return 2
    import ember
    import ember.serve
    from ember.engine.chat_cli import _default_max_seq_len
    resolve_device(args.device)
    path = resolve_path(args.model, args.revision)
    max_seq_len = args.max_seq_len or _default_max_seq_len(path)
    if not _loopback(args.host) and args.api_key is None:
        print(f"ember serve: warning: binding {args.host} without --api-key: anyone who can reach this port can "
              "use the model", file=sys.stderr)
    model = ember.load(path, device=resolve_device(args.device), dtype=args.dtype, fp8=args.fp8,
                       max_seq_len=max_seq_len, max_batch_size=args.max_batch_size, fp8_lm_head=args.fp8_lm_head)
    if args.prefill_chunk is not None:  # before the scheduler exists: it takes the model's chunk
        model.prefill_chunk = args.prefill_chunk
    # the id clients send: a hub id as typed, a directory by its name
    name = args.served_model_name or (Path(args.model).expanduser().name if Path(args.model).expanduser().is_dir()
                                      else args.model)
    kw = {k: v for k, v in (("max_queue", args.max_queue), ("max_body_bytes", args.max_body_bytes)) if v is not None}
    app = ember.serve.app(model, api_key=args.api_key, model_name=name, **kw)
    print(f"ember serve: {model.name} on {model.device}, {args.max_batch_size} slots x {max_seq_len} tokens, "
          f"{model.prefill_chunk}-token prefill chunks; "
          f"warming up, then listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
