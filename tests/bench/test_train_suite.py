import math

import torch

from ember.bench import BenchContext, train


def test_train_suite_rows_quick_on_cpu():
    """The suite's own rows at --quick shapes: named as the issue asks, peers recorded (a missing one
    as a note, not a crash), ember's loss equal to the torch path's."""
    ctx = BenchContext(quick=True, device=torch.device("cpu"))
    loss, norm = train._loss_row(ctx), train._norm_row(ctx)
    assert loss.name == "linear_cross_entropy_64x128x1000_bf16" and loss.unit == "ms"
    assert loss.ember > 0 and loss.extra["torch_ms"] > 0
    for peer in ("liger", "cce"):
        assert f"{peer}_ms" in loss.extra or "not installed" in loss.extra[f"{peer}_note"]
    assert math.isclose(loss.extra["ember_loss"], loss.extra["torch_loss"], rel_tol=1e-5)
    assert norm.name == "rmsnorm_fwd_bwd_64x256_bf16" and norm.unit == "GB/s" and norm.ember > 0
    assert norm.extra["bytes"] == 5 * 64 * 256 * 2
