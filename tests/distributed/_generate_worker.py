"""What each spawned rank of tests/distributed/test_tp_generate.py runs (a module of its own: spawn
imports it in the child)."""
from __future__ import annotations

import traceback
from pathlib import Path

import torch

from tests.distributed import _worker


def generate_run(rank: int, world: int, tmp: str, ckpt: str, new_tokens: int) -> None:
    """Load the tiny checkpoint split ``world`` ways and generate a batch of two prompts through the
    scheduler: greedy, sampled with a seed, sampled without one (twice), and one stream."""
    import ember
    tmp = Path(tmp)
    out = {}
    try:
        _worker._init(tmp, rank, world)
        prompts = torch.load(tmp / "prompts.pt")
        model = ember.load(ckpt, tensor_parallel=world, device="cpu", max_seq_len=64, max_batch_size=2)
        hot = ember.SamplingParams(temperature=1.0)
        out["greedy"] = model.generate(prompts, max_new_tokens=new_tokens)
        out["seeded"] = model.generate(prompts, max_new_tokens=new_tokens,
                                       sampling=ember.SamplingParams(temperature=1.0, seed=7))
        out["seedless"] = [model.generate(prompts, max_new_tokens=new_tokens, sampling=hot) for _ in range(2)]
        out["stream"] = list(model.stream(prompts[1], max_new_tokens=new_tokens, sampling=hot))
    except Exception:
        out["error"] = traceback.format_exc()
    torch.save(out, tmp / f"rank{rank}.pt")
    _worker.leave()
