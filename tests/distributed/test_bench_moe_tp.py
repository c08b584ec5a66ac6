"""``ember bench moe_tp``: the bound arithmetic and the quick form (CPU, one process)."""
import pytest
import torch

from ember import bench
from ember.bench import moe_tp


def test_bound_counts_the_busiest_ranks_bytes():
    cfg = moe_tp.QWEN3_235B
    # tp 2, fp8, batch 1: per layer qkv (32 + 2 * 2 heads) x 128 x 4096 + o 4096 x 4096 bytes, router
    # 128 x 4096 bf16, 4 experts on average (8 of 128, half of them on each rank) x 3 x 4096 x 1536
    per_layer = 36 * 128 * 4096 + 4096 * 4096 + 2 * 128 * 4096 + 4 * 3 * 4096 * 1536
    mean, busiest = moe_tp.step_bytes(cfg, 2, True, 1)
    assert mean == pytest.approx(94 * per_layer + 2 * 151936 // 2 * 4096, rel=2e-3)
    assert busiest > mean  # the busiest of two ranks holds more than 4 of the 8 on average
    m, b = moe_tp.local_experts(128, 8, 4, 1)
    assert m == pytest.approx(2.0, rel=0.02) and 2.0 < b <= 8
    # batch 8 reads fewer than 8x the experts (tokens share some)
    assert moe_tp.local_experts(128, 8, 2, 8)[0] < 8 * 4
    assert moe_tp.bound_tok_s(cfg, 2, True, 1) == pytest.approx(4.155e12 / busiest)


def test_quick_runs_on_cpu_and_says_what_it_did_not_measure():
    said = []
    rows = bench.run_suite("moe_tp", quick=True, progress=said.append)
    assert [r.name for r in rows] == ["all_reduce_1x4096_fp32_gloo_world1", "qwen3_moe_tiny_shard_world1_b1_cpu"]
    assert all(r.ember > 0 for r in rows)
    assert set(rows[1].extra["bounds_tok_s"]) == {r[0] for r in moe_tp.ROWS}
    assert sum("not measured: needs" in s for s in said) == 4
    assert not torch.distributed.is_initialized()  # the quick form's one-rank group is gone
