"""The decode-step timeline the bench rows carry: increments over overlapping kernels, per replay."""
import pytest
import torch

from ember.bench import _timeline


def test_increments_take_the_last_replay_and_count_overlap_once():
    # two replays, closer together than any kernel; in each, b overlaps a (dependent launch) and c
    # lies inside b
    one = [("a", 0.0, 2.0), ("b", 1.0, 4.0), ("c", 2.5, 3.5), ("a", 4.0, 5.0)]
    spans = one + [(n, s + 5.5, e + 5.5) for n, s, e in one]
    ks = _timeline.increments(spans, replays=2)
    assert [k["name"] for k in ks] == ["a", "b", "c", "a"]
    assert [k["start"] for k in ks] == [5.5, 6.5, 8.0, 9.5]
    assert [k["incr_us"] for k in ks] == [2.0, 2.0, 0.0, 1.0]  # c adds nothing: it ends inside b
    assert [k["dur_us"] for k in ks] == [2.0, 3.0, 1.0, 1.0]
    s = _timeline.summarise(ks)
    assert s["step_us_sum_of_increments"] == s["step_span_us"] == 5.0
    assert s["by_name"]["a"] == {"calls": 2, "mean_dur_us": 1.5, "mean_incr_us": 1.5, "share": 0.6}
    assert list(s["by_name"]) == ["a", "b", "c"]  # by share of the step
    assert s["kernels"] == 4 and s["first_layer_sequence"][1] == ("b", 3.0, 2.0)


def test_a_kernel_count_that_is_not_whole_replays_is_refused():
    with pytest.raises(ValueError, match="3 kernels over 2 replays"):
        _timeline.increments([("a", 0.0, 1.0), ("b", 1.0, 2.0), ("a", 3.0, 4.0)], replays=2)


def test_row_timeline_reports_a_failure_instead_of_raising():
    class Broken:
        def replay(self):
            raise RuntimeError("no graph")
    out = _timeline.row_timeline(Broken())
    assert "no graph" in out["error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_kernels_of_a_captured_graph():
    x = torch.randn(1 << 20, device="cuda")
    g = torch.cuda.CUDAGraph()
    y = x * 2  # allocate outside capture
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        torch.mul(x, 2, out=y)
        torch.add(y, 1, out=y)
    s = _timeline.summarise(_timeline.step_kernels(g))
    assert s["kernels"] == 2 and s["step_us_sum_of_increments"] > 0
    assert sum(v["calls"] for v in s["by_name"].values()) == 2
