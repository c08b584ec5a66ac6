"""Softmax, log-softmax, argmax and fused temperature / top-k / top-p / min-p sampling.

The sampling semantics (the spec, implemented in float64 by ``sampling_probs_reference``):

1. ``temperature``: ``z = logits / T``; ``T == 0`` means greedy (the first index of the max logit;
   every filter is ignored for that row).
2. ``top_k`` (0 = off): keep every token whose ``z`` is >= the k-th largest ``z`` (ties at the
   threshold are all kept, as Hugging Face's ``TopKLogitsWarper`` does).
3. ``top_p`` (1 = off): on the distribution renormalised over the top-k survivors, keep token ``i``
   iff the probability mass of the tokens *strictly more likely* than ``i`` is < ``top_p``. This is
   the smallest descending-sorted prefix whose cumulative mass reaches ``top_p``, with ties at the
   boundary kept together; the most likely token is always kept.
4. ``min_p`` (0 = off): keep tokens with ``prob >= min_p * max_prob``. The ratio to the max does not
   change under renormalisation, so applying it after top-p is an intersection.
5. draw one token from the survivors, renormalised.

Every parameter is a Python scalar or a per-row tensor of length ``batch``. On CUDA the kernels take
seed/offset from device tensors and never synchronise with the host, so ``sample`` can be captured
in a CUDA graph; pass ``offset`` as an int64 tensor and the kernel advances it by one per call, so
each replay draws fresh numbers.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ember import _dispatch
from ember.ops import _checks

MAX_ROW = 1 << 20
_SEED_MIX = 0x9E3779B97F4A7C15
# what ``sample(advance_seed=True)`` adds to each row's seed after its draw: odd (the golden-ratio
# word as a signed int64), so seed + k * SEED_STEP (mod 2^64) runs through 2^64 keys before repeating
SEED_STEP = _SEED_MIX - (1 << 64)


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling settings the decode engine passes to :func:`sample`.

    ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 switch their filter off;
    ``seed`` None draws from torch's generator.

    Example:
        >>> p = ember.SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
        >>> tok = ember.ops.sample(logits, **p.as_kwargs())
    """
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        _scalar_param("temperature", self.temperature)
        _scalar_param("top_k", self.top_k)
        _scalar_param("top_p", self.top_p)
        _scalar_param("min_p", self.min_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed: expected an int or None, got {type(self.seed).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_kwargs(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- validation
_RANGES = {
    # name: (test, text)
    "temperature": (lambda v: (v >= 0) & (v != float("inf")), "a finite value >= 0"),
    "top_k": (lambda v: v >= 0, "an int >= 0"),
    "top_p": (lambda v: (v > 0) & (v <= 1), "a value in (0, 1]"),
    "min_p": (lambda v: (v >= 0) & (v < 1), "a value in [0, 1)"),
}


def _scalar_param(name, v):
    if name == "top_k":
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"top_k: expected an int or an integer tensor, got {type(v).__name__}")
    elif isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a float or a float tensor, got {type(v).__name__}")
    ok, text = _RANGES[name]
    if v != v or not ok(v):
        raise ValueError(f"{name}: expected {text}, got {v}")
    return v


def _row_param(name, v, batch, device, check):
    """A scalar stays a Python number; a tensor must be 1-d of length ``batch`` on ``device``."""
    if not isinstance(v, torch.Tensor):
        return _scalar_param(name, v)
    if name == "top_k":
        if v.dtype.is_floating_point or v.dtype == torch.bool or v.is_complex():
            raise TypeError(f"top_k: expected an integer tensor, got dtype {str(v.dtype).replace('torch.', '')}")
    elif not v.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating tensor, got dtype {str(v.dtype).replace('torch.', '')}")
    if v.dim() != 1 or v.shape[0] != batch:
        raise ValueError(f"{name}: expected a per-row tensor of shape ({batch},) (logits.shape[0]), got {tuple(v.shape)}")
    if v.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of logits), got {v.device}")
    if check and not _checks.capturing():
        ok, text = _RANGES[name]
        good = ok(v) & (v == v)
        if not bool(good.all()):
            bad = v[~good][0].item()
            raise ValueError(f"{name}: expected {text} in every row, got {bad}")
    return v


# every_row promises: per parameter, (test of a value, what it must be)
_PROMISES = {
    "temperature_only": {"temperature": (lambda v, V: v > 0, "> 0"),
                         "top_k": (lambda v, V: (v == 0) | (v >= V), "0 or >= the vocab size (off)"),
                         "top_p": (lambda v, V: v >= 1, "1 (off)"),
                         "min_p": (lambda v, V: v == 0, "0 (off)")},
    "top_k": {"temperature": (lambda v, V: v > 0, "> 0"),
              "top_k": (lambda v, V: (v > 0) & (v < V), "in [1, vocab size)")},
}


def _validate_every_row(every_row, params: dict, V: int, check: bool) -> None:
    """``every_row`` names a promise about every row's parameters; scalars are checked always, per-row
    tensors when ``check`` (a device sync) and not capturing."""
    if every_row is None:
        return
    if every_row not in _PROMISES:
        raise ValueError(f"every_row: expected None, 'temperature_only' or 'top_k', got {every_row!r}")
    for name, (ok, text) in _PROMISES[every_row].items():
        v = params[name]
        if isinstance(v, torch.Tensor):
            if not check or _checks.capturing():
                continue
            good = ok(v, V)
            if bool(good.all()):
                continue
            row = int((~good).nonzero()[0, 0])
            bad = v[row].item()
        elif ok(v, V):
            continue
        else:
            row, bad = None, v
        where = "" if row is None else f" (row {row})"
        raise ValueError(f"every_row={every_row!r}: expected {name} {text} in every row, got {bad}{where}")


def _validate_logits(logits, check):
    _checks.tensor("logits", logits, dtypes=_checks.FLOAT_DTYPES, ndim=2)
    B, V = logits.shape
    if not 1 <= V <= MAX_ROW:
        raise ValueError(f"logits: expected vocab size (last dim) in [1, {MAX_ROW}], got {V}")
    if check and not _checks.capturing() and B > 0:
        if bool(torch.isnan(logits).any()):
            raise ValueError("logits: expected no NaN, got NaN")
        if bool(torch.isposinf(logits).any()):
            raise ValueError("logits: expected no +inf, got +inf")
        all_neg_inf = torch.isneginf(logits).all(dim=-1)
        if bool(all_neg_inf.any()):
            row = int(all_neg_inf.nonzero()[0, 0])
            raise ValueError(f"logits: expected at least one finite value per row, got a row of all -inf (row {row})")


def _validate_seed(seed, offset, device):
    for name, v in (("seed", seed), ("offset", offset)):
        if v is None:
            continue
        if isinstance(v, torch.Tensor):
            if v.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name}: expected an int64 tensor, got dtype {str(v.dtype).replace('torch.', '')}")
            if v.device != device:
                raise ValueError(f"{name}: expected device {device} (the device of logits), got {v.device}")
            if name == "offset" and v.numel() != 1:
                raise ValueError(f"offset: expected a one-element tensor (one counter for the batch), got shape "
                                 f"{tuple(v.shape)}; for a stream per row, pass per-row seeds that change every "
                                 "step (e.g. request seed + position * an odd constant): a per-row seed is its "
                                 "row's whole key")
        elif isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int or an int64 tensor, got {type(v).__name__}")
    if offset is not None and seed is None:
        raise ValueError("offset: expected seed to be given with it, got seed=None")


def _validate_advance_seed(advance_seed, seed, batch):
    if not isinstance(advance_seed, bool):
        raise TypeError(f"advance_seed: expected a bool, got {type(advance_seed).__name__}")
    if not advance_seed:
        return
    if not isinstance(seed, torch.Tensor):
        raise ValueError(f"advance_seed: expected seed to be an int64 tensor of one seed per row to advance, got "
                         f"seed={seed!r}")
    if seed.dtype != torch.int64 or seed.numel() != batch or not seed.is_contiguous():
        raise ValueError(f"advance_seed: expected seed to be a contiguous int64 tensor of {batch} (logits.shape[0]) "
                         f"elements, got dtype {str(seed.dtype).replace('torch.', '')}, shape {tuple(seed.shape)}"
                         f"{'' if seed.is_contiguous() else ', not contiguous'}")


def _softmax_args(x, dim, temperature):
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected a value in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-d tensor, got {dim}")
    if x.shape[dim] > MAX_ROW:
        raise ValueError(f"x: expected size <= {MAX_ROW} along dim {dim}, got {x.shape[dim]}")
    if temperature is not None:
        temperature = _checks.positive_float("temperature", temperature)
    return dim % x.dim(), temperature


# ----------------------------------------------------------------------------- references
def softmax_reference(x: torch.Tensor, dim: int = -1, temperature: float | None = None) -> torch.Tensor:
    """float32 softmax of ``x / temperature`` (the spec for the kernel)."""
    xf = x.float() if temperature is None else x.float() / temperature
    return torch.softmax(xf, dim=dim)


def log_softmax_reference(x: torch.Tensor, dim: int = -1, temperature: float | None = None) -> torch.Tensor:
    xf = x.float() if temperature is None else x.float() / temperature
    return torch.log_softmax(xf, dim=dim)


def argmax_reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.argmax(x, dim=dim)


def _as_column(v, batch, dtype) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach().to(device="cpu", dtype=dtype).reshape(batch, 1)
    return torch.full((batch, 1), v, dtype=dtype)


def sampling_probs_reference(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0,
                             min_p=0.0) -> torch.Tensor:
    """The distribution ``sample`` draws from, in float64 with a full sort: the executable spec.

    Returns float64 probabilities ``[batch, vocab]`` on the CPU; greedy rows (T = 0) are one-hot at
    the first maximum.
    """
    B, V = logits.shape
    x = logits.detach().double().cpu()
    T = _as_column(temperature, B, torch.float64)
    K = _as_column(top_k, B, torch.int64)
    P = _as_column(top_p, B, torch.float64)
    MP = _as_column(min_p, B, torch.float64)
    greedy = T == 0
    z = x / torch.where(greedy, torch.ones_like(T), T)
    # top-k: everything >= the k-th largest value survives (ties kept)
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    k = torch.where((K <= 0) | (K > V), torch.full_like(K, V), K)
    kth = sorted_z.gather(1, k - 1)
    keep = z >= kth
    # top-p on the distribution renormalised over the top-k survivors
    probs = torch.softmax(torch.where(keep, z, -math.inf), dim=-1)
    sp = probs.gather(1, order)                                # probs in descending-z order
    mass_above = torch.cumsum(sp, dim=-1) - sp                 # mass strictly before, in sorted order
    # strictly more likely tokens only: for a tie group, use the mass before the group's first member
    same_as_prev = torch.cat([torch.zeros(B, 1, dtype=torch.bool), sorted_z[:, 1:] == sorted_z[:, :-1]], dim=1)
    group_start = torch.cummax(torch.where(same_as_prev, 0, torch.arange(V).expand(B, V)), dim=-1).values
    mass_above = mass_above.gather(1, group_start)
    keep_sorted = (mass_above < P) | (P >= 1)
    keep &= torch.zeros_like(keep).scatter(1, order, keep_sorted)
    # min-p relative to the most likely token (unchanged by renormalisation)
    pmax = probs.max(dim=-1, keepdim=True).values
    keep &= probs >= MP * pmax
    out = torch.softmax(torch.where(keep, z, -math.inf), dim=-1)
    first_max = torch.argmax(x, dim=-1, keepdim=True)
    one_hot = torch.zeros_like(out).scatter(1, first_max, 1.0)
    return torch.where(greedy, one_hot, out)


def _mixed_seed(seed: int, offset: int, row: int) -> int:
    h = (seed * _SEED_MIX + offset * 0xBF58476D1CE4E5B9 + row * 0x94D049BB133111EB) & ((1 << 63) - 1)
    return h


def sample_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, offset=None,
                     generator=None, advance_seed: bool = False) -> torch.Tensor:
    """Draw from ``sampling_probs_reference`` with torch.multinomial (int64 [batch] on logits.device).

    With one ``seed``, row ``r`` draws from a generator seeded by (seed, offset, r); with a per-row
    seed tensor, by (seed[r], offset) alone; a tensor ``offset`` is advanced by one, and with
    ``advance_seed`` each seed by SEED_STEP (wrapping at 2^64), as the kernel does.
    """
    B = logits.shape[0]
    probs = sampling_probs_reference(logits, temperature, top_k, top_p, min_p)
    if seed is None:
        out = torch.multinomial(probs, 1, generator=generator).view(B) if B else torch.empty(0, dtype=torch.int64)
    else:
        seeds = seed.reshape(-1).tolist() if isinstance(seed, torch.Tensor) else [seed]
        off = int(offset.reshape(-1)[0]) if isinstance(offset, torch.Tensor) else int(offset or 0)
        out = torch.empty(B, dtype=torch.int64)
        for r in range(B):  # a per-row seed keys its row alone (as in the kernel): the index is not mixed in
            g = torch.Generator().manual_seed(_mixed_seed(int(seeds[r if len(seeds) > 1 else 0]), off,
                                                          0 if len(seeds) > 1 else r))
            out[r] = torch.multinomial(probs[r], 1, generator=g)[0]
    if isinstance(offset, torch.Tensor):
        offset.add_(1)
    if advance_seed:
        seed.add_(SEED_STEP)
    return out.to(logits.device)


# ----------------------------------------------------------------------------- implementation
def _softmax_impl(x: torch.Tensor, dim: int, temperature: float | None, log: bool) -> torch.Tensor:
    if not _dispatch.use_triton(x):
        return (log_softmax_reference if log else softmax_reference)(x, dim, temperature)
    xm = x.movedim(dim, -1)
    out = torch.empty(xm.shape, dtype=torch.float32, device=x.device)
    if out.numel():
        _dispatch.prepare_triton()
        from ember.kernels import sampling as kernels
        kernels.softmax(_checks.rows_2d(xm), out.view(-1, xm.shape[-1]), 1.0 if temperature is None else temperature,
                        log)
    return out.movedim(-1, dim)


def _argmax_impl(x: torch.Tensor, dim: int) -> torch.Tensor:
    if not _dispatch.use_triton(x):
        return argmax_reference(x, dim)
    xm = x.movedim(dim, -1)
    out = torch.empty(xm.shape[:-1], dtype=torch.int64, device=x.device)
    if out.numel():
        _dispatch.prepare_triton()
        from ember.kernels import sampling as kernels
        kernels.argmax(_checks.rows_2d(xm), out.view(-1))
    return out


def _sample_impl(logits, temperature, top_k, top_p, min_p, seed, offset, generator, every_row=None,
                 advance_seed=False):
    if not _dispatch.use_triton(logits):
        return sample_reference(logits, temperature, top_k, top_p, min_p, seed, offset, generator, advance_seed)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0] == 0:
        return out
    if seed is None:
        # a fresh seed from torch's generator, on the device: no host sync, and graph-safe (each
        # replay of a captured graph advances the generator's philox offset)
        seed = torch.randint(0, 1 << 62, (1,), device=logits.device, generator=generator)
    _dispatch.prepare_triton()
    from ember.kernels import sampling as kernels
    kernels.sample(_checks.rows_2d(logits), out, temperature, top_k, top_p, min_p, seed, offset, every_row,
                   advance_seed)
    return out


# ----------------------------------------------------------------------------- registration
# torch.compile sees these custom ops; eager calls go straight to the implementation (the custom-op
# wrapper costs host time on every call, see ARCHITECTURE.md "Registration overhead").
@torch.library.custom_op("ember::softmax", mutates_args=())
def _softmax_op(x: torch.Tensor, dim: int, temperature: float, log: bool) -> torch.Tensor:
    return _softmax_impl(x, dim, None if temperature <= 0 else temperature, log).contiguous()


@_softmax_op.register_fake
def _(x, dim, temperature, log):
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


@torch.library.custom_op("ember::argmax", mutates_args=())
def _argmax_op(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _argmax_impl(x, dim).contiguous()


@_argmax_op.register_fake
def _(x, dim):
    shape = list(x.shape)
    del shape[dim]
    return torch.empty(shape, dtype=torch.int64, device=x.device)


@torch.library.custom_op("ember::sample", mutates_args=("seed", "offset"))
def _sample_op(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, every_row: str,
               advance_seed: bool) -> torch.Tensor:
    return _sample_impl(logits, temperature, top_k, top_p, min_p, seed, offset, None, every_row or None, advance_seed)


@_sample_op.register_fake
def _(logits, temperature, top_k, top_p, min_p, seed, offset, every_row, advance_seed):
    return torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)


def _as_tensor(v, batch, dtype, device):
    if isinstance(v, torch.Tensor):
        return v
    return torch.full((batch,), v, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- public API
def softmax(x: torch.Tensor, dim: int = -1, *, temperature: float | None = None) -> torch.Tensor:
    """``softmax(x / temperature)`` along ``dim``, float32 output for fp32/bf16/fp16 input.

    Rows up to 2^20 elements; long rows (> 16384) are split across many programs on the GPU in ONE
    launch that reads the input once: a grid barrier when all the rows' programs fit on the GPU at
    once, else persistent programs that walk the rows in waves with a barrier per row
    (ember/kernels/sampling/). No value
    checks are needed: a program that ever stops waiting at a barrier recomputes its row, so the
    output stays exact.

    Example:
        >>> probs = ember.ops.softmax(torch.randn(2, 128256), temperature=0.7)
    """
    dim, temperature = _softmax_args(x, dim, temperature)
    if _dispatch.compiling():
        return _softmax_op(x, dim, temperature or 0.0, False)
    return _softmax_impl(x, dim, temperature, False)


def log_softmax(x: torch.Tensor, dim: int = -1, *, temperature: float | None = None) -> torch.Tensor:
    """``log_softmax(x / temperature)`` along ``dim``, float32 output.

    Example:
        >>> logp = ember.ops.log_softmax(torch.randn(2, 32000))
    """
    dim, temperature = _softmax_args(x, dim, temperature)
    if _dispatch.compiling():
        return _softmax_op(x, dim, temperature or 0.0, True)
    return _softmax_impl(x, dim, temperature, True)


def argmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Index of the max along ``dim`` (int64), the first one on ties, as torch.argmax.

    NaN counts as larger than every number (the first NaN wins), as in torch.argmax. Long rows
    take one launch on the GPU, with a small persistent per-device workspace that each call leaves
    clean (so it is CUDA-graph safe; calls on two streams of one device must not run concurrently).

    Example:
        >>> ember.ops.argmax(torch.tensor([[1.0, 3.0, 3.0]]))
        tensor([1])
    """
    dim, _ = _softmax_args(x, dim, None)
    if x.shape[dim] == 0:
        raise ValueError(f"x: expected a non-empty dim {dim}, got size 0")
    if _dispatch.compiling():
        return _argmax_op(x, dim)
    return _argmax_impl(x, dim)


def sample(logits: torch.Tensor, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, offset=None,
           generator: torch.Generator | None = None, check: bool = True, every_row: str | None = None,
           advance_seed: bool = False) -> torch.Tensor:
    """Draw one token per row of ``logits [batch, vocab]``: int64 ``[batch]``.

    Filters apply in the order temperature, top-k, top-p, min-p (module docstring has the exact
    semantics); each parameter is a Python scalar or a per-row tensor of shape ``[batch]``.
    ``temperature=0`` is greedy. Randomness: ``seed`` (int, or int64 tensor of 1 or ``batch``
    elements) with ``offset`` (int, or one-element int64 tensor that each call advances by one, so
    a captured CUDA graph draws fresh numbers on every replay); without ``seed``, a seed is drawn
    from ``generator`` (or torch's default) on the device. One seed for the batch is mixed with the
    row index (rows draw apart); a per-row seed keys its row alone, so a row's draw does not depend
    on where it sits in the batch (the engine's per-request seeds rely on this).
    ``advance_seed=True`` (per-row seed tensor, int64, one per row): after its draw each row's seed
    becomes seed + ``SEED_STEP`` (mod 2^64), written by the kernel itself, so a captured graph's next
    replay draws each row's next token without a launch of its own.

    ``check=True`` validates values that need a device sync (NaN / +inf logits, all -inf rows,
    per-row parameter ranges); it is skipped automatically during CUDA-graph capture and under
    torch.compile, and ``check=False`` skips it always. Scalar parameters and shapes are always checked.

    Speed (GPU kernels): the thresholds come from a short candidate list, so top-k (k <= the row's
    chunk count, 126 at vocab 128256) and top-p with a small nucleus cost microseconds; top-k above
    that count, or top-p alone on a flat row whose nucleus the list cannot hold, fall back to an
    exact search over the row by one program (H200, 128256: ~0.7 ms). Adding a top_k bound to a
    top-p setting keeps it on the fast path.

    ``every_row``: what per-row tensors are known to hold, so the GPU kernel takes the path scalars
    would select without reading them on the host: ``"temperature_only"`` (every row t > 0, top-k
    off, top-p 1, min-p 0: the barrier-free race) or ``"top_k"`` (every row t > 0 and
    0 < top_k < vocab: the tagged top-k path). The tokens are the same with or without it; a
    promise the values break raises ``ValueError`` (scalars always, tensors when ``check``).

    Example:
        >>> seed, offset = torch.tensor([1234]), torch.zeros(1, dtype=torch.int64)
        >>> tokens = ember.ops.sample(torch.randn(4, 32000), temperature=0.7, top_k=50, top_p=0.9,
        ...                           seed=seed, offset=offset)
    """
    check = check and not _dispatch.compiling()  # value checks are data-dependent: not traceable
    _validate_logits(logits, check)
    B, dev = logits.shape[0], logits.device
    temperature = _row_param("temperature", temperature, B, dev, check)
    top_k = _row_param("top_k", top_k, B, dev, check)
    top_p = _row_param("top_p", top_p, B, dev, check)
    min_p = _row_param("min_p", min_p, B, dev, check)
    _validate_every_row(every_row, dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                        logits.shape[1], check)
    _validate_seed(seed, offset, dev)
    if isinstance(seed, torch.Tensor) and seed.numel() not in (1, B):
        raise ValueError(f"seed: expected 1 or {B} (logits.shape[0]) elements, got shape {tuple(seed.shape)}")
    _validate_advance_seed(advance_seed, seed, B)
    if _dispatch.compiling():
        seed_t = seed if seed is None or isinstance(seed, torch.Tensor) else torch.tensor([seed], device=dev)
        if seed_t is None:
            seed_t = torch.randint(0, 1 << 62, (1,), device=dev, generator=generator)
        # the registered op takes plain tensors: inductor cannot lower a mutated Optional[Tensor]
        # ("getitem is not an OpOverload"), so a missing offset becomes a fresh zero counter
        offset_t = offset if isinstance(offset, torch.Tensor) else torch.tensor([offset or 0], dtype=torch.int64, device=dev)
        return _sample_op(logits, _as_tensor(temperature, B, torch.float32, dev), _as_tensor(top_k, B, torch.int64, dev),
                          _as_tensor(top_p, B, torch.float32, dev), _as_tensor(min_p, B, torch.float32, dev),
                          seed_t, offset_t, every_row or "", advance_seed)
    return _sample_impl(logits, temperature, top_k, top_p, min_p, seed, offset, generator, every_row, advance_seed)
