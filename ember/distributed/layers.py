"""Modules a shard's layers are made of: the model's own blocks, with a sum over the ranks where a
block's output is split into partial sums (o_proj, the dense down projection, the routed experts)
and a gather where it is split over the vocabulary (lm_head).

Expert parallel by reduce, not all-to-all: at decode (batch 1-16) every rank already holds the token's
hidden row, the router is replicated, so each rank runs its own experts on the row and one
all-reduce of [B, H] (8 KB a token in bf16) sums the partial outputs. The all-to-all form sends
each token's row to the ranks owning its experts and the outputs back: two collectives instead of
one, both latency-bound at these sizes, plus the sorting. The reduce also merges with nothing else:
attention's o_proj and the MoE each end in one all-reduce, two a layer.

Example:
    >>> layer.attn.o = RowParallel(layer.attn.o)     # o_proj [H, NH/N * D], partial sums reduced
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import _group

moe_ops = importlib.import_module("ember.ops.moe")


class RowParallel(nn.Module):
    """A linear whose input columns are split over the ranks: its output is this rank's partial sum,
    summed over the ranks in place (``all_reduce``; a captured NCCL kernel in the decode graph)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _group.all_reduce(self.inner(x))


class VocabParallelHead(nn.Module):
    """lm_head over this rank's vocabulary rows ``[v0, v0 + V/N)``; the logits of every rank are
    gathered, so ``forward`` returns the full ``[..., V]`` the engine samples from (one all-gather of
    B x V/N logits a step: 152 KB at batch 1 for Qwen3's vocabulary at tp 2 in bf16)."""

    def __init__(self, inner: nn.Module, vocab_start: int):
        super().__init__()
        self.inner, self.vocab_start = inner, vocab_start

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _group.all_gather_last(self.inner(x))


def local_routes(topk_weights: torch.Tensor, topk_ids: torch.Tensor, e0: int, n_local: int):
    """Routing over all experts -> routing over this rank's experts ``[e0, e0 + n_local)``.

    A slot routed elsewhere keeps weight 0 and points at an expert this rank reads anyway (the token's
    first local expert, or local expert 0 when it has none), so it adds exactly zero and, in the decode
    kernels, reads no weights beyond those of the token's own local experts (at worst one expert).
    Returns ``(weights float32 [T, k], local ids int32 [T, k])``.

    Example:
        >>> w, ids = local_routes(torch.tensor([[0.75, 0.25]]), torch.tensor([[5, 1]], dtype=torch.int32), 4, 4)
        >>> w.tolist(), ids.tolist()
        ([[0.75, 0.0]], [[1, 1]])
    """
    mine = (topk_ids >= e0) & (topk_ids < e0 + n_local)                      # [T, k]
    local = torch.where(mine, topk_ids - e0, 0).to(torch.int32)
    first = local.gather(1, mine.to(torch.int8).argmax(1, keepdim=True))     # [T, 1]
    return torch.where(mine, topk_weights, 0.0), torch.where(mine, local, first)


class ShardedMoe(nn.Module):
    """Qwen3-MoE's sparse block on one rank: replicated router over all E experts, this rank's E/N
    experts, partial outputs all-reduced. It has the ``add_norm_forward`` fold of
    ``qwen3_moe.SparseMoe`` (post-attention norm in the router's launch) but not the prescaled one:
    the next layer's residual is the reduced sum, which no single rank's epilogue sees."""

    def __init__(self, router: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
                 renormalize: bool, expert_start: int, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None):
        super().__init__()
        self.router = nn.Parameter(router, requires_grad=False)              # [E, H], every expert
        self.w_gate_up = nn.Parameter(w_gate_up, requires_grad=False)        # [E/N, 2I, H], this rank's
        self.w_down = nn.Parameter(w_down, requires_grad=False)              # [E/N, H, I]
        self.gate_up_scale = None if gate_up_scale is None else nn.Parameter(gate_up_scale, requires_grad=False)
        self.down_scale = None if down_scale is None else nn.Parameter(down_scale, requires_grad=False)
        self.top_k, self.renormalize, self.expert_start = top_k, renormalize, expert_start

    def _experts(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w, ids = local_routes(w, ids, self.expert_start, self.w_gate_up.shape[0])
        y = moe_ops.moe_experts(x, self.w_gate_up, self.w_down, w, ids, gate_up_scale=self.gate_up_scale,
                                down_scale=self.down_scale, check=False)  # ids: in range by construction
        return _group.all_reduce(y)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, h.shape[-1])                                       # [T, H]
        if x.shape[0] <= moe_ops.DECODE_MAX_TOKENS:
            w, ids = moe_ops.moe_route_hidden(x, self.router, self.top_k, renormalize=self.renormalize)
        else:
            w, ids = moe_ops.moe_route(F.linear(x, self.router), self.top_k, renormalize=self.renormalize)
        return self._experts(x, w, ids).reshape(h.shape)

    def add_norm_forward(self, a: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float):
        """``forward(add_rmsnorm(a, residual))`` with the norm in the router's launch (decode); None
        above DECODE_MAX_TOKENS tokens (the caller runs the norm and ``forward``)."""
        x = a.reshape(-1, a.shape[-1])
        if x.shape[0] > moe_ops.DECODE_MAX_TOKENS:
            return None
        normed, new_res, w, ids = moe_ops.add_rmsnorm_route_hidden(x, residual.reshape(x.shape), norm_weight,
                                                                   self.router, self.top_k, eps=eps,
                                                                   renormalize=self.renormalize)
        return self._experts(normed, w, ids).reshape(a.shape), new_res.reshape(a.shape)
