"""What each spawned rank runs in tests/distributed (gloo on CPU). Results go to ``<tmp>/rank<r>.pt``
for the test process to check; nothing is asserted here."""
from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import torch


def _init(tmp: Path, rank: int, world: int, timeout_s: float = 60):
    import ember.distributed as ed
    torch.set_num_threads(1)  # 2-4 ranks share a 2-core CI machine
    return ed.init("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout_s=timeout_s)


def leave() -> None:
    """Leave the group together: a gloo group torn down at exit while its peer is already gone can
    abort the process (SIGABRT, exit code -6), which the test would count as a failed rank."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _record_reads():
    """Instrument ember.loading's reader: (checkpoint name, shape read) of every tensor this rank reads."""
    from ember import loading
    reads, original = [], loading._Reader.__call__

    def spy(self, name, part=None):
        t = original(self, name, part)
        reads.append((name, tuple(t.shape), t.numel() * t.element_size()))
        return t
    loading._Reader.__call__ = spy
    return reads


def greedy(model, prompt: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens through the cached path the engine's decode step runs (prefill into the
    cache, then ``net.decode`` one token a step, argmax), and the logits of every step [n, V]."""
    net, caches = model.net, [tuple(t[:1] for t in layer) for layer in model.caches]
    tokens, out = [], []
    with torch.no_grad():
        logits = net.prefill(prompt, caches, last_only=True)
        for i in range(n):
            out.append(logits)
            tokens.append(int(logits.argmax(-1)))
            if i + 1 < n:
                pos = torch.tensor([prompt.shape[1] + i])
                logits = net.decode(torch.tensor([tokens[-1]]), pos, (pos + 1).to(torch.int32), caches)
    return tokens, torch.cat(out)


def split_run(rank: int, world: int, tmp: str, ckpt: str, new_tokens: int) -> None:
    """Load the tiny checkpoint split ``world`` ways; forward, greedy generate, cached decode logits;
    a random FP8 shard's decode step; what this rank read."""
    import ember
    import ember.distributed as ed
    tmp = Path(tmp)
    out = {}
    try:
        _init(tmp, rank, world)
        reads = _record_reads()
        prompt = torch.load(tmp / "prompt.pt")
        model = ember.load(ckpt, tensor_parallel=world, device="cpu", max_seq_len=64)
        out["reads"] = list(reads)
        out["logits"] = model(prompt)
        out["tokens"], out["decode_logits"] = greedy(model, prompt, new_tokens)
        out["local_shapes"] = {n: tuple(p.shape) for n, p in model.net.named_parameters()
                               if n.startswith("layers.0.")}
        # random full-size path, at a size a CPU runs: FP8 layout, head_dim 128 so scales split on blocks
        cfg = torch.load(tmp / "fp8_cfg.pt")
        plan = ed.ShardPlan.from_config(cfg, rank, world)
        net = ed.random_shard(cfg, plan, device=torch.device("cpu"), dtype=torch.float32, fp8=True, max_seq_len=16)
        caches = net.allocate_caches(1, 16)
        with torch.no_grad():
            logits = net.decode(torch.tensor([3]), torch.tensor([0]), torch.tensor([1], dtype=torch.int32), caches)
        out["fp8_logits"] = logits
        out["fp8_expert_dtype"] = str(net.layers[0].mlp.w_gate_up.dtype)
        out["fp8_experts_local"] = net.layers[0].mlp.w_gate_up.shape[0]
    except Exception:
        out["error"] = traceback.format_exc()
    torch.save(out, tmp / f"rank{rank}.pt")
    leave()


def failing_run(rank: int, world: int, tmp: str, ckpt: str) -> None:
    """Phase 1: load a checkpoint whose one damaged expert only rank 1 reads (every rank must raise).
    Phase 2: rank 1 dies before a collective (rank 0 must raise within the group's timeout)."""
    import ember
    import ember.distributed as ed
    tmp = Path(tmp)
    out = {}
    _init(tmp, rank, world, timeout_s=20)
    try:
        ember.load(ckpt, tensor_parallel=world, device="cpu", max_seq_len=64)
        out["load"] = "loaded"
    except Exception as e:
        out["load"] = f"{type(e).__name__}: {e}"
    torch.save(out, tmp / f"rank{rank}.pt")
    if rank == 1:
        os._exit(3)  # dies without a word, as a crashed or killed process would
    t0 = time.perf_counter()
    try:
        x = torch.ones(4)
        for _ in range(3):  # the first may find the peer still there; it is gone by the next
            ed.all_reduce(x)
            time.sleep(0.5)
        out["collective"] = "returned"
    except Exception as e:
        out["collective"] = f"{type(e).__name__}: {e}"
    out["collective_s"] = time.perf_counter() - t0
    torch.save(out, tmp / f"rank{rank}.pt")
