"""``ember quantize DIR OUT --fp8``: write an FP8 copy of a checkpoint that ``ember.load`` (and
transformers' fine-grained FP8 loader) reads back.

Format (Hugging Face fine-grained FP8): every attention / MLP / expert projection weight
``*.{q,k,v,o,gate,up,down}_proj.weight`` becomes float8_e4m3fn with a float32
``*.weight_scale_inv`` decode scale per 128x128 block; experts are written per expert
(``mlp.experts.N.gate_proj.weight``) even when the source stacks them; embeddings, norms, the router
and lm_head are copied unchanged. config.json gains ``quantization_config`` {quant_method: fp8,
weight_block_size: [128, 128]}; tokenizer and generation files are copied.

Example:
    $ ember quantize ./Qwen3-30B-A3B ./Qwen3-30B-A3B-fp8 --fp8
"""
from __future__ import annotations

import sys

HELP = "write an FP8 (128x128 block) copy of a checkpoint"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "special_tokens_map.json", "vocab.json", "merges.txt")
SHARD_BYTES = 4 * 1024 ** 3


def add_arguments(p) -> None:
    p.add_argument("src", metavar="DIR", help="checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory (created)")
    p.add_argument("--fp8", action="store_true", required=True, help="quantise to float8_e4m3fn (the only format)")
    p.add_argument("--device", default=None, help="where to quantise (default cuda when present)")


def _quantizable(name: str, t) -> bool:
    parts = name.split(".")
    return t.dim() == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJ and t.is_floating_point()


def quantize_checkpoint(src, out, device=None) -> int:
    """Write the FP8 checkpoint; returns the number of tensors quantised."""
    import json
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from ember.loading import _open, checkpoint_files, read_config
    from ember.ops import fp8 as fp8_ops

    src, out = Path(src), Path(out)
    cfg = read_config(src)
    if (cfg.get("quantization_config") or {}).get("quant_method") == "fp8":
        raise ValueError(f"{src}: already an FP8 checkpoint")
    files = checkpoint_files(src)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out.mkdir(parents=True, exist_ok=True)
    shard, shard_bytes, shards, weight_map, count = {}, 0, [], {}, 0
    handles = {}

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
        t = handles[f].get_tensor(name)
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and t.dim() == 3:
            base = name.rsplit(".", 1)[0]  # stacked experts -> per expert, HF FP8 layout
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    g, u = t[e].chunk(2, 0)
                    put_quantized(f"{base}.{e}.gate_proj.weight", g)
                    put_quantized(f"{base}.{e}.up_proj.weight", u)
                else:
                    put_quantized(f"{base}.{e}.down_proj.weight", t[e])
        elif _quantizable(name, t):
            put_quantized(name, t)
        else:
            put(name, t)
    flush()
    if len(shards) == 1:
        (out / shards[0]).rename(out / "model.safetensors")
    else:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128],
                                  "modules_to_not_convert": ["lm_head", "embed_tokens", "mlp.gate"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for extra in COPY_FILES:
        if (src / extra).is_file():
            shutil.copy(src / extra, out / extra)
    return count


def run(args) -> int:
    try:
        n = quantize_checkpoint(args.src, args.out, args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"ember quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {n} weights in float8_e4m3fn with 128x128 block scales")
    return 0
