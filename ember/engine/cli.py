"""``ember generate``: load a checkpoint, print the continuation as it is decoded, then one line of
figures on stderr (prompt tok/s, decode tok/s, peak memory; ``--quiet`` drops it).

Also the pieces ``ember chat`` shares: the model, device and sampling flags and their checks. A
user error (a bad flag value, a missing or broken file) raises ValueError / TypeError /
FileNotFoundError / MemoryError with a message naming the culprit; ``ember.cli.main`` prints it as
one line and exits 2.

Example:
    $ ember generate --model ./Qwen3-30B-A3B --prompt "The capital of France is" --max-new-tokens 32
    $ echo "Why is the sky blue?" | ember generate --model Qwen/Qwen3-30B-A3B --prompt - --chat
"""
from __future__ import annotations

import sys

from ember.models import SUPPORTED

MODEL_TYPES = ", ".join(sorted(SUPPORTED))
HELP = "generate text from a Hugging Face checkpoint (a directory or a hub id)"
DESCRIPTION = (f"Generate text from a Hugging Face checkpoint. Supported model types (config.json "
               f"'model_type'): {MODEL_TYPES}.")
INT64 = (-2 ** 63, 2 ** 63)


# ----------------------------------------------------------------------------- shared flags
def add_model_arguments(p, max_seq_len_help: str) -> None:
    p.add_argument("--model", required=True,
                   help=f"checkpoint directory or Hugging Face hub id (org/name) with config.json, *.safetensors "
                        f"and the tokenizer; model types: {MODEL_TYPES}")
    p.add_argument("--revision", default=None, help="hub branch, tag or commit (hub ids only)")
    p.add_argument("--device", default=None, help="cuda, cuda:N, cpu or mps (default: cuda when present, else cpu)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="weight and activation dtype (default: the checkpoint's)")
    p.add_argument("--fp8", action="store_true", help="quantise weights to FP8 on load")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="with --fp8 or an FP8 checkpoint: the lm_head in FP8 too (faster; logits rounded to fp8)")
    p.add_argument("--max-seq-len", type=int, default=None, help=max_seq_len_help)


def add_sampling_arguments(p) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="softmax temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep the smallest set with this mass; 1 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the top probability; 0 = off")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling, in [-2^63, 2^63) "
                                                          "(default: a fresh one each run)")
    p.add_argument("--quiet", action="store_true", help="do not print the statistics line on stderr")


def sampling_from(args):
    import ember
    if args.seed is not None and not INT64[0] <= args.seed < INT64[1]:
        raise ValueError(f"--seed: expected an integer in [-2^63, 2^63) (int64), got {args.seed}")
    return ember.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, seed=args.seed)


def resolve_device(name: str | None):
    """``--device`` checked against this machine: None (ember.load's default) or a torch.device."""
    if name is None:
        return None
    import torch
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: {name!r} is not a device (expected cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise ValueError(f"--device {name}: this torch build has no CUDA support (a CPU-only build); "
                             "install a CUDA build of torch or pass --device cpu")
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: torch finds no usable CUDA device (`ember doctor` says why); "
                             "pass --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"--device {name}: MPS is not available here (it needs a Mac with Apple silicon, "
                             "macOS 12.3+ and a torch built with MPS)")
    elif dev.type != "cpu":
        raise ValueError(f"--device {name}: ember runs on cpu, cuda or mps, got device type {dev.type!r}")
    return dev


def resolve_path(model: str, revision: str | None):
    """``--model`` as a checkpoint directory (a hub id is fetched, or found in the cache)."""
    try:
        from ember.hub import resolve_checkpoint
    except ModuleNotFoundError as e:
        if e.name != "ember.hub":
            raise
        from pathlib import Path
        if revision is not None:
            raise ValueError("--revision: this ember build reads local directories only") from None
        return Path(model).expanduser()
    return resolve_checkpoint(model, revision=revision)


def load_tokenizer_for(path, what: str):
    from ember.engine.tokenizer import load_tokenizer
    from ember.loading import read_config
    read_config(path)  # a missing or broken config.json is the first thing to say
    tok = load_tokenizer(path)
    if tok is None:
        raise FileNotFoundError(f"{path}: no tokenizer.json; {what} needs the checkpoint's tokenizer")
    return tok


def load_model(args, path, max_seq_len: int):
    import ember
    return ember.load(path, device=resolve_device(args.device), dtype=args.dtype, fp8=args.fp8,
                      max_seq_len=max_seq_len, fp8_lm_head=args.fp8_lm_head,
                      tensor_parallel=getattr(args, "tp", 1))


def join_tensor_parallel(tp: int) -> int:
    """``--tp N``: join torchrun's N processes (``ember.distributed.init()``) and return this rank;
    0 for ``--tp 1``. A ValueError naming --tp when not under torchrun or its process count is not N.

    Example:
        $ torchrun --nproc-per-node 2 -m ember generate --tp 2 --model DIR --prompt "Hello"
    """
    if tp < 1:
        raise ValueError(f"--tp: expected an int >= 1, got {tp}")
    if tp == 1:
        return 0
    import torch.distributed as dist
    import ember.distributed as ed
    try:
        ed.init()
    except ValueError as e:  # torch's env:// rendezvous: RANK / WORLD_SIZE / MASTER_ADDR not set
        raise ValueError(f"--tp {tp}: needs `torchrun --nproc-per-node {tp}`; no torch.distributed process group "
                         f"to join here ({e})") from None
    world = dist.get_world_size()
    if world != tp:
        dist.destroy_process_group()
        raise ValueError(f"--tp {tp}: torchrun started {world} process(es); expected {tp} "
                         f"(torchrun --nproc-per-node {tp})")
    return dist.get_rank()


def _peak_memory_gb(device) -> float:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def stats_line(model) -> str:
    st = model.stats
    return (f"[{st.prompt_tokens} prompt tokens: {st.prompt_tok_s:.1f} tok/s | {st.new_tokens} new tokens: "
            f"{st.decode_tok_s:.1f} tok/s decode | peak memory {_peak_memory_gb(model.device):.2f} GB"
            f"{' | fp8' if model.fp8 else ''}]")


# ----------------------------------------------------------------------------- ember generate
def add_arguments(p) -> None:
    p.add_argument("--prompt", required=True, help="prompt text; '-' reads it from stdin")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    add_model_arguments(p, "KV cache length in tokens (default: the prompt's tokens + --max-new-tokens)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel over N GPUs: run under `torchrun --nproc-per-node N` (rank 0 prints)")
    add_sampling_arguments(p)


def _read_prompt(arg: str) -> str:
    if arg != "-":
        return arg
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text  # the newline that ends a piped line
    if not text:
        raise ValueError("--prompt -: stdin was empty; expected the prompt text")
    return text


def _shared_prompt(arg: str, rank: int) -> str:
    """The prompt on every rank: rank 0 alone reads stdin (ranks reading one pipe would split it) and
    broadcasts the text, or its error, which every rank then raises."""
    if arg != "-":
        return arg
    import torch.distributed as dist
    box: list = [None]
    if rank == 0:
        try:
            box = [(True, _read_prompt(arg))]
        except ValueError as e:
            box = [(False, str(e))]
    dist.broadcast_object_list(box, src=0)
    ok, text = box[0]
    if not ok:
        raise ValueError(text)
    return text


def run(args) -> int:
    sampling = sampling_from(args)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected an int >= 1, got {args.max_new_tokens}")
    resolve_device(args.device)  # before any loading: a device that cannot work is said at once
    rank = join_tensor_parallel(args.tp)
    try:
        return _generate(args, sampling, rank)
    finally:
        if args.tp > 1:
            import torch.distributed as dist
            dist.destroy_process_group()


def _generate(args, sampling, rank: int) -> int:
    """Every rank loads its shard and decodes (SPMD: the same steps and collectives); rank 0 prints."""
    prompt = _read_prompt(args.prompt) if args.tp == 1 else _shared_prompt(args.prompt, rank)
    path = resolve_path(args.model, args.revision)
    max_seq_len = args.max_seq_len
    if args.chat or max_seq_len is None:
        tok = load_tokenizer_for(path, "ember generate")
        if args.chat:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
        if max_seq_len is None:  # the cache fits this request exactly
            max_seq_len = len(tok.encode(prompt)) + args.max_new_tokens
    model = load_model(args, path, max_seq_len)
    for piece in model.stream(prompt, max_new_tokens=args.max_new_tokens, sampling=sampling):
        if rank == 0:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if rank == 0:
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not args.quiet:
            print(stats_line(model), file=sys.stderr)
    if args.tp > 1:  # leave together: a gloo peer torn down while the other still talks can abort it
        import torch.distributed as dist
        dist.barrier()
    return 0
