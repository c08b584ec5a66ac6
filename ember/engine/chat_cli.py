"""``ember chat``: a multi-turn conversation in the terminal, through the checkpoint's chat template.

Each turn renders the whole conversation with the template and streams the reply. Lines that
start with ``/`` are commands: ``/reset`` forgets the conversation (the ``--system`` prompt stays),
``/exit`` (or ``/quit``, or end of input) leaves. Ctrl-C during a reply stops that reply; at the
prompt it leaves. Works with stdin from a pipe too (no prompt marker is printed then).

Example:
    $ ember chat --model ./Qwen3-30B-A3B --system "Answer in one sentence."
    > Why is the sky blue?
"""
from __future__ import annotations

import sys

from ember.engine.cli import (add_model_arguments, add_sampling_arguments, load_model, load_tokenizer_for,
                              resolve_device, resolve_path, sampling_from, stats_line)

HELP = "chat with a checkpoint in the terminal (its chat template, streamed replies)"
DESCRIPTION = ("A multi-turn chat through the checkpoint's chat template. Commands: /reset forgets the "
               "conversation (keeps --system), /exit or end of input leaves.")
DEFAULT_MAX_SEQ_LEN = 4096


def add_arguments(p) -> None:
    p.add_argument("--system", default=None, help="system prompt that opens the conversation")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens per reply at most (default 512)")
    add_model_arguments(p, f"KV cache length in tokens: the whole conversation must fit (default: the model's "
                           f"max_position_embeddings, at most {DEFAULT_MAX_SEQ_LEN})")
    add_sampling_arguments(p)


def _default_max_seq_len(path) -> int:
    from ember.loading import read_config
    cfg = read_config(path)
    limit = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return min(limit, DEFAULT_MAX_SEQ_LEN) if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_SEQ_LEN


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return None if not line else line.rstrip("\n")


def run(args) -> int:
    sampling = sampling_from(args)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected an int >= 1, got {args.max_new_tokens}")
    resolve_device(args.device)
    path = resolve_path(args.model, args.revision)
    tok = load_tokenizer_for(path, "ember chat")
    if not tok.chat_template:
        raise ValueError(f"{path}: no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                         "ember chat needs one (ember generate works without)")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    tok.apply_chat_template(opening + [{"role": "user", "content": "hello"}])  # a broken template: say so now
    model = load_model(args, path, args.max_seq_len or _default_max_seq_len(path))
    interactive = sys.stdin.isatty()
    messages = list(opening)
    while True:
        line = _read_line(interactive)
        if line is None or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(opening)
            print("(conversation reset)", file=sys.stderr)
            continue
        if line.startswith("/"):
            print(f"ember chat: unknown command {line.split()[0]!r} (commands: /reset, /exit)", file=sys.stderr)
            continue
        turn = messages + [{"role": "user", "content": line}]
        prompt = tok.apply_chat_template(turn)
        room = model.max_seq_len - len(tok.encode(prompt))
        if room < 1:
            print(f"ember chat: the conversation no longer fits the {model.max_seq_len}-token cache; /reset to "
                  "start over (or restart with a larger --max-seq-len)", file=sys.stderr)
            continue
        reply = []
        try:
            for piece in model.stream(prompt, max_new_tokens=min(args.max_new_tokens, room), sampling=sampling):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # stop this reply, keep the conversation so far
            sys.stdout.write("\n")
            print("(reply interrupted)", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages = turn + [{"role": "assistant", "content": "".join(reply)}]
        if not args.quiet:
            print(stats_line(model), file=sys.stderr)
