"""The MoE kernels' launch tiles: tuning data on the GPU, small interpreter tiles in code.

On a CUDA device every entry comes from ``ember.tuning.lookup("moe", key, device)`` (the H200's
measured file, else ``ember/tuning/data/generic/moe.json``; ``ember.tuning.override("moe", {...})``
for sweeps, read at launch). The keys and their fields are listed in the package docstring. CPU
tensors (the interpreter) take CPU_CONFIG: small blocks, so tiny test shapes still run several K
iterations and N blocks and hit the masks.
"""
from __future__ import annotations

import torch

from ember import tuning

FAMILY = "moe"
FP8 = torch.float8_e4m3fn
NO_SCALE, ROW_SCALE, BLOCK_SCALE = 0, 1, 2
SCALE_BLOCK = 128
DECODE_MAX_TOKENS = 16

CPU_CONFIG = {
    "t1": dict(GEMV="v1", GEMV_FP8="v1"),
    "gemv_gate_up": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, UNROLL=True),
    "gemv_down": dict(BLOCK_N=16, BLOCK_K=16, num_warps=1, UNROLL=False, SPLIT=1, SPLIT_FP8=1),
    # LANES=4: several K steps and ragged K masks even at H=64..256
    "gemv_v2_gate_up": dict(num_warps=1, ROWS=2, ROWS_FP8=2, LANES=4),
    "gemv_v2_down": dict(num_warps=1, ROWS=2, ROWS_FP8=2, LANES=4, SPLIT=2, SPLIT_FP8=2),  # CI runs the split
    "grouped_decode": dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1),
    "prefill": dict(gate_up=dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1),
                    down=dict(BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1), max_block_m=128),
}
CPU_CONFIG["prefill:large_smem"] = CPU_CONFIG["prefill"]

_FIELDS = {
    "t1": ("GEMV", "GEMV_FP8"),
    "gemv_gate_up": ("BLOCK_N", "BLOCK_K", "num_warps", "UNROLL"),
    "gemv_down": ("BLOCK_N", "BLOCK_K", "num_warps", "UNROLL", "SPLIT", "SPLIT_FP8"),
    "gemv_v2_gate_up": ("num_warps", "ROWS", "ROWS_FP8"),
    "gemv_v2_down": ("num_warps", "ROWS", "ROWS_FP8", "SPLIT", "SPLIT_FP8"),
    "grouped_decode": ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "prefill": ("gate_up", "down", "max_block_m"),
    "prefill:large_smem": ("gate_up", "down", "max_block_m"),
}
_GROUPED_FIELDS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def _pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def _check_grouped(key: str, part: str, tile, source: str) -> dict:
    if not isinstance(tile, dict) or set(tile) != set(_GROUPED_FIELDS):
        raise ValueError(f"moe tuning entry {key!r}{part} ({source}): expected the fields {_GROUPED_FIELDS}, got {tile!r}")
    # a K slice of the grouped kernels must sit inside one 128-wide scale block
    if not (_pow2(tile["BLOCK_N"]) and _pow2(tile["BLOCK_K"]) and 16 <= tile["BLOCK_K"] <= SCALE_BLOCK):
        raise ValueError(f"moe tuning entry {key!r}{part} ({source}): BLOCK_K must be 16, 32, 64 or 128 (a K slice "
                         f"sits inside one 128-wide scale block) and BLOCK_N a power of 2, got {tile!r}")
    return dict(tile)


def _check(key: str, entry, source: str) -> dict:
    fields = _FIELDS[key]
    if not isinstance(entry, dict) or not set(fields) <= set(entry):
        raise ValueError(f"moe tuning entry {key!r} ({source}): expected the fields {fields}, got {entry!r}")
    entry = dict(entry)
    if key == "t1":
        if not all(entry[f] in ("v1", "v2") for f in fields):
            raise ValueError(f"moe tuning entry 't1' ({source}): GEMV and GEMV_FP8 must be 'v1' or 'v2', got {entry!r}")
    elif key.startswith("prefill"):
        entry["gate_up"] = _check_grouped(key, "['gate_up']", entry["gate_up"], source)
        entry["down"] = _check_grouped(key, "['down']", entry["down"], source)
        if entry["max_block_m"] not in (16, 32, 64, 128):
            raise ValueError(f"moe tuning entry {key!r} ({source}): max_block_m must be 16, 32, 64 or 128, "
                             f"got {entry['max_block_m']!r}")
    elif key == "grouped_decode":
        entry = _check_grouped(key, "", entry, source)
    elif any(f.startswith("SPLIT") and entry[f] not in (1, 2, 4, 8) for f in fields):
        raise ValueError(f"moe tuning entry {key!r} ({source}): SPLIT and SPLIT_FP8 must be 1, 2, 4 or 8, "
                         f"got {entry!r}")
    return entry


def tiles(key: str, device: torch.device) -> dict:
    """The launch entry ``key`` for ``device`` (a copy): tuning data on CUDA, CPU_CONFIG otherwise or
    where no data file has the key."""
    entry, source = tuning.lookup_with_source(FAMILY, key, device)
    if entry is None:
        return _check(key, CPU_CONFIG[key], "CPU_CONFIG")
    return _check(key, entry, source)


def t1_variant(device: torch.device, fp8: bool = False) -> str:
    """Which T=1 GEMV kernels run: "v1" or "v2" (entry "t1": GEMV for 2- and 4-byte weights, GEMV_FP8
    for fp8; H200: v1 and v2, the interpreter v1)."""
    return tiles("t1", device)["GEMV_FP8" if fp8 else "GEMV"]


def large_smem(device: torch.device) -> bool:
    """At least 200 KB of shared memory per block (H100/H200: 227 KB): room for the large prefill tiles."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) >= 200 * 1024


def prefill_configs(device: torch.device, act_bytes: int = 2) -> dict:
    """Tiles of the prefill (T > 16) grouped kernels: ``{"gate_up": tile, "down": tile, "max_block_m": n}``.

    Entry "prefill:large_smem" for 2-byte activations on a GPU with >= 200 KB of shared memory per
    block (H200: 128 x 64 gate_up and 256 x 64 down tiles, 8 warps, 4 stages: 192 KB; fp32
    activations would need twice that), else "prefill"."""
    large = device.type == "cuda" and act_bytes <= 2 and large_smem(device)
    cfgs = tiles("prefill:large_smem" if large else "prefill", device)
    return {"gate_up": cfgs["gate_up"], "down": cfgs["down"], "max_block_m": cfgs["max_block_m"]}


def router_tile(E: int, device: torch.device) -> tuple[int, int]:
    """(router rows per program, warps) of the router launch: entry "router" where one exists (sweeps),
    else the rule: 4 rows from 128 experts on (32 programs a token), 2 below, 4 warps. H200
    Qwen3-30B-A3B decode step 2.365 vs 2.389 ms at batch 1, 7.64 vs 7.68 at batch 8 (step_tiles_b1/b8.json;
    1 or 2 rows, 2 or 8 warps were slower); fewer experts (LFM2's 32) keep 2 rows (not re-measured)."""
    entry, source = tuning.lookup_with_source(FAMILY, "router", device)
    if entry is None:
        return (4 if E >= 128 else 2), 4
    if not isinstance(entry, dict) or not (_pow2(entry.get("BLOCK_R")) and _pow2(entry.get("num_warps"))):
        raise ValueError(f"moe tuning entry 'router' ({source}): expected powers of 2 BLOCK_R and num_warps, "
                         f"got {entry!r}")
    return entry["BLOCK_R"], entry["num_warps"]


def scale_args(weight: torch.Tensor, scale: torch.Tensor | None):
    """(mode, tensor, stride_e, stride_n, stride_k) for a validated scale."""
    if weight.dtype != FP8 or scale is None:
        return NO_SCALE, weight, 0, 0, 0
    if scale.dim() == 2:
        return ROW_SCALE, scale, scale.stride(0), scale.stride(1), 0
    return BLOCK_SCALE, scale, scale.stride(0), scale.stride(1), scale.stride(2)


def sub_k(mode: int, block_k: int) -> int:
    return min(block_k, SCALE_BLOCK) if mode == BLOCK_SCALE else block_k


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def down_split(cfg: dict, top_k: int, fp8: bool) -> int:
    """Expert groups of a T = 1 down GEMV (its entry's SPLIT / SPLIT_FP8): programs per (token, row
    block), each summing top_k / SPLIT experts; a split that does not divide top_k falls back to 1.
    H200 Qwen3-30B-A3B decode step, fp8 v2 (bench/results/h200/step_variants_down_split*.json, two
    runs): 2.07 ms unsplit, 2.05 split 2, 1.94 split 4, 1.98 split 8: 128 programs of 4 warps (one
    per SM) each streamed 16 rows of all 8 experts in turn; 512 spread the 12.6 MB over more warps.
    bf16 with v2 got slower (2.41 -> 2.51 ms at 4), and so did bf16's v1 down GEMV (1,024 programs of
    2 warps already): 2.29 -> 2.56 ms at 2 or 4 (step_variants_v1_split_router_bf16.json)."""
    split = cfg["SPLIT_FP8" if fp8 else "SPLIT"]
    return split if top_k % split == 0 else 1
