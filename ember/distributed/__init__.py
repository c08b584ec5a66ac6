"""Several GPUs: tensor- and expert-parallel Qwen3-MoE decode over torch.distributed (NCCL on GPUs,
gloo on CPU), one process a GPU, launched by ``torchrun``.

Every rank runs the same program (SPMD): it loads only its shard of the safetensors
(``ember.load(path, tensor_parallel=N)``), and every decode step runs on every rank with two
all-reduces a layer (attention's o_proj, the MoE's partial sums) and one all-gather of the logits,
so every rank samples the same token. The shard plan (:mod:`ember.distributed.plan`) says which
rows a rank holds; :mod:`ember.distributed.layers` has the modules with the collectives;
:mod:`ember.distributed.source` reads slices (``safetensors`` ``get_slice``) or makes random ones.

Example (``torchrun --nproc-per-node 2 run.py``):
    >>> import ember, ember.distributed as ed
    >>> rank, world = ed.init()                  # NCCL, multicast off, GPU rank % device_count
    >>> model = ember.load("Qwen/Qwen3-235B-A22B-FP8", tensor_parallel=world)
    >>> out = model.generate(["The capital of France is"], max_new_tokens=16)   # same on every rank
"""
from __future__ import annotations

import torch

from ember.distributed._group import (DEFAULT_TIMEOUT_S, all_gather_last, all_ranks_or_none, all_reduce,
                                      device_for, disable_multicast, init, require, shared_seed, world)
from ember.distributed.plan import ShardPlan, Slice
from ember.distributed.source import ShardSource, checkpoint_shapes, random_fetch, take

__all__ = ["DEFAULT_TIMEOUT_S", "ShardPlan", "ShardSource", "Slice", "all_gather_last", "all_ranks_or_none",
           "all_reduce", "builder", "checkpoint_source", "device_for", "disable_multicast", "init", "plan_for",
           "random_shard", "require", "shared_seed", "world"]


def plan_for(cfg: dict, tensor_parallel: int) -> ShardPlan:
    """This rank's plan for ``load(tensor_parallel=N)``: the process group must be initialised with
    N ranks and the config must split N ways (ValueErrors naming the argument or the config key)."""
    from ember.distributed.build import check_model_type
    rank, w = require(tensor_parallel)
    check_model_type(cfg)
    return ShardPlan.from_config(cfg, rank, w)


def builder():
    """The module whose ``build(src, cfg, *, fp8, max_seq_len)`` builds a rank's net (what
    ``ember.load`` calls in place of the model family's own ``build``)."""
    from ember.distributed import build
    return build


def checkpoint_source(plan: ShardPlan, names: set[str], reader, device, dtype) -> ShardSource:
    """A ShardSource over a checkpoint: ``reader(name)`` reads a whole tensor, ``reader(name, part)``
    calls ``part`` on the tensor's safetensors slice handle (``ember.loading``'s reader)."""
    def fetch_slice(name: str, s: Slice | None) -> torch.Tensor:
        if s is None:
            return reader(name)
        return reader(name, lambda handle: take(handle, s, tuple(handle.get_shape()), name))
    return ShardSource(plan, names, fetch_slice, device, dtype)


def random_shard(cfg: dict, plan: ShardPlan, *, device, dtype: torch.dtype = torch.bfloat16, fp8: bool = False,
                 max_seq_len: int = 4096, seed: int = 0):
    """This rank's net of a Qwen3-MoE of config ``cfg`` with random weights made on ``device`` (no
    checkpoint anywhere): what ``ember bench moe_tp`` runs at full size. ``fp8`` builds the HF FP8
    layout (e4m3 weights, 128x128 block scales), so the load path's FP8 branch is the one timed.

    Example:
        >>> net = random_shard(cfg, ShardPlan.from_config(cfg, rank, world), device=torch.device("cuda", rank))
    """
    from ember.distributed import build
    build.check_model_type(cfg)
    shapes = checkpoint_shapes(cfg, fp8=fp8)
    src = ShardSource(plan, set(shapes), random_fetch(shapes, device, dtype, seed), device, dtype)
    with torch.no_grad():
        return build.build(src, cfg, fp8=False, max_seq_len=max_seq_len)
