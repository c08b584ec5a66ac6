"""``ember quantize DIR OUT --fp8``: write an FP8 copy of a checkpoint that ``ember.load`` (and
transformers' fine-grained FP8 loader) reads back.

Format (Hugging Face fine-grained FP8): every linear projection weight (a 2-d ``*.weight``:
attention q/k/v/o, MLP and shared-expert projections, LFM2's conv ``in_proj``/``out_proj`` and
``w1/w2/w3``, Qwen3.5's DeltaNet ``in_proj_*``/``out_proj``) becomes float8_e4m3fn with a float32
``*.weight_scale_inv`` decode scale per 128x128 block; experts are written per expert
(``mlp.experts.N.gate_proj.weight``, LFM2: ``feed_forward.experts.N.w1.weight``) even when the source
stacks them; embeddings, norms, routers, the shared-expert gate, convolutions, lm_head and any
vision / multi-token-prediction weights are copied unchanged. config.json gains ``quantization_config`` {quant_method: fp8,
weight_block_size: [128, 128]}; tokenizer and generation files are copied.

DIR may be a Hugging Face repo id (``org/name``, ``--revision``), read through the local cache.
The input is never modified: OUT may not be DIR, lie inside it or contain it; a non-empty OUT needs
``--overwrite`` (its stale checkpoint files are then replaced, other files kept). The source is
validated as ``ember.load`` would before anything is written, and the new checkpoint is written to a
temporary directory beside OUT and renamed into place, so a failure leaves nothing behind. Errors
exit with status 2 and one line naming the culprit.

Example:
    $ ember quantize ./Qwen3-30B-A3B ./Qwen3-30B-A3B-fp8 --fp8
    $ ember quantize Qwen/Qwen3-30B-A3B ./Qwen3-30B-A3B-fp8 --fp8 --revision main
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
import sys
import tempfile
from pathlib import Path

HELP = "write an FP8 (128x128 block) copy of a checkpoint"
# Substrings of weights that stay in their dtype: they are small, or set the logits / routing.
KEEP = ("embed_tokens", "lm_head", "norm", ".gate.weight", "shared_expert_gate", "visual", "mtp.")
# stacked experts: parent name -> per-expert (gate, up, down) names of that family's checkpoints
EXPERT_NAMES = {"mlp.experts": ("gate_proj", "up_proj", "down_proj"), "feed_forward.experts": ("w1", "w3", "w2")}
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "special_tokens_map.json", "vocab.json", "merges.txt")
SHARD_BYTES = 4 * 1024 ** 3


def add_arguments(p) -> None:
    p.add_argument("src", metavar="DIR", help="checkpoint directory or Hugging Face repo id (org/name)")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist, be empty, or be given --overwrite)")
    p.add_argument("--fp8", action="store_true", required=True, help="quantise to float8_e4m3fn (the only format)")
    p.add_argument("--device", default=None, help="where to quantise: cpu, cuda, cuda:N or mps (default cuda when present)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a Hub repo id (default main)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint files of a non-empty OUT (other files there are kept)")


def quantizable(name: str, t) -> bool:
    """Whether ``ember quantize`` converts this 2-d weight (stacked experts are handled apart)."""
    return t.dim() == 2 and name.endswith(".weight") and t.is_floating_point() and not any(k in name for k in KEEP)


def _stacked_experts(name: str, t):
    """(parent prefix, per-expert names) when ``name`` is a stacked gate_up / down expert tensor."""
    for parent, names in EXPERT_NAMES.items():
        if t.dim() == 3 and name.endswith((f"{parent}.gate_up_proj", f"{parent}.down_proj")):
            return name.rsplit(".", 1)[0], names
    return None


# Files of a checkpoint directory that --overwrite replaces (anything else in OUT is left alone).
STALE = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth", "config.json",
         "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json",
         "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json")


def _check_output(src: Path, files, out: Path, overwrite: bool) -> None:
    """OUT must not be, hold or sit inside the source (nor hold what the source links to), and must be
    absent, empty or given --overwrite."""
    src_r, out_r = src.resolve(), out.resolve()
    if out_r == src_r:
        raise ValueError(f"OUT {out}: is the source directory; choose another output directory")
    if out_r.is_relative_to(src_r):
        raise ValueError(f"OUT {out}: is inside the source directory {src}; choose a directory outside it")
    if src_r.is_relative_to(out_r):
        raise ValueError(f"OUT {out}: contains the source directory {src}; choose a directory outside it")
    linked = next((f for f in sorted(set(files.values())) if f.resolve().is_relative_to(out_r)), None)
    if linked is not None:  # e.g. a Hub cache snapshot whose files link into OUT
        raise ValueError(f"OUT {out}: holds the source file {linked.resolve()} ({linked.name}); "
                         "choose a directory outside it")
    if out.exists() and not out.is_dir():
        raise ValueError(f"OUT {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"OUT {out}: exists and is not empty; pass --overwrite to replace its checkpoint files")


def _install(tmp: Path, out: Path) -> None:
    """Move the finished checkpoint in ``tmp`` to ``out``: a rename when ``out`` is absent or holds only
    checkpoint files (those are dropped); otherwise its stale checkpoint files are removed and the new
    files moved in beside whatever else it holds."""
    import shutil
    if not out.exists():
        os.rename(tmp, out)
        return
    entries = list(out.iterdir())
    stale = [e for e in entries if e.is_file() and any(fnmatch.fnmatch(e.name, pat) for pat in STALE)]
    if len(stale) == len(entries):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / out.name)
        os.rename(tmp, out)
        shutil.rmtree(old)
        return
    for e in stale:
        e.unlink()
    for f in tmp.iterdir():
        os.replace(f, out / f.name)
    tmp.rmdir()


def quantize_checkpoint(src, out, device=None, *, overwrite: bool = False, revision: str | None = None) -> int:
    """Write the FP8 checkpoint of ``src`` (a directory or Hub repo id) to ``out``; returns the number
    of tensors quantised.

    Nothing is written before the source validates (config, model type, every tensor present with
    the shape config.json implies) and ``out`` is safe to write (never the source, inside it or
    around it). The checkpoint is written to a temporary directory beside ``out`` and renamed into
    place at the end, so a failure leaves neither a partial checkpoint nor an empty directory.
    """
    import shutil

    from ember.hub import resolve_checkpoint
    from ember.loading import check_device, read_config, validate_checkpoint

    device = check_device(device)
    src, out = resolve_checkpoint(src, revision), Path(os.fspath(out)).expanduser()
    cfg = read_config(src)
    if (cfg.get("quantization_config") or {}).get("quant_method") == "fp8":
        raise ValueError(f"{src}: already an FP8 checkpoint")
    cfg, files = validate_checkpoint(src)
    _check_output(src, files, out, overwrite)

    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        count = _convert(src, tmp, cfg, files, device)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in made:  # parents this call created, innermost first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    return count


def _convert(src: Path, out: Path, cfg: dict, files: dict, device) -> int:
    """Write the FP8 checkpoint into the (empty) directory ``out``."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    from ember.loading import _finite, _open
    from ember.ops import fp8 as fp8_ops

    shard, shard_bytes, shards, weight_map, count = {}, 0, [], {}, 0
    handles, flags = {}, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            shards.append(name)
            weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    def put(name, t):
        nonlocal shard_bytes
        shard[name] = t.contiguous().cpu()
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()

    def put_quantized(name, w):
        nonlocal count
        q, s = fp8_ops.quantize_fp8(w.to(device), "block")
        put(name, q)
        put(name[: -len("weight")] + "weight_scale_inv", s)
        count += 1

    for name in sorted(files):
        f = files[name]
        if f not in handles:
            handles[f] = _open(f)
        t = handles[f].get_tensor(name).to(device)
        if t.is_floating_point() and t.numel():
            flags.append((name, _finite(t)))  # read back once, before the config is written
        stacked = _stacked_experts(name, t)
        if stacked:  # stacked experts -> per expert, the HF FP8 layout
            base, (gate_n, up_n, down_n) = stacked
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    g, u = t[e].chunk(2, 0)
                    put_quantized(f"{base}.{e}.{gate_n}.weight", g)
                    put_quantized(f"{base}.{e}.{up_n}.weight", u)
                else:
                    put_quantized(f"{base}.{e}.{down_n}.weight", t[e])
        elif quantizable(name, t):
            put_quantized(name, t)
        else:
            put(name, t)
    flush()
    if flags:
        ok = torch.stack([flag for _, flag in flags]).cpu()
        bad = [name for (name, _), good in zip(flags, ok.tolist()) if not good]
        if bad:
            raise ValueError(f"{files[bad[0]]}: tensor {bad[0]} has non-finite values (NaN or inf)"
                             + (f" (and {len(bad) - 1} more tensor(s))" if len(bad) > 1 else "")
                             + "; the checkpoint is damaged")
    if len(shards) == 1:
        (out / shards[0]).rename(out / "model.safetensors")
    else:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128],
                                  "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate", "feed_forward.gate",
                                                             "shared_expert_gate", "visual", "mtp"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in COPY_FILES:
        if (src / extra).is_file():
            shutil.copy(src / extra, out / extra)
    return count


def run(args) -> int:
    try:
        n = quantize_checkpoint(args.src, args.out, args.device, overwrite=args.overwrite, revision=args.revision)
    except (ValueError, OSError) as e:  # OSError: missing files, the Hub, a full disk
        print(f"ember quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {n} weights in float8_e4m3fn with 128x128 block scales")
    return 0
