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


def test_train_step_setup_records_where_the_step_goes():
    """One setup of the training-step row at --quick shapes: tok/s, the loss curve, and the forward /
    backward / optimizer parts of a timed step, which add up to about the step's wall time."""
    from ember.bench import _train_model as tm
    ctx = BenchContext(quick=True, device=torch.device("cpu"))
    cfg = tm._moe_config(True)
    steps, timed_from, S = 5, 2, 64
    out = tm._train(ctx, cfg, "ember", S, steps, timed_from, search_s=0.0)
    parts = [out[f"{p}_ms"] for p in ("forward", "backward", "optimizer")]
    assert all(p > 0 for p in parts) and len(out["loss_curve"]) == steps
    step_ms = S / out["tok_s"] * 1e3
    assert 0.9 * step_ms < sum(parts) <= step_ms, (parts, step_ms)  # the rest: moving ids, the loop
