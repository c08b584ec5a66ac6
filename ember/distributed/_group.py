"""The process group ember runs on: torch.distributed, set up from torchrun's environment by torch's
own ``init_method="env://"`` (ember reads no variable itself), and the collectives the shard modules
call.

NCCL's NVLink multicast (NVLS) and torch's symmetric-memory multicast are switched off for this
process and its children before NCCL starts (``ember._switches.set_process_env``): on the shared
H200 hosts a program that uses multicast can take the GPUs out of service. No multimem op is used.

Collectives run with the group's timeout (``init(timeout_s=...)``), so a rank that dies makes the
others raise instead of waiting for ever; :func:`all_ranks_or_none` turns an error on one rank
(a damaged shard, a bad config) into the same error on every rank.

CUDA graphs: ``dist.all_reduce`` / ``all_gather_into_tensor`` on an NCCL group are capturable (the
NCCL kernels are recorded on the capturing stream's side stream and replayed with the graph), so the
engine's decode graph holds the collectives as long as every rank captures and replays in lockstep,
which SPMD generate does. Not testable here (CPU, gloo): the H200 x2 / x4 runs cover it.
"""
from __future__ import annotations

import contextlib
import datetime
import random
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ember import _switches

DEFAULT_TIMEOUT_S = 600  # a 235B shard loads in minutes; collectives of a live decode take microseconds
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def disable_multicast() -> None:
    """Keep NCCL's NVLink multicast and torch's symmetric-memory multicast off for this process and
    the processes it starts (set before NCCL initialises; a value already set by the user stays)."""
    for name, value in _NO_MULTICAST.items():
        _switches.set_process_env(name, value)


def init(backend: str | None = None, *, init_method: str = "env://", rank: int | None = None,
         world_size: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Initialise torch.distributed once and return ``(rank, world_size)``.

    Under ``torchrun`` call it with no arguments: torch reads RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT itself (``env://``). ``backend`` defaults to ``"nccl"`` when CUDA is available, else
    ``"gloo"``; with NCCL each process takes GPU ``rank % device_count`` (one process a GPU, one host).
    Tests pass ``init_method="file://..."`` with ``rank`` and ``world_size``.

    Example:
        >>> import ember.distributed as ed
        >>> rank, world = ed.init()          # torchrun --nproc-per-node 2 script.py
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'nccl' or 'gloo', got {backend!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a number of seconds > 0, got {timeout_s!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend: 'nccl' needs CUDA GPUs, and none is visible (use 'gloo' on CPU)")
        disable_multicast()
    kw = {} if rank is None else {"rank": rank}
    if world_size is not None:
        kw["world_size"] = world_size
    dist.init_process_group(backend, init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    r, w = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(r % torch.cuda.device_count())
    return r, w


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default group; (0, 1) when there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def require(tensor_parallel: int) -> tuple[int, int]:
    """``(rank, world_size)`` for ``load(tensor_parallel=N)``: a ValueError naming the argument when
    no process group is initialised or its size is not N."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel: expected a positive int, got {tensor_parallel!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"tensor_parallel={tensor_parallel}: no torch.distributed process group is initialised; "
                         "launch with `torchrun --nproc-per-node N` and call ember.distributed.init() first")
    w = dist.get_world_size()
    if w != tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel}: the process group has {w} rank(s); expected "
                         f"{tensor_parallel} (torchrun --nproc-per-node {tensor_parallel})")
    return dist.get_rank(), w


def shared_seed(device: torch.device) -> int:
    """A random 62-bit int drawn on rank 0 and broadcast to every rank (one tiny collective): what
    seeds a tensor-parallel Model's seed source, so a request without a seed draws the same seed, and
    so the same tokens, on every rank. One process: a fresh draw.

    Example:
        >>> model.seed_source = random.Random(shared_seed(model.device))
    """
    value = random.SystemRandom().getrandbits(62)
    if world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)  # NCCL broadcasts device tensors only
    dist.broadcast(t, src=0)
    return int(t.item())


def device_for(device: torch.device, rank: int) -> torch.device:
    """This rank's device: ``cuda`` without an index becomes ``cuda:rank % device_count``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


@contextlib.contextmanager
def all_ranks_or_none(what: str = "the block") -> Iterator[None]:
    """Run the block on every rank; if it raises on any rank, every rank raises a RuntimeError naming
    the failing rank(s) and their errors (one all_gather of the outcome, so the ranks that succeeded
    do not wait in a later collective for a rank that has given up).

    Example:
        >>> with all_ranks_or_none("loading the shard"):
        ...     net = build()
    """
    error = None
    try:
        yield
    except Exception as e:  # reported to every rank below, then re-raised here with the others'
        error = e
    rank, w = world()
    if w == 1:
        if error is not None:
            raise error
        return
    outcomes: list = [None] * w
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, msg) for r, msg in enumerate(outcomes) if msg is not None]
    if failed:
        text = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise RuntimeError(f"{what} failed on {len(failed)} of {w} rank(s): {text}") from error


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (returns ``x``); a no-op for one rank."""
    if world()[1] > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n]`` of every rank concatenated along the last dim -> ``[..., world * n]`` (rank order)."""
    w = world()[1]
    if w == 1:
        return x
    flat = x.reshape(-1)  # 1-D in and out: the layout NCCL and gloo both take
    out = torch.empty(w * flat.numel(), dtype=x.dtype, device=x.device)
    _GATHER(out, flat.contiguous())
    return out.view(w, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], w * x.shape[-1])


# torch >= 2.12 names it all_gather_single (all_gather_into_tensor warns there); 2.11 has only the old name
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
