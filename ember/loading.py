"""``ember.load``: a local Hugging Face checkpoint directory -> :class:`ember.Model`.

Reads ``config.json``; ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(never pickles); bf16 / fp16 / fp32 weights; Hugging Face fine-grained FP8 checkpoints (weights in
float8_e4m3fn with 128x128 block ``weight_scale_inv``), which is also the format ``ember quantize``
writes; and the tokenizer (``tokenizer.json``, chat template) when present.

FP8 layout in memory: dense linears become :class:`ember.nn.Fp8Linear`; expert weights stay stacked
in fp8 with decode scales the moe op reads (per 128x128 block from a checkpoint whose blocks stack,
per output row when quantising on load). The router, norms, embeddings and lm_head stay in ``dtype``.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ember.models import _common, module_for
from ember.models._weights import BLOCK, _cdiv, quantize_lm_head  # noqa: F401  (quantize_lm_head: load(fp8_lm_head=True))

FP8 = torch.float8_e4m3fn
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I8": 1,
             "U8": 1, "BOOL": 1, "I16": 2}
# Tensors some checkpoints carry that no forward pass reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- config / files
def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise FileNotFoundError(f"path: expected a checkpoint directory, got {str(path)!r} (not a directory)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face checkpoint directory "
                                "(config.json + model.safetensors)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object")
    return cfg


def checkpoint_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map'")
        files = {n: path / f for n, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise FileNotFoundError(f"{index}: lists shard {f.name}, which does not exist")
        return files
    if single.is_file():
        return {n: single for n in _open(single).keys()}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(f"{path}: only pickle checkpoints (*.bin / *.pt) found; ember reads safetensors only "
                         "(it never unpickles). Convert with transformers' save_pretrained(safe_serialization=True).")
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _open(file: Path):
    from safetensors import safe_open
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _tensor_bytes(files: dict[str, Path], dtype: torch.dtype, fp8: bool) -> int:
    """Bytes the loaded weights take: floats in ``dtype`` (fp8 linears 1 byte), fp8 kept as is."""
    total = 0
    by_file: dict[Path, list[str]] = {}
    for n, f in files.items():
        by_file.setdefault(f, []).append(n)
    for f, names in by_file.items():
        h = _open(f)
        for n in names:
            sl = h.get_slice(n)
            numel = 1
            for d in sl.get_shape():
                numel *= d
            st = sl.get_dtype()
            if st.startswith("F8") or (fp8 and len(sl.get_shape()) >= 2 and "proj" in n):
                total += numel
            elif st in ("F16", "BF16", "F32", "F64"):
                total += numel * torch.empty((), dtype=dtype).element_size()
            else:
                total += numel * _ST_BYTES.get(st, 4)
    return total


def _check_memory(device: torch.device, needed: int, what: str) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if needed > free:
        raise MemoryError(f"not enough GPU memory on {device} to load: need ~{needed / 1e9:.2f} GB "
                          f"({what}), {free / 1e9:.2f} GB free (lower max_seq_len / max_batch_size, or fp8=True)")


def _resolve_dtype(cfg: dict, dtype, device: torch.device) -> torch.dtype:
    if dtype is not None:
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype!r}")
            dtype = _DTYPES[dtype]
        if dtype not in _DTYPES.values():
            raise TypeError(f"dtype: expected torch.bfloat16, float16 or float32, got {dtype}")
        return dtype
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _DTYPES.get(name, torch.bfloat16)


# ----------------------------------------------------------------------------- load
def load(path, *, device=None, dtype=None, fp8: bool = False, max_seq_len: int = 4096, max_batch_size: int = 1,
         fp8_lm_head: bool = False):
    """Load a Hugging Face checkpoint directory into an :class:`ember.Model` ready to generate.

    ``dtype`` defaults to the checkpoint's (bf16 for FP8 checkpoints); ``fp8=True`` quantises the
    linear and expert weights to float8_e4m3fn on load. The static KV cache holds ``max_batch_size``
    rows of ``max_seq_len`` tokens. ``fp8_lm_head=True`` (with ``fp8=True`` or an FP8 checkpoint)
    also quantises the lm_head per row, which FP8 checkpoints keep in bf16: half its bytes (a tied
    lm_head gets its own fp8 copy, so memory grows by half the embedding), a faster decode step
    (H200 Qwen3-30B-A3B figures in bench/results/h200/moe.json, fp8 row), and logits with the fp8
    rounding (about 30 dB logit SNR for random weights and rows: a trade the caller chooses).

    Example:
        >>> model = ember.load("Qwen3-30B-A3B", fp8=True, max_seq_len=8192)
        >>> model.generate(["The capital of France is"], max_new_tokens=16)
    """
    from ember.engine import Model
    from ember.engine.tokenizer import load_tokenizer
    for name, v in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    for name, v in (("fp8", fp8), ("fp8_lm_head", fp8_lm_head)):
        if not isinstance(v, bool):
            raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    path = Path(os.fspath(path)).expanduser()
    cfg = read_config(path)
    module = module_for(cfg.get("model_type"))
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quant = cfg.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "fp8":
        raise ValueError(f"config.json: quantization_config.quant_method {quant.get('quant_method')!r} is not "
                         "supported (ember reads 'fp8' fine-grained checkpoints)")
    if quant and list(quant.get("weight_block_size", [BLOCK, BLOCK])) != [BLOCK, BLOCK]:
        raise ValueError(f"config.json: weight_block_size {quant.get('weight_block_size')} is not supported "
                         f"(expected [{BLOCK}, {BLOCK}])")
    if fp8_lm_head and not (fp8 or quant):
        raise ValueError("fp8_lm_head: needs fp8=True or an FP8 checkpoint (the lm_head is quantised with the "
                         "other linears)")
    dtype = _resolve_dtype(cfg, dtype, device)
    files = checkpoint_files(path)
    _check_memory(device, _tensor_bytes(files, dtype, fp8), "weights")

    handles: dict[Path, object] = {}

    def fetch(name: str) -> torch.Tensor:
        f = files[name]
        if f not in handles:
            handles[f] = _open(f)
        try:
            return handles[f].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: could not read tensor {name} ({type(e).__name__}: {e})") from None

    src = _common.TensorSource(set(files), fetch, device, dtype)
    with torch.no_grad():
        net = module.build(src, cfg, fp8=fp8, max_seq_len=max_seq_len)
    extra = sorted(n for n in src.names - src.used if not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(extra[:8]) + (f" and {len(extra) - 8} more" if len(extra) > 8 else "")
        raise ValueError(f"checkpoint: unexpected tensor(s) the {cfg['model_type']} config does not use: {shown}")
    if fp8_lm_head:
        quantize_lm_head(net)
    net.eval()
    cache_bytes = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                      for layer in net.cache_specs(max_batch_size, max_seq_len, dtype) for shape, dt in layer)
    _check_memory(device, cache_bytes, "KV cache and recurrent state")
    return Model(net, cfg, load_tokenizer(path), max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                 eos_ids=_eos_ids(path, cfg), fp8=fp8 or bool(quant), name=path.name)


def _eos_ids(path: Path, cfg: dict) -> list[int]:
    ids = []
    gen = path / "generation_config.json"
    for source in ([json.loads(gen.read_text())] if gen.is_file() else []) + [cfg]:
        v = source.get("eos_token_id")
        if v is None:
            continue
        ids.extend(v if isinstance(v, list) else [v])
    return sorted(set(int(i) for i in ids))
