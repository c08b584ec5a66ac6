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

Example:
    $ ember quantize ./Qwen3-30B-A3B ./Qwen3-30B-A3B-fp8 --fp8
"""
from __future__ import annotations

import sys

HELP = "write an FP8 (128x128 block) copy of a checkpoint"
# Substrings of weights that stay in their dtype: they are small, or set the logits / routing.
KEEP = ("embed_tokens", "lm_head", "norm", ".gate.weight", "shared_expert_gate", "visual", "mtp.")
# stacked experts: parent name -> per-expert (gate, up, down) names of that family's checkpoints
EXPERT_NAMES = {"mlp.experts": ("gate_proj", "up_proj", "down_proj"), "feed_forward.experts": ("w1", "w3", "w2")}
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja",
              "special_tokens_map.json", "vocab.json", "merges.txt")
SHARD_BYTES = 4 * 1024 ** 3


def add_arguments(p) -> None:
    p.add_argument("src", metavar="DIR", help="checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory (created)")
    p.add_argument("--fp8", action="store_true", required=True, help="quantise to float8_e4m3fn (the only format)")
    p.add_argument("--device", default=None, help="where to quantise (default cuda when present)")


def quantizable(name: str, t) -> bool:
    """Whether ``ember quantize`` converts this 2-d weight (stacked experts are handled apart)."""
    return t.dim() == 2 and name.endswith(".weight") and t.is_floating_point() and not any(k in name for k in KEEP)


def _stacked_experts(name: str, t):
    """(parent prefix, per-expert names) when ``name`` is a stacked gate_up / down expert tensor."""
    for parent, names in EXPERT_NAMES.items():
        if t.dim() == 3 and name.endswith((f"{parent}.gate_up_proj", f"{parent}.down_proj")):
            return name.rsplit(".", 1)[0], names
    return None


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
        n = quantize_checkpoint(args.src, args.out, args.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"ember quantize: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {n} weights in float8_e4m3fn with 128x128 block scales")
    return 0
