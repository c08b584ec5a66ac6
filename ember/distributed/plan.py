"""The shard plan: which slice of every Qwen3-MoE tensor a rank holds, from config.json and the
world size alone (every rank computes the same plan; no communication).

* Attention (tensor parallel): rank r holds query heads ``[r * NH/N, (r+1) * NH/N)``, the matching
  rows of q_proj and the matching columns of o_proj (o_proj's partial sums are all-reduced). Its KV
  heads are the ones those query heads read: ``KVH/N`` of them when N divides KVH, else (N a
  multiple of KVH) one KV head, replicated on N/KVH ranks. Qwen3-235B-A22B (64 Q / 4 KV heads): tp 2
  holds 32 Q + 2 KV heads a rank, tp 4 16 + 1, tp 8 8 + 1 (each KV head on two ranks).
* Experts (expert parallel): rank r holds experts ``[r * E/N, (r+1) * E/N)``; the router is
  replicated, every rank routes every token, runs only its own experts (weight 0 for the others) and
  the partial outputs are all-reduced (see ``ember.distributed.layers.ShardedMoe`` for why a reduce).
* Dense MLP layers: gate/up rows and down columns split over N, down's partial sums all-reduced.
* lm_head: vocabulary rows split over N, logits gathered. The embedding is replicated (a decode step
  reads one row of it, so splitting it would save memory only and cost one more collective a step).
* Norms and the router: replicated.

Example:
    >>> plan = ShardPlan.from_config(cfg, rank=1, world_size=2)
    >>> plan.heads, plan.kv_heads, plan.experts
    ((32, 64), (2, 4), (64, 128))
"""
from __future__ import annotations

import dataclasses
import re

BLOCK = 128  # HF fine-grained FP8: one weight_scale_inv entry per 128 x 128 block

# tensor name (after model.layers.N.) -> (dim split, what it is split by)
_ATTN = re.compile(r"^model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias|weight_scale_inv)$")
_DENSE = re.compile(r"^model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_STACKED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)$")


@dataclasses.dataclass(frozen=True)
class Slice:
    """Rows ``[start, stop)`` of dimension ``dim`` of a tensor whose full size there is ``full``."""
    dim: int
    start: int
    stop: int
    full: int


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    vocab_size: int
    intermediate_size: int | None  # dense MLP layers; None when the model has none

    @classmethod
    def from_config(cls, cfg: dict, rank: int, world_size: int) -> "ShardPlan":
        """The plan for ``rank`` of ``world_size``; a ValueError naming the config key that does not split."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"tensor_parallel: expected a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < {world_size}, got {rank!r}")
        nh = cfg["num_attention_heads"]
        kvh = cfg.get("num_key_value_heads", nh)
        e = cfg.get("num_experts", cfg.get("num_local_experts"))
        inter = cfg.get("intermediate_size") if _has_dense_layers(cfg) else None
        plan = cls(rank, world_size, nh, kvh, cfg.get("head_dim") or cfg["hidden_size"] // nh, e,
                   cfg["vocab_size"], inter)
        plan._check()
        return plan

    def _check(self) -> None:
        n = self.world_size
        need = [("num_attention_heads", self.num_heads), ("num_experts", self.num_experts),
                ("vocab_size", self.vocab_size)]
        if self.intermediate_size is not None:
            need.append(("intermediate_size", self.intermediate_size))
        for key, v in need:
            if not isinstance(v, int) or v % n:
                raise ValueError(f"tensor_parallel={n}: config.json {key}={v!r} does not split into {n} equal "
                                 "parts (it must be a multiple of tensor_parallel)")
        kvh = self.num_kv_heads
        if kvh % n and n % kvh:
            raise ValueError(f"tensor_parallel={n}: config.json num_key_value_heads={kvh} neither splits into {n} "
                             f"parts nor replicates evenly over {n} ranks (one must divide the other)")

    # ------------------------------------------------------------------ what this rank holds
    @property
    def heads(self) -> tuple[int, int]:
        """Query heads ``[start, stop)``."""
        k = self.num_heads // self.world_size
        return self.rank * k, (self.rank + 1) * k

    @property
    def kv_heads(self) -> tuple[int, int]:
        """KV heads ``[start, stop)``: the ones this rank's query heads read."""
        k = max(self.num_kv_heads // self.world_size, 1)
        start = self.rank * self.num_kv_heads // self.world_size
        return start, start + k

    @property
    def experts(self) -> tuple[int, int]:
        k = self.num_experts // self.world_size
        return self.rank * k, (self.rank + 1) * k

    @property
    def vocab(self) -> tuple[int, int]:
        k = self.vocab_size // self.world_size
        return self.rank * k, (self.rank + 1) * k

    @property
    def intermediate(self) -> tuple[int, int] | None:
        if self.intermediate_size is None:
            return None
        k = self.intermediate_size // self.world_size
        return self.rank * k, (self.rank + 1) * k

    def local_config(self, cfg: dict) -> dict:
        """config.json as this rank builds its layers: per-rank head counts (the attention blocks are
        built unchanged from it). Experts and vocabulary keep their global counts (the router and the
        logits span them all)."""
        h0, h1 = self.heads
        k0, k1 = self.kv_heads
        return dict(cfg, num_attention_heads=h1 - h0, num_key_value_heads=k1 - k0, head_dim=self.head_dim)

    # ------------------------------------------------------------------ tensor name -> slice
    def local_expert(self, name: str) -> str | None:
        """A per-expert tensor name as the model builder asks for it (local expert index) -> the
        checkpoint's name (global index); None for other names."""
        m = EXPERT.match(name)
        if m is None:
            return None
        return f"{m.group(1)}{self.experts[0] + int(m.group(2))}{m.group(3)}"

    def owns_expert(self, name: str) -> bool | None:
        """For a checkpoint per-expert tensor name: whether this rank holds that expert; None otherwise."""
        m = EXPERT.match(name)
        if m is None:
            return None
        e0, e1 = self.experts
        return e0 <= int(m.group(2)) < e1

    def slice_for(self, name: str) -> Slice | None:
        """The slice of checkpoint tensor ``name`` this rank reads (None: the whole tensor).
        Block scales (``weight_scale_inv``) are sliced in 128-row blocks; a split that does not fall on
        a block edge is a ValueError naming the tensor."""
        d, n = self.head_dim, self.world_size
        m = _ATTN.match(name)
        if m is not None:
            proj, kind = m.groups()
            if proj == "q_proj":
                (a, b), full, dim = self.heads, self.num_heads * d, 0
                a, b = a * d, b * d
            elif proj in ("k_proj", "v_proj"):
                (a, b), full, dim = self.kv_heads, self.num_kv_heads * d, 0
                a, b = a * d, b * d
            else:  # o_proj: input columns of this rank's heads
                if kind == "bias":
                    raise ValueError(f"{name}: a bias on o_proj is not supported with tensor_parallel > 1")
                (a, b), full, dim = self.heads, self.num_heads * d, 1
                a, b = a * d, b * d
            return self._maybe_block(name, kind, Slice(dim, a, b, full))
        m = _DENSE.match(name)
        if m is not None and self.intermediate_size is not None:
            proj, kind = m.groups()
            a, b = self.intermediate
            return self._maybe_block(name, kind, Slice(0 if proj != "down_proj" else 1, a, b, self.intermediate_size))
        if _STACKED.match(name):
            e0, e1 = self.experts
            return Slice(0, e0, e1, self.num_experts)
        if name == "lm_head.weight":
            v0, v1 = self.vocab
            return Slice(0, v0, v1, self.vocab_size)
        if n > 1 and name.endswith("weight_scale_inv") and name.startswith("lm_head"):
            raise ValueError(f"{name}: an FP8 lm_head is not supported with tensor_parallel > 1")
        return None

    def _maybe_block(self, name: str, kind: str, s: Slice) -> Slice:
        if kind != "weight_scale_inv":
            return s
        if s.start % BLOCK or s.stop % BLOCK:
            raise ValueError(f"{name}: this rank's rows [{s.start}, {s.stop}) do not fall on {BLOCK}-row FP8 "
                             f"block edges; tensor_parallel={self.world_size} cannot split this checkpoint's scales")
        return Slice(s.dim, s.start // BLOCK, s.stop // BLOCK, -(-s.full // BLOCK))


def _has_dense_layers(cfg: dict) -> bool:
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return any(i in dense or (i + 1) % step for i in range(cfg["num_hidden_layers"]))
