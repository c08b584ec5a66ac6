"""``ember.load``: a Hugging Face checkpoint (a local directory or a Hub repo id) -> :class:`ember.Model`.

Reads ``config.json``; ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(never pickles); bf16 / fp16 / fp32 weights; Hugging Face fine-grained FP8 checkpoints (weights in
float8_e4m3fn with 128x128 block ``weight_scale_inv``), which is also the format ``ember quantize``
writes; and the tokenizer (``tokenizer.json``, chat template) when present. Repo ids (``org/name``)
resolve through the Hugging Face cache (:mod:`ember.hub`).

Every failure is a ``ValueError`` / ``FileNotFoundError`` naming the file, tensor or config key:
bad JSON, a ``weight_map`` entry pointing at a shard without that tensor, a shape that disagrees
with config.json, layers the config asks for and the checkpoint lacks, tensors the model does not
read (usually a wrong ``model_type``), and NaN / inf weights (``check_weights``).

FP8 layout in memory: dense linears become :class:`ember.nn.Fp8Linear`; expert weights stay stacked
in fp8 with decode scales the moe op reads (per 128x128 block from a checkpoint whose blocks stack,
per output row when quantising on load). The router, norms, embeddings and lm_head stay in ``dtype``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
from pathlib import Path

import torch

from ember.hub import resolve_checkpoint
from ember.models import _common, module_for
from ember.models._weights import BLOCK, _cdiv, quantize_lm_head  # noqa: F401  (quantize_lm_head: load(fp8_lm_head=True))

FP8 = torch.float8_e4m3fn
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_ST_BYTES = {k: torch.empty((), dtype=v).element_size() for k, v in _ST_DTYPES.items()}
# Tensors some checkpoints carry that no forward pass reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Checkpoints larger than this show a progress bar while loading (on a terminal only).
PROGRESS_BYTES = 1 << 30
# The decoder-layer index in a tensor name (``model.layers.3.`` / Qwen3.5's ``model.language_model.layers.3.``).
_LAYER = re.compile(r"^(model\.(?:language_model\.)?layers\.)(\d+)\.")


# ----------------------------------------------------------------------------- config / files
def read_json(file: Path) -> dict:
    """A JSON object from ``file``; malformed JSON is a ValueError naming the file, line and column."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{file}: not UTF-8 text (expected JSON)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got a {type(data).__name__}")
    return data


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise FileNotFoundError(f"path: expected a checkpoint directory, got {str(path)!r} (not a directory)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json; expected a Hugging Face checkpoint directory "
                                "(config.json + model.safetensors)")
    return read_json(cfg_file)


def checkpoint_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it (an index's ``weight_map`` is checked against the
    shards' headers, which are read without loading data)."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map'")
        bad = next((n for n, f in weight_map.items() if not isinstance(f, str) or not f), None)
        if bad is not None:
            raise ValueError(f"{index}: weight_map[{bad!r}] should be a shard file name, got {weight_map[bad]!r}")
        files = {n: path / f for n, f in weight_map.items()}
        held: dict[Path, set[str]] = {}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"{index}: lists shard {f.name}, which does not exist")
            held[f] = set(_open(f).keys())
        wrong = sorted(n for n, f in files.items() if n not in held[f])
        if wrong:
            n = wrong[0]
            for f in sorted(path.glob("*.safetensors")):  # shards the index no longer lists too
                if f not in held:
                    held[f] = set(_open(f).keys())
            actual = next((f.name for f, names in held.items() if n in names), None)
            where = f"it is in {actual}" if actual else "no shard holds it"
            more = f" ({len(wrong) - 1} more entries are wrong too)" if len(wrong) > 1 else ""
            raise ValueError(f"{index}: weight_map puts {n} in {files[n].name}, but that file does not hold it "
                             f"({where}){more}; re-save the checkpoint or fix the index")
        return files
    if single.is_file():
        return {n: single for n in _open(single).keys()}
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(f"{path}: only pickle checkpoints (*.bin / *.pt) found; ember reads safetensors only "
                         "(it never unpickles). Convert with transformers' save_pretrained(safe_serialization=True).")
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def check_device(device) -> torch.device:
    """``device`` (None: cuda when present, else cpu) as a torch.device this process can use, or a
    ValueError saying why not."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {device!r}: not a device name (expected cpu, cuda, cuda:N or mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(dev)!r}: {why} (use cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(dev)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {str(dev)!r}: MPS is not available in this torch build / on this machine")
    elif dev.type != "cpu":
        raise ValueError(f"device {str(dev)!r}: not supported (expected cpu, cuda, cuda:N or mps)")
    return dev


def _check_quantization(cfg: dict) -> dict:
    quant = cfg.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "fp8":
        raise ValueError(f"config.json: quantization_config.quant_method {quant.get('quant_method')!r} is not "
                         "supported (ember reads 'fp8' fine-grained checkpoints)")
    if quant and list(quant.get("weight_block_size", [BLOCK, BLOCK])) != [BLOCK, BLOCK]:
        raise ValueError(f"config.json: weight_block_size {quant.get('weight_block_size')} is not supported "
                         f"(expected [{BLOCK}, {BLOCK}])")
    return quant


def _num_layers(cfg: dict):
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    n = tc.get("num_hidden_layers", cfg.get("num_hidden_layers"))
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def check_layer_count(cfg: dict, names) -> None:
    """config.json's ``num_hidden_layers`` against the decoder layers the checkpoint has tensors for."""
    n = _num_layers(cfg)
    found = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            found.setdefault(int(m.group(2)), m.group(1))
    if n is None or not found:
        return  # the model file reports a missing or malformed num_hidden_layers
    missing = [i for i in range(n) if i not in found]
    if missing:
        prefix = next(iter(found.values()))
        shown = ", ".join(f"{prefix}{i}.*" for i in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"config.json: num_hidden_layers={n}, but the checkpoint has no tensors for {shown} "
                         f"(it holds {len(found)} layer(s)); fix num_hidden_layers or complete the checkpoint")

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


# ----------------------------------------------------------------------------- reading tensors
def _finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``t``'s device: no NaN / inf in ``t``. No sync; one reduction for bf16/fp16/fp32
    (aminmax propagates NaN and keeps +-inf), a masked compare for fp8's NaN (and e5m2's inf) codes."""
    if t.dtype == torch.float8_e4m3fn:  # NaN is S.1111.111; there is no inf
        return (t.view(torch.uint8) & 0x7F).ne(0x7F).all()
    if t.dtype == torch.float8_e5m2:  # exponent all ones: inf or NaN
        return (t.view(torch.uint8) & 0x7C).ne(0x7C).all()
    if t.dtype in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):  # the one NaN code, 0x80
        return t.view(torch.uint8).ne(0x80).all()
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)


class _Reader:
    """``fetch(name)`` for :class:`TensorSource`: reads a tensor from its shard and, with ``check``,
    copies it to the device and queues its finiteness flag there (no sync until :meth:`verify`)."""

    def __init__(self, files: dict[str, Path], device: torch.device, check: bool, progress=None):
        self.files, self.device, self.check, self.progress = files, device, check, progress
        self._handles: dict[Path, object] = {}
        self._flags: list[torch.Tensor] = []
        self._flagged: list[str] = []

    def __call__(self, name: str, part=None) -> torch.Tensor:
        """The tensor ``name``; with ``part``, ``part(slice handle)`` (a tensor-parallel rank's rows only)."""
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = _open(f)
        try:
            t = self._handles[f].get_tensor(name) if part is None else part(self._handles[f].get_slice(name))
        except Exception as e:
            raise ValueError(f"{f}: could not read tensor {name} ({type(e).__name__}: {e})") from None
        if self.progress is not None:
            self.progress(t.numel() * t.element_size())
        if self.check and t.is_floating_point() and t.numel():
            t = t.to(self.device)
            self._flags.append(_finite(t))
            self._flagged.append(name)
        return t

    def verify(self) -> None:
        """Raise naming the first tensor with NaN / inf values (one device sync for all of them)."""
        if not self._flags:
            return
        bad = (~torch.stack(self._flags)).nonzero().flatten().tolist()
        self._flags = []
        if bad:
            names = list(dict.fromkeys(self._flagged[i] for i in bad))
            more = f" (and {len(names) - 1} more tensor(s): {', '.join(names[1:4])}{', ...' if len(names) > 4 else ''})" \
                if len(names) > 1 else ""
            raise ValueError(f"{self.files[names[0]]}: tensor {names[0]} has non-finite values (NaN or inf){more}; "
                             "the checkpoint is damaged (check_weights=False loads it anyway)")


def _meta_fetch(files: dict[str, Path]):
    """``fetch`` returning empty meta tensors of each tensor's stored shape and dtype (headers only)."""
    handles: dict[Path, object] = {}

    def fetch(name: str) -> torch.Tensor:
        f = files[name]
        if f not in handles:
            handles[f] = _open(f)
        sl = handles[f].get_slice(name)
        dtype = _ST_DTYPES.get(sl.get_dtype())
        if dtype is None:
            raise ValueError(f"{f}: tensor {name} has dtype {sl.get_dtype()}, which ember does not read")
        return torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    return fetch


@contextlib.contextmanager
def _progress_bar(files: dict[str, Path], label: str):
    """Yields ``advance(nbytes)`` drawing a bar on stderr when it is a terminal and the checkpoint is
    over PROGRESS_BYTES; None otherwise."""
    total = sum(f.stat().st_size for f in set(files.values()))
    if total < PROGRESS_BYTES or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    with Progress(TextColumn("loading {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


# ----------------------------------------------------------------------------- building
_NAME = re.compile(r"[A-Za-z_]\w*(?:\.\w+){2,}")


def _build(module, cfg: dict, src, *, fp8: bool, max_seq_len: int):
    """``module.build`` over ``src``; a missing tensor whose neighbours the model did not read gets a
    hint that model_type is probably wrong."""
    try:
        with torch.no_grad():
            return module.build(src, cfg, fp8=fp8, max_seq_len=max_seq_len)
    except ValueError as e:
        hint = _wrong_type_hint(str(e), src, cfg)
        if hint is None:
            raise
        raise ValueError(f"{e}; {hint}") from None


def _wrong_type_hint(message: str, src, cfg: dict) -> str | None:
    unused = src.names - src.used
    for name in _NAME.findall(message):
        if name in src.names:
            continue
        parts = name.split(".")
        for k in range(len(parts) - 1, 2, -1):  # the deepest parent (at least model.layers.N) with unread tensors
            prefix = ".".join(parts[:k]) + "."
            under = sorted(n for n in unused if n.startswith(prefix))
            if under:
                return (f"the checkpoint has {len(under)} tensor(s) under {prefix} the {cfg.get('model_type')} model "
                        f"does not read, e.g. {under[0]}; is model_type right?")
    return None


def check_unused(src, cfg: dict) -> None:
    """Every checkpoint tensor was read by the model (a leftover usually means a wrong model_type)."""
    extra = sorted(n for n in src.names - src.used if not n.endswith(_IGNORED_SUFFIXES))
    if not extra:
        return
    shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
    n_layers = _num_layers(cfg)
    beyond = sorted({int(m.group(2)) for m in map(_LAYER.match, extra) if m and n_layers is not None
                     and int(m.group(2)) >= n_layers})
    hint = (f"config.json has num_hidden_layers={n_layers} but the checkpoint also holds layer(s) "
            f"{', '.join(map(str, beyond[:4]))}{', ...' if len(beyond) > 4 else ''}" if beyond
            else "is model_type right?")
    raise ValueError(f"checkpoint has {len(extra)} tensor(s) the {cfg.get('model_type')} model does not use, "
                     f"e.g. {shown}; {hint}")


def validate_checkpoint(path: Path):
    """Check a checkpoint as :func:`load` would, without reading weights: config, model type, every
    tensor present with the shape config.json implies, none left over (the model is built on the
    meta device from the safetensors headers). Returns ``(cfg, files)``."""
    cfg = read_config(path)
    module = module_for(cfg.get("model_type"))
    _check_quantization(cfg)
    files = checkpoint_files(path)
    check_layer_count(cfg, files)
    src = _common.TensorSource(set(files), _meta_fetch(files), torch.device("meta"), _resolve_dtype(cfg, None, None))
    _build(module, cfg, src, fp8=False, max_seq_len=8)
    check_unused(src, cfg)
    return cfg, files


# ----------------------------------------------------------------------------- load
def load(path, *, device=None, dtype=None, fp8: bool = False, max_seq_len: int = 4096, max_batch_size: int = 1,
         fp8_lm_head: bool = False, revision: str | None = None, check_weights: bool = True,
         tensor_parallel: int = 1):
    """Load a Hugging Face checkpoint (a directory, or a Hub repo id ``org/name``) into an
    :class:`ember.Model` ready to generate.

    ``dtype`` defaults to the checkpoint's (bf16 for FP8 checkpoints); ``fp8=True`` quantises the
    linear and expert weights to float8_e4m3fn on load. The static KV cache holds ``max_batch_size``
    rows of ``max_seq_len`` tokens. ``fp8_lm_head=True`` (with ``fp8=True`` or an FP8 checkpoint)
    also quantises the lm_head per row, which FP8 checkpoints keep in bf16: half its bytes (a tied
    lm_head gets its own fp8 copy, so memory grows by half the embedding), a faster decode step
    (H200 Qwen3-30B-A3B figures in bench/results/h200/moe.json, fp8 row), and logits with the fp8
    rounding (about 30 dB logit SNR for random weights and rows: a trade the caller chooses).

    A repo id is fetched into (or, with ``HF_HUB_OFFLINE=1``, found in) the Hugging Face cache at
    ``revision`` (default: main); an existing directory of the same name wins.

    ``check_weights`` (default on) rejects NaN / inf in any floating tensor, naming the tensor and
    its file: each tensor is copied to ``device`` as it is read (rather than when the model file
    moves it), one reduction per tensor is queued there, and one sync at the end reads all flags.
    ``check_weights=False`` is the same load without the check, so its cost is the difference of
    the two wall times (``torch.cuda.synchronize()`` after each).

    ``tensor_parallel=N`` (under ``torchrun --nproc-per-node N``, after ``ember.distributed.init()``):
    this process loads and runs only its rank's shard (``ember.distributed``); every rank calls
    ``load`` and ``generate`` alike and gets the same tokens.

    Example:
        >>> model = ember.load("Qwen/Qwen3-30B-A3B", fp8=True, max_seq_len=8192)
        >>> model.generate(["The capital of France is"], max_new_tokens=16)
    """
    from ember.engine import Model
    from ember.engine.tokenizer import load_tokenizer
    for name, v in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    for name, v in (("fp8", fp8), ("fp8_lm_head", fp8_lm_head), ("check_weights", check_weights)):
        if not isinstance(v, bool):
            raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    given = os.fspath(path)
    path = resolve_checkpoint(path, revision)
    cfg = read_config(path)
    module = module_for(cfg.get("model_type"))
    device = check_device(device)
    plan = None
    if tensor_parallel != 1:
        from ember import distributed
        plan = distributed.plan_for(cfg, tensor_parallel)  # the process group has N ranks; cfg splits N ways
        device = distributed.device_for(device, plan.rank)
        if fp8_lm_head:
            raise ValueError("fp8_lm_head: not supported with tensor_parallel > 1 (the lm_head is split by vocabulary)")
    quant = _check_quantization(cfg)
    if fp8_lm_head and not (fp8 or quant):
        raise ValueError("fp8_lm_head: needs fp8=True or an FP8 checkpoint (the lm_head is quantised with the "
                         "other linears)")
    dtype = _resolve_dtype(cfg, dtype, device)
    files = checkpoint_files(path)
    check_layer_count(cfg, files)
    for aux in ("generation_config.json", "tokenizer_config.json"):  # fail before the long part
        if (path / aux).is_file():
            read_json(path / aux)
    _check_memory(device, _tensor_bytes(files, dtype, fp8) // tensor_parallel, "weights")  # a shard: ~1/N
    name = path.name if Path(given).expanduser().is_dir() else given
    with _progress_bar(files if plan is None else {}, name) as progress:
        reader = _Reader(files, device, check_weights, progress)
        if plan is None:
            src = _common.TensorSource(set(files), reader, device, dtype)
        else:  # this rank's slices only; a failure on any rank is raised on every rank
            src, module = distributed.checkpoint_source(plan, set(files), reader, device, dtype), distributed.builder()
        with contextlib.nullcontext() if plan is None else distributed.all_ranks_or_none("loading the shard"):
            net = _build(module, cfg, src, fp8=fp8, max_seq_len=max_seq_len)
            reader.verify()
    check_unused(src, cfg)
    if fp8_lm_head:
        quantize_lm_head(net)
    net.eval()
    cache_bytes = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size()
                      for layer in net.cache_specs(max_batch_size, max_seq_len, dtype) for shape, dt in layer)
    _check_memory(device, cache_bytes, "KV cache and recurrent state")
    # tensor parallel: one seed from rank 0 seeds every rank's seed source (seedless requests agree)
    seed = None if plan is None else distributed.shared_seed(device)
    return Model(net, cfg, load_tokenizer(path), max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                 eos_ids=_eos_ids(path, cfg), fp8=fp8 or bool(quant), name=name, sampling_seed=seed)


def _eos_ids(path: Path, cfg: dict) -> list[int]:
    ids = []
    gen = path / "generation_config.json"
    for source in ([read_json(gen)] if gen.is_file() else []) + [cfg]:
        v = source.get("eos_token_id")
        if v is None:
            continue
        ids.extend(v if isinstance(v, list) else [v])
    return sorted(set(int(i) for i in ids))
