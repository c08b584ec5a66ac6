"""``ember bench moe_tp``: Qwen3-235B-A22B decode split over 2 / 4 GPUs (tensor + expert parallel,
NCCL), random full-size weights each rank builds on its own GPU (no checkpoint on disk).

The suite spawns one process a GPU itself (NCCL over a file store, NVLink multicast off), so
``ember bench moe_tp --json bench/results/h200x4/moe_tp.json`` runs on a 4-GPU host as is; a row
that needs more GPUs than are visible is skipped with a message. Each rank captures the engine's
decode step (its two all-reduces a layer and the logits all-gather included) in a CUDA graph;
rank 0 reports the median replay time.

Bound (per GPU, 4.155 TB/s): the bytes the busiest rank reads a step: its qkv and o_proj columns,
the replicated router, its experts that the step's tokens route to (expected number under uniform
routing, busiest rank), its lm_head rows. Collectives count nothing in the bound; their time alone
(all-reduce of [B, 4096] bf16 and the logits all-gather, each measured in a CUDA graph of 100) is
reported beside it. Qwen3-235B-A22B at tp 2 in FP8 reads 13.1 GB on the busiest rank at batch 1
(11.2 GB mean): 318 tok/s; bf16 tp 4: 16.2 GB busiest, 257 tok/s. At ~10-20 us an all-reduce, the
188 all-reduces of a step cost 2-4 ms against a 3-4 ms bound: the collectives, not the weights, decide
the batch-1 row (a one-shot all-reduce without multicast is the next step if the run shows it).

``--quick`` (CPU, one process): the analytic bounds, a world-size-1 gloo group's all-reduce of
[1, 4096], and a tiny random model decoded through the shard code path.
"""
from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ember.bench import BenchContext, Row

COPY_BW = 4.155e12
TARGET = 0.5
QWEN3_235B = dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=1536, intermediate_size=12288, vocab_size=151936, norm_topk_prob=True,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
                  tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
# (row, tensor_parallel, fp8, batch)
ROWS = [("qwen3_moe_235b_a22b_fp8_tp2_b1", 2, True, 1), ("qwen3_moe_235b_a22b_fp8_tp2_b8", 2, True, 8),
        ("qwen3_moe_235b_a22b_bf16_tp4_b1", 4, False, 1), ("qwen3_moe_235b_a22b_bf16_tp4_b8", 4, False, 8)]
CONTEXT = 128  # cache length each rank allocates (the timed steps use the first 30 positions)


def local_experts(E: int, k: int, world: int, B: int, draws: int = 4000) -> tuple[float, float]:
    """(mean over ranks, busiest rank) expected count of distinct local experts a step of B tokens
    reads, each token routing to k of E experts uniformly (Monte Carlo, fixed seed)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.rand(draws, B, E, generator=g).argsort(-1)[..., :k]            # [draws, B, k]
    hit = torch.zeros(draws, E, dtype=torch.bool)
    hit.scatter_(1, ids.reshape(draws, -1), True)
    per_rank = hit.reshape(draws, world, E // world).sum(-1).float()            # [draws, world]
    return per_rank.mean().item(), per_rank.max(-1).values.mean().item()


def step_bytes(cfg: dict, world: int, fp8: bool, B: int) -> tuple[float, float]:
    """(mean rank, busiest rank) weight bytes one decode step reads on a rank."""
    H, L, d = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    nh, kvh, E, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["moe_intermediate_size"]
    w = 1 if fp8 else 2
    qkv = (nh // world + 2 * max(kvh // world, 1)) * d * H
    o = H * nh // world * d
    router = E * H * 2
    expert = 3 * H * I * w
    mean, busiest = local_experts(E, cfg["num_experts_per_tok"], world, B)
    head = cfg["vocab_size"] // world * H * 2
    fixed = L * ((qkv + o) * w + router) + head
    return fixed + L * mean * expert, fixed + L * busiest * expert


def bound_tok_s(cfg: dict, world: int, fp8: bool, B: int) -> float:
    return B / (step_bytes(cfg, world, fp8, B)[1] / COPY_BW)


# ----------------------------------------------------------------------------- one rank (spawned)
def _graph_us(fn, n: int = 100) -> float:
    """Median time of one ``fn`` from CUDA graphs of ``n`` calls (5 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(ts)


def _time_shard(cfg: dict, rank: int, world: int, fp8: bool, B: int, dev: torch.device) -> dict:
    """Build ``rank``'s random shard on ``dev``, capture the engine's decode step, median of 30 replays."""
    import ember.distributed as ed
    from ember.engine import Model
    t0 = time.perf_counter()
    net = ed.random_shard(cfg, ed.ShardPlan.from_config(cfg, rank, world), device=dev, fp8=fp8,
                          max_seq_len=CONTEXT)  # weights dominate a step; the context is short
    build_s = time.perf_counter() - t0
    model = Model(net, cfg, None, max_seq_len=CONTEXT, max_batch_size=B, fp8=fp8)
    model.warmup(B)  # each replay below advances the position: the 30 timed steps see 1-30 cached tokens
    graph = model.decode_graph(B)
    if ed.world()[1] > 1:
        torch.distributed.barrier()
    ts = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    out = dict(step_ms=statistics.median(ts), build_s=build_s, gb_allocated=torch.cuda.max_memory_allocated(dev) / 1e9)
    del model, net, graph
    torch.cuda.empty_cache()
    return out


def _rank_main(rank: int, world: int, store: str, specs: list, out: str) -> None:
    import torch.distributed as dist

    import ember.distributed as ed
    ed.init("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    dev = torch.device("cuda", rank)
    results = []
    for name, _, fp8, B in specs:
        m = _time_shard(QWEN3_235B, rank, world, fp8, B, dev)
        x = torch.randn(B, QWEN3_235B["hidden_size"], device=dev, dtype=torch.bfloat16)
        logits = torch.randn(B, QWEN3_235B["vocab_size"] // world, device=dev, dtype=torch.bfloat16)
        m.update(name=name, all_reduce_us=_graph_us(lambda: ed.all_reduce(x)),
                 all_gather_us=_graph_us(lambda: ed.all_gather_last(logits)))
        results.append(m)
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, specs: list) -> list[dict]:
    import ember.distributed as ed
    ed.disable_multicast()  # the children inherit it before NCCL starts
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.pt")
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, world, str(Path(tmp) / "store"), specs, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RuntimeError(f"moe_tp: rank exit codes {codes} (the ranks' errors are above)")
        return torch.load(out)


def _rows(measured: list[dict]) -> list[Row]:
    rows = []
    spec = {name: (w, fp8, B) for name, w, fp8, B in ROWS}
    for m in measured:
        w, fp8, B = spec[m["name"]]
        mean_b, busiest_b = step_bytes(QWEN3_235B, w, fp8, B)
        bound = bound_tok_s(QWEN3_235B, w, fp8, B)
        tok_s = B / (m["step_ms"] / 1e3)
        L = QWEN3_235B["num_hidden_layers"]
        coll_ms = (2 * L * m["all_reduce_us"] + m["all_gather_us"]) / 1e3
        rows.append(Row(m["name"], "tok/s", tok_s, bound, "per-GPU bandwidth bound (busiest rank)",
                        target=f">= {TARGET:.0%} of the bound", meets=tok_s >= TARGET * bound,
                        extra={"step_ms": m["step_ms"], "fraction_of_bound": tok_s / bound,
                               "busiest_rank_gb": busiest_b / 1e9, "mean_rank_gb": mean_b / 1e9,
                               "all_reduce_us": m["all_reduce_us"], "all_gather_logits_us": m["all_gather_us"],
                               "collectives_ms_per_step": coll_ms, "build_s": m["build_s"],
                               "peak_gb_per_gpu": m["gb_allocated"]}))
    return rows


# ----------------------------------------------------------------------------- quick (CPU, one process)
def _quick(ctx: BenchContext) -> list[Row]:
    import torch.distributed as dist

    import ember.distributed as ed
    for name, w, fp8, B in ROWS:
        mean_b, busiest_b = step_bytes(QWEN3_235B, w, fp8, B)
        ctx.progress(f"{name}: bound {bound_tok_s(QWEN3_235B, w, fp8, B):.0f} tok/s ({busiest_b / 1e9:.2f} GB on "
                     f"the busiest rank, {mean_b / 1e9:.2f} GB mean); not measured: needs {w} GPUs")
    owns = not dist.is_initialized()
    with tempfile.TemporaryDirectory() as tmp:
        if owns:
            ed.init("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            x = torch.randn(1, 4096)
            ar = ctx.time_us([lambda: dist.all_reduce(x)])
            cfg = dict(QWEN3_235B, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
                       moe_intermediate_size=64, vocab_size=512)
            net = ed.random_shard(cfg, ed.ShardPlan.from_config(cfg, 0, 1), device=torch.device("cpu"),
                                  dtype=torch.float32, max_seq_len=64)
            caches = net.allocate_caches(1, 64)
            tok, pos, lens = torch.tensor([3]), torch.tensor([5]), torch.tensor([6], dtype=torch.int32)
            with torch.no_grad():
                step = ctx.time_us([lambda: net.decode(tok, pos, lens, caches)])
        finally:
            if owns:
                dist.destroy_process_group()
    bounds = {name: bound_tok_s(QWEN3_235B, w, fp8, B) for name, w, fp8, B in ROWS}
    return [Row("all_reduce_1x4096_fp32_gloo_world1", "us", ar, None, "none (one rank: the call's own cost)"),
            Row("qwen3_moe_tiny_shard_world1_b1_cpu", "us", step, None, "none (the shard path on CPU)",
                extra={"bounds_tok_s": bounds})]


def run(ctx: BenchContext) -> list[Row]:
    if ctx.quick or not ctx.on_gpu:
        if not ctx.quick:
            ctx.progress("moe_tp: no CUDA device; running the CPU quick form (the multi-GPU rows need 2-4 GPUs)")
        return _quick(ctx)
    n = torch.cuda.device_count()
    rows = []
    for world in (2, 4):
        specs = [r for r in ROWS if r[1] == world]
        if world > n:
            ctx.progress(f"moe_tp: {', '.join(r[0] for r in specs)} skipped: need {world} GPUs, {n} visible")
            continue
        ctx.progress(f"moe_tp: tp {world} on {world} of {n} GPUs (building random shards, capturing)")
        rows += _rows(_spawn(world, specs))
    if n == 1:  # one GPU: rank 0's shard alone (its collectives are no-ops): the step without communication
        ctx.progress("moe_tp: world size 1 (1 GPU visible): the multi-GPU rows need 2 or 4 GPUs; timing rank 0's "
                     "shard alone instead")
        for name, w, fp8, B in ROWS:
            if B != 1:
                continue
            m = _time_shard(QWEN3_235B, 0, w, fp8, B, ctx.device)
            tok_s, bound = B / (m["step_ms"] / 1e3), bound_tok_s(QWEN3_235B, w, fp8, B)
            rows.append(Row(f"{name}_rank0_alone", "tok/s", tok_s, bound, "per-GPU bandwidth bound (busiest rank)",
                            extra={"step_ms": m["step_ms"], "fraction_of_bound": tok_s / bound,
                                   "note": "one rank's shard on one GPU, no collectives (not the multi-GPU row)",
                                   "build_s": m["build_s"], "peak_gb_per_gpu": m["gb_allocated"]}))
    return rows
