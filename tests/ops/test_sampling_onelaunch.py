"""The one-launch split-row paths: argmax (last program of the row), softmax of few rows (grid
barrier), softmax of many rows (persistent programs, per-row barriers) and the one-launch sampler;
the tiles they read from ``ember.tuning``.

On CPU the interpreter runs the argmax kernel through the public op, and the softmax kernels directly
with a tiny spin cap: programs run one after another there, so every program but the last of a row
gives up waiting and recomputes its row (the fallback), and the last one combines the published
partials (the normal path). Memory ordering and co-residency only exist on the GPU: the gpu tests.
"""
import math
import sys

import pytest
import torch

import ember
from ember import _dispatch, tuning
from ember.bench.sampling import WAVE_CONFIGS, wave_entry
from ember.ops import sampling as S
from tests.helpers import poisoned

SOFTMAX_TOL = dict(atol=1e-7, rtol=1e-5)
LOG_SOFTMAX_TOL = dict(atol=5e-6, rtol=1e-5)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GEN = 1 << 20          # BARRIER_GEN: what every launch adds to a barrier counter
MANY_ROWS = [33, 256, 300]             # test_gpu_softmax_many_rows_vs_float64's shapes
MANY_V = [20000, 128256, 151936]


H200 = tuning.DeviceInfo("NVIDIA H200", (9, 0))
CPU = torch.device("cpu")


def _k():
    _dispatch.prepare_triton()
    from ember.kernels import sampling
    return sampling


def _grid():
    """The workspace's module (its buffers are module state)."""
    _dispatch.prepare_triton()
    from ember.kernels.sampling import _grid
    return _grid


def _assert_workspace_clean(ws):
    cap = _grid()._workspace_cap(ws)
    assert ws.numel() == 2 + (2 + _grid().NUCLEUS_ROUNDS) * cap
    assert int(ws[0]) % GEN == 0                                # grid barrier counter between launches
    assert bool((ws[2:2 + cap] == 0).all())                     # arrival counters (argmax, sample)
    assert bool((ws[2 + cap:] % GEN == 0).all())                # row barriers (many-row softmax, nucleus rounds)


# ------------------------------------------------------------------ argmax, interpreter
def test_argmax_split_ties_nan_signed_zero_interpreter(interpreter):
    V = 20000   # > ROW_BLOCK_MAX: split over 20 programs
    x = torch.randn(6, V)
    x[0, [7000, 19999, 3]] = 9.0                      # first index of a tie across chunks
    x[1, [15000, 16000]] = float("nan")               # NaN is the max, first NaN wins (torch)
    x[1, 17] = math.inf
    x[2] = -math.inf                                  # all -inf: index 0
    x[3] = -math.inf
    x[3, 12345] = -1.0
    x[4] = 0.0
    x[4, 1500] = -0.0                                 # -0.0 == 0.0: still index 0
    x[5, 19999] = 50.0                                # the last element of a partial chunk
    out = poisoned((6,), torch.int64, "cpu")
    _k().argmax(x, out)
    assert out.tolist() == [3, 15000, 0, 12345, 0, 19999]
    assert torch.equal(out, torch.argmax(x, -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_split_repeated_calls_reset_workspace_interpreter(interpreter, dtype):
    for i in range(4):
        x = torch.round(torch.randn(3, 17000) * 2).to(dtype)   # many ties
        x[:, 100 * i] = 50.0 - i                              # the max moves to an earlier or later chunk
        assert torch.equal(ember.ops.argmax(x), torch.argmax(x, -1))
        _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])


def test_argmax_split_chunk_floor_from_tuning_interpreter(interpreter):
    """The split's chunk floor is the tuning entry ``split``: longer chunks (fewer programs a row)
    give the same argmax, softmax and tokens (the candidate bound is taken over the same pieces only
    at one floor, so the tokens are compared within a floor: two launches against one)."""
    x = torch.randn(2, 20000) * 3
    x[1, 19990] = 40.0
    exp = torch.softmax(x.double(), -1)
    for floor in (2048, 8192):
        with tuning.override("sampling", {"split": {"min_chunk": floor}}):
            assert _k().split(20000, _k().min_chunk(CPU))[0] == floor
            assert torch.equal(ember.ops.argmax(x), torch.argmax(x, -1))
            torch.testing.assert_close(ember.ops.softmax(x).double(), exp, **SOFTMAX_TOL)
            two = poisoned((2,), torch.int64, "cpu")
            _k().sample(x, two, 1.0, 0, 1.0, 0.1, 5, 3)
            probs = S.sampling_probs_reference(x, 1.0, 0, 1.0, 0.1)
            assert bool((probs[torch.arange(2), two] > 0).all())
    for bad in ({"min_chunk": 512}, {"min_chunk": 3000}, {"chunk": 1024}, {"min_chunk": 32768}):
        with tuning.override("sampling", {"split": bad}), pytest.raises(ValueError, match="sampling/split"):
            _k().min_chunk(CPU)


def test_argmax_row_kernel_nan_and_ties_interpreter(interpreter):
    x = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 5.0, 5.0, -1.0], [-0.0, 0.0, -1.0, -2.0]])
    assert ember.ops.argmax(x).tolist() == [1, 1, 0] == torch.argmax(x, -1).tolist()


def test_workspace_grows_and_keeps_outgrown_buffer_interpreter(interpreter, monkeypatch):
    k = _grid()
    monkeypatch.setattr(k, "_WORKSPACES", {})
    monkeypatch.setattr(k, "_OUTGROWN", [])
    x = torch.randn(2, 17000)
    assert torch.equal(ember.ops.argmax(x), torch.argmax(x, -1))
    small = k._WORKSPACES[("cpu", None)]
    y = torch.randn(70, 17000)                         # more rows than the first capacity (64)
    assert torch.equal(ember.ops.argmax(y), torch.argmax(y, -1))
    big = k._WORKSPACES[("cpu", None)]
    assert big.numel() > small.numel() and k._OUTGROWN == [small]   # graphs may still point at it
    _assert_workspace_clean(big)


# ------------------------------------------------------------------ softmax kernel, interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_one_launch_kernel_interpreter(interpreter, dtype):
    k = _k()
    B, V, chunk = 2, 20000, 4096
    P = math.ceil(V / chunk)
    base = (torch.randn(B, V + 40) * 4).to(dtype)
    x = base[:, 20:20 + V]                             # rows not contiguous with each other
    barrier, _, _ = _grid()._workspace(x.device, 0)
    start, give_ups = int(barrier[0]), int(barrier[1])
    for call, log in enumerate((False, True, False)):
        out = poisoned((B, V), torch.float32, "cpu")
        k.softmax_one_launch(x, out, 0.7, log, chunk, P, spin_cap=2)
        exp = (torch.log_softmax if log else torch.softmax)(x.double() / 0.7, -1)
        torch.testing.assert_close(out.double(), exp, **(LOG_SOFTMAX_TOL if log else SOFTMAX_TOL))
        # each launch adds exactly one generation; all programs but the last gave up waiting
        assert int(barrier[0]) == start + (call + 1) * (1 << 20)
        assert int(barrier[1]) == give_ups + (call + 1) * (B * P - 1)


def test_fit_split_chunks_grow_to_fit_the_sms():
    def fit(B, V, sms):
        return _k().fit_split(B, V, sms, min_chunk=1024)
    assert fit(1, 128256, 132) == (1024, 126, 128)     # split's own chunks already fit
    assert fit(4, 128256, 132) == (4096, 32, 32)       # 4 x 32 programs
    assert fit(4, 248320, 132) == (8192, 31, 32)
    assert fit(6, 20000, 132) == (1024, 20, 32)
    assert fit(17, 128256, 132) is None                # 17 x 8 programs of 16384 > 132
    assert fit(3, 1 << 20, 132) is None                 # 3 x 64 programs of 16384 > 132
    for B, V in [(1, 151936), (2, 1 << 20), (16, 128256)]:
        chunk, P, PB = fit(B, V, 132)
        assert B * P <= 132 and P * chunk >= V and (P - 1) * chunk < V and PB >= P


def test_one_launch_never_on_cpu(interpreter, monkeypatch):
    """Programs run one after another in the interpreter: no barrier kernel is chosen for CPU
    tensors (the tests below launch them directly, with a tiny spin cap)."""
    from ember.kernels.sampling import softmax_kernels
    assert softmax_kernels._one_launch_split(torch.randn(1, 20000)) is None
    sample_calls = _count_wave_launches(monkeypatch, _k(), "sample_one_launch")
    grid_calls = _count_wave_launches(monkeypatch, _k(), "softmax_one_launch")
    x = torch.randn(1, 20000)
    ember.ops.softmax(x)
    ember.ops.sample(x, temperature=0.7, top_k=5, seed=1)
    assert sample_calls == [] and grid_calls == []


# ------------------------------------------------------------------ many-row softmax (waves), CPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_softmax_waves_kernel_interpreter(interpreter, dtype, prefetch):
    k = _k()
    B, V, P, R = 5, 4500, 5, 2      # chunks of 1024 (the last holds 404); rows 0, 2, 4 | 1, 3: a short last wave
    cfg = k.WaveConfig(1024, 4, 1, prefetch)
    base = (torch.randn(B, V + 24) * 4).to(dtype)
    x = base[:, 8:8 + V]                               # rows not contiguous with each other
    x[3, 4400:] = -math.inf                            # -inf tail inside the partial chunk
    x[4, 1024:2048] = -math.inf                        # a chunk that is -inf throughout
    barrier, _, row_bars = _grid()._workspace(x.device, B)
    row_bar = row_bars[0]
    start, give_ups = row_bar.clone(), int(barrier[1])
    for call, (log, T) in enumerate(((False, 0.7), (True, 1.0), (False, 1.3))):
        out = poisoned((B, V), torch.float32, "cpu")
        k.softmax_waves(x, out, T, log, cfg, P, R, spin_cap=2)
        exp = (torch.log_softmax if log else torch.softmax)(x.double() / T, -1)
        torch.testing.assert_close(out.double(), exp, **(LOG_SOFTMAX_TOL if log else SOFTMAX_TOL))
        # each launch adds exactly one generation per row; in each row all programs but the last
        # (the interpreter runs them in turn) gave up waiting and recomputed the row
        assert torch.equal(row_bar, start + (call + 1) * GEN)
        assert int(barrier[1]) == give_ups + (call + 1) * B * (P - 1)


def test_softmax_waves_tags_from_earlier_launches_never_accepted_interpreter(interpreter):
    """The hinted kernel's partials are int64 words tagged with the row's barrier generation + 1. The
    interpreter runs programs in turn, so every program but a row's last finds its siblings' words
    missing: it must read the words earlier launches left (other chunk sizes, so other programs per
    row, same rows) as stale, give up and recompute the row. Any stale word taken for fresh shows up
    as fewer give-ups (and a wrong row, had its value been off)."""
    k = _k()
    B, V = 6, 5000
    x = torch.randn(B, V) * 3
    exp = torch.softmax(x.double(), -1)
    barrier, _, row_bars = _grid()._workspace(x.device, B)
    for chunk in (1024, 2048, 1024, 4096, 1024):
        P = -(-V // chunk)
        give_ups = int(barrier[1])
        gen = row_bars[0][:B].clone()
        out = poisoned((B, V), torch.float32, "cpu")
        k.softmax_waves(x, out, 1.0, False, k.WaveConfig(chunk, 4, 1, 1), P, 3, spin_cap=2)
        torch.testing.assert_close(out.double(), exp, **SOFTMAX_TOL)
        assert int(barrier[1]) - give_ups == B * (P - 1)
        slots = _grid()._SLOTS[("row", "cpu", None)][1][:B, :2 * P]
        assert torch.equal(slots >> 32, (gen // GEN + 1)[:, None].expand(B, 2 * P))   # this launch's tags


def test_tags_skip_zero_when_the_generation_wraps_interpreter(interpreter, monkeypatch):
    """At generation 2^31 - 1 a plain 31-bit gen + 1 tag is 0, the tag of every zeroed slot no launch
    wrote: on the GPU, where nobody gives up at the counter, such words would pass for this launch's.
    ``generation_tag`` wraps to 1 instead. With new (zeroed) slots and the counters preset there, the
    tagged top-k sampler (grid counter) and the many-row softmax (row counters) stay exact and write
    tag 1. (Here programs run in turn and give up at the counter first, which recomputes the row
    whatever the words say: so the tags themselves are checked.)"""
    k, g = _k(), _grid()
    monkeypatch.setattr(g, "_WORKSPACES", {})
    monkeypatch.setattr(g, "_SLOTS", {})
    wrap = (2 ** 31 - 1) * GEN
    x = torch.randn(2, 20000) * 3                       # 20 programs a row
    two = poisoned((2,), torch.int64, "cpu")
    k.sample(x, two, 0.7, 10, 0.9, 0.0, 5, 3)
    barrier, _, row_bars = g._workspace(x.device, 2)
    barrier[0] = wrap
    give_ups = int(barrier[1])
    one = poisoned((2,), torch.int64, "cpu")
    k.sample_one_launch(x, one, 0.7, 10, 0.9, 0.0, 5, 3, spin_cap=2)
    assert torch.equal(one, two)
    assert int(barrier[1]) - give_ups == 2 * 20 - 1
    assert int(barrier[0]) == wrap + GEN
    assert bool((g._SLOTS[("grid", "cpu", None)][1][:2, :20] >> 32 == 1).all())    # the maxima: wrapped to 1
    B, V, chunk = 4, 5000, 1024
    P = -(-V // chunk)
    xs = torch.randn(B, V) * 3
    barrier, _, row_bars = g._workspace(xs.device, B)
    row_bars[0][:B] = wrap
    give_ups = int(barrier[1])
    out = poisoned((B, V), torch.float32, "cpu")
    k.softmax_waves(xs, out, 1.0, False, k.WaveConfig(chunk, 4, 1, 1), P, 2, spin_cap=2)
    torch.testing.assert_close(out.double(), torch.softmax(xs.double(), -1), **SOFTMAX_TOL)
    assert int(barrier[1]) - give_ups == B * (P - 1)
    assert bool((g._SLOTS[("row", "cpu", None)][1][:B, :2 * P] >> 32 == 1).all())   # wrapped to 1, not 0


@pytest.mark.parametrize("kind, words", [("row", 2 * 128), ("grid", 128 + 2 * 512)])
def test_tagged_slots_follow_the_workspace(interpreter, kind, words):
    """Tags are counter generations: a new workspace (counters at 0) must come with new, zeroed
    slots, or a word written under the old counters could carry the tag a new launch looks for.
    Each kind has its own slots (their tags come from different counters)."""
    k = _grid()
    ws = k._workspace_buffer(torch.device("cpu"), 8)
    slots = k._tagged_slots(ws, 8, kind)
    assert k._tagged_slots(ws, 4, kind) is slots and k._tagged_slots(ws, 8, kind) is slots
    other = "grid" if kind == "row" else "row"
    assert k._tagged_slots(ws, 8, other).data_ptr() != slots.data_ptr()
    slots.fill_(123)
    bigger = k._workspace_buffer(torch.device("cpu"), 4 * k._workspace_cap(ws))
    assert bigger is not ws
    fresh = k._tagged_slots(bigger, 8, kind)
    assert fresh is not slots and not fresh.any()
    assert fresh.shape[1] == words


def test_wave_plan_balanced_waves_within_the_slots():
    k = _k()
    big, two = k.WaveConfig(16384, 16, 1, 1), k.WaveConfig(8192, 8, 2, 1)
    assert k.wave_plan(256, 128256, 132, big) == (8, 8, 16)     # 16 waves of 16 rows: 128 programs
    assert k.wave_plan(300, 128256, 132, big) == (8, 8, 16)     # 19 waves, the last of 12 rows
    assert k.wave_plan(33, 151936, 132, big) == (10, 16, 11)    # 13 rows would fit: 3 waves of 11
    assert k.wave_plan(256, 128256, 132, two) == (16, 16, 16)   # 264 slots
    assert k.wave_plan(3, 1 << 20, 132, big) == (64, 64, 2)
    assert k.wave_plan(1, 1 << 20, 32, big) is None             # a row needs 64 programs, 32 slots
    for cfg in (big, two, k.WaveConfig(4096, 4, 4, 0)):
        for sms in (16, 78, 132):
            for B in (1, 2, 17, 33, 255, 256, 300, 1000):
                for V in (16385, 20000, 128256, 151936, 248320):
                    plan = k.wave_plan(B, V, sms, cfg)
                    P = -(-V // cfg.chunk)
                    slots = sms * cfg.per_sm
                    if P > slots:
                        assert plan is None
                        continue
                    assert plan[0] == P and plan[1] >= P and plan[1] & (plan[1] - 1) == 0
                    R = plan[2]
                    waves = -(-B // R)
                    assert 1 <= R <= B and R * P <= slots                 # every program resident
                    assert waves == -(-B // (slots // P))                 # as few waves as the slots allow
                    assert (waves - 1) * R < B and B <= waves * R          # no empty wave


def test_sample_warps_from_tuning():
    """The one-launch sampler's warps: the entry of its base chunk (``topk`` at that chunk when top-k
    may be on, ``other`` otherwise and at grown chunks); other base chunks keep the rule; a bad entry
    is an error naming it."""
    k = _k()
    rule = [k.sample_warps(CPU, base, sub, topk) for base in (1024, 2048) for sub in (1, 8) for topk in (True, False)]
    assert all(w in (1, 2, 4, 8, 16, 32) for w in rule)
    with tuning.override("sampling", {"sample_warps:1024": {"topk": 2, "other": 16}}):
        assert k.sample_warps(CPU, 1024, 1, True) == 2
        assert k.sample_warps(CPU, 1024, 1, False) == k.sample_warps(CPU, 1024, 8, True) == 16
        assert [k.sample_warps(CPU, 2048, sub, topk) for sub in (1, 8) for topk in (True, False)] == rule[4:]
    for bad in ({"topk": 3, "other": 8}, {"other": 8}, {"topk": 4, "other": 64}):
        with tuning.override("sampling", {"sample_warps:1024": bad}), \
                pytest.raises(ValueError, match="sampling/sample_warps:1024"):
            k.sample_warps(CPU, 1024, 1, True)


def test_sample_warps_entry_is_what_the_launch_takes_interpreter(interpreter, monkeypatch):
    """The launch reads the warps entry when it runs (so a graph captured inside an override keeps
    it): a traced launch gets the entry's count, and the tokens do not change with it."""
    from ember.kernels.sampling import sampler
    kernel = sampler._sample_one_launch_kernel
    seen = []

    class Spy:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*a, **kw):
                seen.append(kw["num_warps"])
                return launch(*a, **kw)
            return run
    monkeypatch.setattr(sampler, "_sample_one_launch_kernel", Spy())
    x = torch.randn(1, 20000) * 3
    toks = []
    for warps in (2, 8):
        with tuning.override("sampling", {"sample_warps:1024": {"topk": warps, "other": warps}}):
            out = poisoned((1,), torch.int64, "cpu")
            _k().sample_one_launch(x, out, 0.7, 10, 0.9, 0.0, 5, 3, spin_cap=2)
            toks.append(out)
    assert seen == [2, 8] and torch.equal(toks[0], toks[1])


def test_wave_config_from_tuning_and_register_cap():
    k = _k()
    assert k.wave_config(CPU) == k.WAVES_DEFAULT                    # no entry on CPU: the rule
    with tuning.override("sampling", {"softmax_waves": wave_entry("8192,8,2,1")}):
        assert k.wave_config(CPU) == k.WaveConfig(8192, 8, 2, 1)
    assert k.WaveConfig(8192, 8, 2, 1).max_registers() == 128     # 2 x 256 threads x 128 = 64K
    assert k.WaveConfig(16384, 16, 2, 0).max_registers() == 64
    assert k.WaveConfig(4096, 4, 1, 0).max_registers() == 255      # the ISA's limit
    for bad in ("3000,8,1,1", "512,4,1,0", "32768,16,1,1", "8192,6,1,1", "8192,16,8,1", "8192,8,0,1", "8192,8,1,9"):
        with tuning.override("sampling", {"softmax_waves": wave_entry(bad)}), \
                pytest.raises(ValueError, match="sampling/softmax_waves"):
            k.wave_config(CPU)
    with tuning.override("sampling", {"softmax_waves": {"chunk": 8192, "warps": 8, "per_sm": 2}}), \
            pytest.raises(ValueError, match="sampling/softmax_waves"):
        k.wave_config(CPU)


def test_softmax_path_by_shape():
    k = _k()
    big = k.WaveConfig(16384, 16, 1, 2)

    def path(B, V, sms, one_launch=True, cfg=big):
        return k.softmax_path(B, V, sms, one_launch, cfg, min_chunk=1024)
    assert path(300, 16384, 132) == ("row",)
    assert path(4, 128256, 132) == ("grid", 4096, 32)
    assert path(16, 128256, 132) == ("grid", 16384, 8)      # 128 programs
    assert path(17, 128256, 132) == ("waves", big, 8, 9)    # 2 waves
    assert path(256, 128256, 132) == ("waves", big, 8, 16)
    assert path(256, 128256, 132, one_launch=False) == ("two",)   # no GPU
    assert path(1, 1 << 20, 32) == ("two",)                  # a row needs 128 programs
    assert path(256, 128256, 132, cfg=k.WaveConfig(16384, 16, 1, 0)) == ("waves", k.WaveConfig(16384, 16, 1, 0), 8, 16)


def test_h200_tuning_entries_are_read_as_shipped():
    """The H200's shipped entries parse through the kernels' readers and are what they return for
    that GPU (a measured file a reader rejects would fail only on the GPU); ``EMBER_TUNING=generic``
    gives the rule."""
    import json
    from pathlib import Path
    from ember import _switches
    k = _k()
    entries = json.loads((Path(tuning.__file__).parent / "data" / "sm_90-nvidia-h200" / "sampling.json").read_text())
    assert k.min_chunk(H200) == entries["split"]["min_chunk"]
    assert k.small_sort(H200) == entries["small_sort"]["block"]
    assert k.wave_config(H200) == k.WaveConfig(**entries["softmax_waves"])
    for key, entry in entries.items():
        if key.startswith("sample_warps:"):
            base = int(key.split(":")[1])
            assert (k.sample_warps(H200, base, 1, True), k.sample_warps(H200, base, 1, False)) == \
                (entry["topk"], entry["other"])
    with _switches.override(EMBER_TUNING="generic"):
        assert (k.min_chunk(H200), k.small_sort(H200), k.wave_config(H200)) == \
            (k.min_chunk(CPU), k.small_sort(CPU), k.wave_config(CPU))


def test_many_rows_gpu_matrix_paths_on_h200():
    """test_gpu_softmax_many_rows_vs_float64's shapes on the H200's 132 SMs with its tiles: 8 of 9
    take the waves kernel; [33, 20000] fits the grid-barrier kernel (also checked there)."""
    k = _k()
    paths = {(B, V): k.softmax_path(B, V, 132, True, k.wave_config(H200), k.min_chunk(H200))[0]
             for B in MANY_ROWS for V in MANY_V}
    assert paths.pop((33, 20000)) == "grid"
    assert set(paths.values()) == {"waves"}


# ------------------------------------------------------------------ GPU
def _softmax_two_launch(x, temperature, log):
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _k().softmax_two_launch(x, out, temperature or 1.0, log)
    return out


def _sample_two_launch(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, offset=None):
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _k().sample_two_launch(x, out, temperature, top_k, top_p, min_p, seed, offset)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [128256, 151936, 248320, 20000])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gpu_softmax_one_launch_vs_float64_and_two_launch(cuda, dtype, V, rows):
    from ember.kernels.sampling import softmax_kernels
    base = (torch.randn(rows, V + 64, device=cuda) * 4).to(dtype)
    for x in (base[:, :V].contiguous(), base[:, 32:32 + V]):      # contiguous and strided rows
        assert softmax_kernels._one_launch_split(x) is not None
        for T in (None, 0.7):
            for log in (False, True):
                fn = ember.ops.log_softmax if log else ember.ops.softmax
                got = fn(x, temperature=T)
                exp = (torch.log_softmax if log else torch.softmax)(x.double() / (T or 1.0), -1)
                tol = LOG_SOFTMAX_TOL if log else SOFTMAX_TOL
                torch.testing.assert_close(got.double(), exp, **tol)
                two = _softmax_two_launch(x, T, log)
                torch.testing.assert_close(got, two, atol=tol["atol"], rtol=tol["rtol"])
    assert _k().barrier_give_ups(base.device) == 0


@pytest.mark.gpu
def test_gpu_softmax_one_launch_1000_calls_and_graph_replays(cuda):
    k = _k()
    x = torch.randn(2, 128256, device=cuda) * 3
    for i in range(1000):                              # 1000 barrier generations, eager, each checked
        x.mul_(-1.0) if i % 2 else x.add_(0.5)
        torch.testing.assert_close(ember.ops.softmax(x).double(), torch.softmax(x.double(), -1), **SOFTMAX_TOL)
    static = [torch.randn(1, 128256, device=cuda), torch.randn(3, 151936, device=cuda)]
    outs = [ember.ops.softmax(static[0], temperature=0.7), ember.ops.log_softmax(static[1])]   # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):                          # two one-launch calls per replay
        outs = [ember.ops.softmax(static[0], temperature=0.7), ember.ops.log_softmax(static[1])]
    for i in range(1000):
        for s in static:
            s.copy_(torch.randn_like(s) * (1 + i % 5))
        g.replay()
        if i % 97 == 0 or i == 999:
            torch.testing.assert_close(outs[0].double(), torch.softmax(static[0].double() / 0.7, -1), **SOFTMAX_TOL)
            torch.testing.assert_close(outs[1].double(), torch.log_softmax(static[1].double(), -1), **LOG_SOFTMAX_TOL)
    torch.cuda.synchronize()
    ws = _grid()._WORKSPACES[("cuda", x.device.index)]
    assert int(ws[0]) % (1 << 20) == 0 and k.barrier_give_ups(x.device) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [20000, 128256, 151936, 248320])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_gpu_argmax_split_matches_torch_with_ties(cuda, dtype, V, rows):
    x = torch.round(torch.randn(rows, V + 8, device=cuda) * 3).to(dtype)[:, 4:4 + V]   # ties, strided rows
    top = x.float().amax(-1)
    x[:, V - 1] = top.to(dtype)                        # a tie in the last chunk
    if rows > 2:
        x[1, [V // 2, 3]] = float("nan")               # NaN is the max, the first NaN wins
        x[2] = -math.inf
    assert torch.equal(ember.ops.argmax(x), torch.argmax(x, -1))


@pytest.mark.gpu
def test_gpu_argmax_graph_replays_reset_workspace(cuda):
    static = torch.randn(4, 128256, device=cuda)
    ember.ops.argmax(static)                           # warm-up: compile and workspace outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ember.ops.argmax(static)
    for i in range(1000):
        static.copy_(torch.randn_like(static))
        pos = (i * 7919) % 128256                      # the max moves, often to an earlier chunk
        static[:, pos] = 10.0
        static[1, (pos + 5) % 128256] = 10.0           # a tie: first index
        g.replay()
        if i % 50 == 0 or i == 999:
            assert torch.equal(out, torch.argmax(static, -1)), i
    torch.cuda.synchronize()
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", static.device.index)])


@pytest.mark.gpu
def test_gpu_workspace_first_needed_during_capture(cuda, monkeypatch):
    """A workspace first needed inside capture is a temporary with captured fills, not cached."""
    k = _grid()
    a = torch.randn(8, 151936, device=cuda)
    ember.ops.argmax(a[:1]), ember.ops.softmax(a[:1])  # compile outside capture
    monkeypatch.setattr(k, "_WORKSPACES", {})
    monkeypatch.setattr(k, "_OUTGROWN", [])
    g = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="during CUDA-graph capture"), torch.cuda.graph(g):
        am = ember.ops.argmax(a)
        sm = ember.ops.softmax(a[:1])
    assert k._WORKSPACES == {}
    for _ in range(20):
        a.copy_(torch.randn_like(a))
        g.replay()
        assert torch.equal(am, torch.argmax(a, -1))
        torch.testing.assert_close(sm.double(), torch.softmax(a[:1].double(), -1), **SOFTMAX_TOL)
    assert torch.equal(ember.ops.argmax(a), torch.argmax(a, -1))   # eager: a fresh cached workspace
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", a.device.index)])


# ------------------------------------------------------------------ many-row softmax (waves), GPU
def _count_wave_launches(monkeypatch, k, name="softmax_waves"):
    """Count the launches of ``name`` by the dispatching function (``softmax`` / ``sample``), which
    calls it in the module that defines it."""
    calls = []
    real = getattr(k, name)

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)
    monkeypatch.setattr(sys.modules[real.__module__], name, spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", MANY_V)
@pytest.mark.parametrize("rows", MANY_ROWS)
def test_gpu_softmax_many_rows_vs_float64(cuda, monkeypatch, dtype, V, rows):
    k = _k()
    calls = _count_wave_launches(monkeypatch, k)
    grid_calls = _count_wave_launches(monkeypatch, k, "softmax_one_launch")
    dev = torch.device(cuda)
    path = k.softmax_path(rows, V, _grid()._device_sms(torch.empty(0, device=cuda)), True, k.wave_config(dev),
                          k.min_chunk(dev))[0]
    assert path in ("waves", "grid")   # on the H200 [33, 20000] fits the grid barrier, the rest waves
    base = (torch.randn(rows, V + 64, device=cuda) * 4).to(dtype)
    base[5, 7:V:3] = -math.inf                         # -inf entries (masked out by exp)
    for x in (base[:, :V].contiguous(), base[:, 32:32 + V]):      # contiguous and strided rows
        for T in (None, 0.7):
            for log in (False, True):
                got = (ember.ops.log_softmax if log else ember.ops.softmax)(x, temperature=T)
                exp = (torch.log_softmax if log else torch.softmax)(x.double() / (T or 1.0), -1)
                torch.testing.assert_close(got.double(), exp, **(LOG_SOFTMAX_TOL if log else SOFTMAX_TOL))
    # every call took the kernel softmax_path names for this shape
    assert (len(calls), len(grid_calls)) == ((8, 0) if path == "waves" else (0, 8))
    assert k.barrier_give_ups(base.device) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("config", WAVE_CONFIGS)
def test_gpu_softmax_waves_configs(cuda, monkeypatch, config):
    """Every ``softmax_waves`` shape the sweep times is exact (and the path is taken)."""
    k = _k()
    calls = _count_wave_launches(monkeypatch, k)
    x = (torch.randn(300, 151936 + 40, device=cuda) * 4)[:, 8:8 + 151936]
    for log in (False, True):
        with tuning.override("sampling", {"softmax_waves": wave_entry(config)}):
            got = (ember.ops.log_softmax if log else ember.ops.softmax)(x, temperature=0.9)
        exp = (torch.log_softmax if log else torch.softmax)(x.double() / 0.9, -1)
        torch.testing.assert_close(got.double(), exp, **(LOG_SOFTMAX_TOL if log else SOFTMAX_TOL))
    assert len(calls) == 2 and k.barrier_give_ups(x.device) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 8, 3])
def test_gpu_softmax_waves_l2_prefetch_alignment(cuda, monkeypatch, offset):
    """PREFETCH >= 2 bulk-prefetches 16-byte aligned chunks; rows that are not aligned (offset 3 fp32
    elements) take the register prefetch alone. Exact either way, and the same bits as prefetch 1."""
    k = _k()
    base = torch.randn(40, 128256 + 16, device=cuda) * 4
    x = base[:, offset:offset + 128256]
    from ember.kernels.sampling import softmax_kernels
    assert softmax_kernels._bulk_ok(x) == (offset % 4 == 0)
    calls = _count_wave_launches(monkeypatch, k)
    outs = []
    for config in ("8192,8,2,1", "8192,8,2,2", "4096,4,4,2"):
        with tuning.override("sampling", {"softmax_waves": wave_entry(config)}):
            outs.append(ember.ops.softmax(x))
    assert len(calls) == 3
    torch.testing.assert_close(outs[1].double(), torch.softmax(x.double(), -1), **SOFTMAX_TOL)
    assert torch.equal(outs[0], outs[1])
    assert k.barrier_give_ups(x.device) == 0


@pytest.mark.gpu
def test_gpu_softmax_waves_repeated_calls_graph_replays_bitwise(cuda, monkeypatch):
    k = _k()
    calls = _count_wave_launches(monkeypatch, k)
    x = torch.randn(256, 128256, device=cuda) * 3
    for i in range(200):                               # 200 barrier generations per row, eager
        x.mul_(-1.0) if i % 2 else x.add_(0.5)
        got = ember.ops.softmax(x)
        if i % 25 == 0 or i == 199:
            torch.testing.assert_close(got.double(), torch.softmax(x.double(), -1), **SOFTMAX_TOL)
    static = [torch.randn(256, 128256, device=cuda),
              torch.randn(300, 151936 + 16, device=cuda).to(torch.bfloat16)[:, 16:]]     # strided bf16 rows

    def calls_in_graph():
        return [ember.ops.softmax(static[0], temperature=0.7), ember.ops.log_softmax(static[1])]
    calls_in_graph()                                   # warm-up: compile, workspace for 300 rows
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = calls_in_graph()
    for i in range(60):
        static[0].copy_(torch.randn_like(static[0]) * (1 + i % 5))
        static[1].copy_(torch.randn(300, 151936, device=cuda) * (1 + i % 3))
        g.replay()
        if i % 15 == 0 or i == 59:
            eager = calls_in_graph()
            assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])    # bitwise
            torch.testing.assert_close(outs[0].double(), torch.softmax(static[0].double() / 0.7, -1), **SOFTMAX_TOL)
            torch.testing.assert_close(outs[1].double(), torch.log_softmax(static[1].double(), -1), **LOG_SOFTMAX_TOL)
    torch.cuda.synchronize()
    assert len(calls) == 200 + 2 * (1 + 1 + 5)        # eager, warm-up, capture, the eager comparisons
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", x.device.index)])
    assert k.barrier_give_ups(x.device) == 0


@pytest.mark.gpu
def test_gpu_softmax_waves_equals_two_launch(cuda, monkeypatch):
    k = _k()
    calls = _count_wave_launches(monkeypatch, k)
    x = torch.randn(64, 128256, device=cuda) * 3
    two = _softmax_two_launch(x, None, False)
    assert calls == []
    one = ember.ops.softmax(x)
    assert len(calls) == 1
    torch.testing.assert_close(one, two, **SOFTMAX_TOL)
    torch.testing.assert_close(one.double(), torch.softmax(x.double(), -1), **SOFTMAX_TOL)


# ------------------------------------------------------------------ one-launch sampler
SAMPLE_MIXES = [dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.0),     # the bench row: candidates
                dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),      # min-p race: per-program slots
                dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0),      # greedy
                dict(temperature=1.2, top_k=0, top_p=0.3, min_p=0.0),      # top-p alone
                dict(temperature=0.9, top_k=200, top_p=1.0, min_p=0.0),    # k > P: the bisection fallback
                dict(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0)]      # temperature alone: no barrier


def _temperature_alone(mix) -> bool:
    return mix["temperature"] > 0 and mix["top_k"] == 0 and mix["top_p"] >= 1.0 and mix["min_p"] == 0.0


@pytest.mark.parametrize("mix", SAMPLE_MIXES)
def test_sample_one_launch_kernel_equals_two_launches_interpreter(interpreter, mix):
    """With an int offset both paths draw the same Philox numbers: the same tokens. Programs run in
    turn here, so all but the last of the grid give up at the barrier and recompute the row (no
    barrier at all when every row samples by temperature alone)."""
    k = _k()
    x = torch.randn(2, 20000) * 3                     # 20 programs a row
    x[1, :19000] = -math.inf                          # most of a row masked
    two = poisoned((2,), torch.int64, "cpu")
    k.sample(x, two, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"], 5, 3)
    barrier, count, _ = _grid()._workspace(x.device, 2)
    give_ups = int(barrier[1])
    one = poisoned((2,), torch.int64, "cpu")
    k.sample_one_launch(x, one, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"], 5, 3, spin_cap=2)
    assert torch.equal(one, two)
    probs = S.sampling_probs_reference(x, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"])
    assert bool((probs[torch.arange(2), one] > 0).all())
    # all but the grid's last program give up at the grid barrier; top-p alone adds the nucleus
    # search's rounds, where all but each row's last program give up (19 a row and round)
    extra = int(barrier[1]) - give_ups - (0 if _temperature_alone(mix) else 2 * 20 - 1)
    nucleus = mix["top_k"] == 0 and 0 < mix["temperature"] and mix["top_p"] < 1.0
    assert (extra > 0 and extra % 19 == 0) if nucleus else extra == 0, extra
    assert int(barrier[0]) % GEN == 0
    _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])


@pytest.mark.parametrize("top_k", [10, 50])   # 50 > the 20 pieces: no bound, the finisher's exact fallback
def test_sample_topk_offset_advanced_by_the_finisher_interpreter(interpreter, top_k):
    """One row, tagged top-k: the finisher reads the offset tensor and advances it; the token is the two launches' for the same offset, which both advance
    once. (With the acquire scheme program (0, 0) advances it after the barrier; here, where the
    programs run in turn, the later ones then read the advanced value.)"""
    k = _k()
    x = torch.randn(1, 20000) * 3
    for start in (0, 41):
        offs = [torch.full((1,), start, dtype=torch.int64) for _ in range(2)]
        two = poisoned((1,), torch.int64, "cpu")
        k.sample(x, two, 0.7, top_k, 0.9, 0.0, 5, offs[0])
        one = poisoned((1,), torch.int64, "cpu")
        k.sample_one_launch(x, one, 0.7, top_k, 0.9, 0.0, 5, offs[1], spin_cap=2)
        assert torch.equal(one, two), (start, one, two)
        assert [int(o) for o in offs] == [start + 1] * 2
    _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])


@pytest.mark.parametrize("top_k,top_p,min_p", [(10, 0.9, 0.0), (15, 1.0, 0.05)])
def test_sample_topk_packed_race_equals_two_launches_interpreter(interpreter, top_k, top_p, min_p):
    """The tagged finisher's winner by one max over packed (key, column) words draws the two launches'
    tokens (an argmax, a max and a gather there), ties at the thresholds included."""
    k = _k()
    x = torch.randn(2, 20000) * 3
    x[1, ::5] = x[1, ::5].round()                     # integer logits on every 5th column: ties
    for off in range(3):
        two = poisoned((2,), torch.int64, "cpu")
        k.sample(x, two, 0.7, top_k, top_p, min_p, 5, off)
        one = poisoned((2,), torch.int64, "cpu")
        k.sample_one_launch(x, one, 0.7, top_k, top_p, min_p, 5, off, spin_cap=2)
        assert torch.equal(one, two), (off, one, two)
    _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])


@pytest.mark.parametrize("mix", [dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.0), SAMPLE_MIXES[1],
                                 SAMPLE_MIXES[2], SAMPLE_MIXES[3]])
def test_sample_one_launch_bigger_chunks_equal_two_launches_interpreter(interpreter, mix):
    """Few-row batches take chunks of several 1024 pieces (``fit_split``; here 4096 = 4 pieces, 5
    programs a row): each program publishes its pieces' maxima, so the candidate bound, the list and
    the token are the two launches' (1024-element chunks) for the same seed and offset."""
    k = _k()
    x = torch.randn(2, 20000) * 3
    x[1, :19000] = -math.inf
    two = poisoned((2,), torch.int64, "cpu")
    k.sample(x, two, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"], 5, 3)
    one = poisoned((2,), torch.int64, "cpu")
    k.sample_one_launch(x, one, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"], 5, 3, spin_cap=2,
                        chunk=4096)
    assert torch.equal(one, two)
    _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])
    with pytest.raises(ValueError, match="chunk 3072"):
        k.sample_one_launch(x, one, 1.0, 0, 1.0, 0.0, 5, 3, chunk=3072)


@pytest.mark.parametrize("mix", SAMPLE_MIXES)
def test_sample_waves_equal_two_launches_interpreter(interpreter, mix):
    """More rows than fit at once: one persistent launch of 2 rows x 5 programs walks 5 rows in 3
    waves behind per-row barriers (chunks of 4 pieces), and draws the two launches' tokens for the
    same seed and offset; a tensor offset advances once, read by every program before that."""
    k = _k()
    x = torch.randn(5, 20000) * 3
    x[1, :19000] = -math.inf
    x[3] = (x[3] * 2).round()                        # ties at every pivot
    two = poisoned((5,), torch.int64, "cpu")
    off_two = torch.full((1,), 3, dtype=torch.int64)
    k.sample(x, two, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"], 5, off_two)
    one = poisoned((5,), torch.int64, "cpu")
    off_one = torch.full((1,), 3, dtype=torch.int64)
    k.sample_one_launch(x, one, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"], 5, off_one,
                        spin_cap=2, chunk=4096, rows_per_wave=2)
    assert torch.equal(one, two)
    assert int(off_one) == int(off_two) == 4
    with pytest.raises(ValueError, match="rows_per_wave must be >= 1"):
        k.sample_one_launch(x, one, 1.0, 0, 1.0, 0.0, 5, 3, rows_per_wave=0)
    probs = S.sampling_probs_reference(x, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"])
    assert bool((probs[torch.arange(5), one] > 0).all())
    _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])


def test_wave_rows_plan():
    def plan(B, V, sms):
        return _k().wave_rows_plan(B, V, sms, min_chunk=1024)
    assert plan(64, 128256, 132) == (8192, 8)     # 16 programs a row, 8 rows a wave
    assert plan(5, 128256, 132) == (8192, 5)
    assert plan(64, 1 << 20, 132) == (16384, 2)   # 64 programs a row
    assert plan(64, 1 << 20, 32) is None


def test_temperature_alone_is_known_only_from_scalars():
    k = _k()
    V = 128256
    assert k.temperature_alone(0.7, 0, 1.0, 0.0, V)
    assert k.temperature_alone(1.0, V, 1.0, 0.0, V)                 # top-k >= V is off
    assert not k.temperature_alone(0.0, 0, 1.0, 0.0, V)             # greedy
    assert not k.temperature_alone(0.7, 50, 1.0, 0.0, V)
    assert not k.temperature_alone(0.7, 0, 0.9, 0.0, V)
    assert not k.temperature_alone(0.7, 0, 1.0, 0.05, V)
    assert not k.temperature_alone(torch.full((2,), 0.7), 0, 1.0, 0.0, V)  # per-row: unknown on the host


def test_topk_tagged_is_known_only_from_scalars():
    k = _k()
    V = 128256
    assert k.topk_tagged(0.7, 50, V) and k.topk_tagged(1.0, 1, V)
    assert not k.topk_tagged(0.0, 50, V)                            # greedy
    assert not k.topk_tagged(0.7, 0, V) and not k.topk_tagged(0.7, V, V)   # top-k off
    assert not k.topk_tagged(torch.full((2,), 0.7), 50, V)          # per-row: unknown on the host
    assert not k.topk_tagged(0.7, torch.full((2,), 50), V)


def test_every_row_promise_selects_the_paths_scalars_would():
    """Per-row tensors with the caller's promise (``ember.ops.sample(every_row=...)``) take the paths
    the equivalent scalars take: the barrier-free race, the tagged top-k words, no waves."""
    k = _k()
    V = 128256
    t, top_k, p = torch.full((2,), 0.7), torch.full((2,), 50), torch.full((2,), 0.9)
    assert k.temperature_alone(t, torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.zeros(2), V,
                               "temperature_only")
    assert not k.temperature_alone(t, top_k, p, torch.zeros(2), V, "top_k")
    assert k.topk_tagged(t, top_k, V, "top_k") and not k.topk_tagged(t, top_k, V, "temperature_only")
    assert k.waves_pay(t, top_k, p, V) and not k.waves_pay(t, top_k, p, V, "top_k")
    assert not k.waves_pay(t, 0, 1.0, V, "temperature_only")


def test_waves_pay_unless_the_scalars_rule_out_top_p_alone():
    k = _k()
    V = 128256
    assert k.waves_pay(0.7, 0, 0.9, V)                    # top-p alone
    assert k.waves_pay(0.7, V, 0.9, V)                    # top-k >= V is off: top-p alone
    assert k.waves_pay(torch.ones(3), torch.zeros(3), torch.ones(3), V)  # per-row tensors: unknown
    assert not k.waves_pay(0.7, 50, 0.9, V)               # every row has top-k: candidate lists
    assert not k.waves_pay(0.0, 0, 0.9, V)                # greedy
    assert not k.waves_pay(0.7, 0, 1.0, V)                # no top-p (min-p or nothing)


def _nucleus_rows():
    """[3, 5000] rows (5 programs each) for the top-p-alone search: a flat row whose nucleus (thousands
    of values) takes several rounds and the race of the values above the bracket, integer logits (ties at
    every pivot), a tie of 1000 values under 5 larger ones: the threshold falls in a tie wider than
    the list (the bisection fallback, though values above the bracket are known)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5000, generator=g)
    x[0] = torch.linspace(0.0, 1.0, 5000)[torch.randperm(5000, generator=g)]
    x[1] = (x[1] * 3).round()
    x[2, :1000] = 9.0
    x[2, 1000:1005] = 12.0
    return x


def test_sample_one_launch_nucleus_search_equals_two_launches_interpreter(interpreter):
    """The distributed nucleus search (rounds of pivot masses, the bracket's values listed, the values
    above it raced by their programs) draws the two launches' token (their candidate list or exact
    bisection) for the same seed and offset, on rows that need several rounds, ties and the fallback."""
    k = _k()
    x = _nucleus_rows()
    top_p = 0.9
    for offset in (0, 2, 3):   # 2 and 3: the tie row's winner is in the tie, 0: above it
        two = poisoned((3,), torch.int64, "cpu")
        k.sample(x, two, 1.0, 0, top_p, 0.0, 9, offset)
        one = poisoned((3,), torch.int64, "cpu")
        k.sample_one_launch(x, one, 1.0, 0, top_p, 0.0, 9, offset, spin_cap=2)
        assert torch.equal(one, two), (offset, one, two)
        probs = S.sampling_probs_reference(x, 1.0, 0, top_p, 0.0)
        assert bool((probs[torch.arange(3), one] > 0).all())
    _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])


@pytest.mark.gpu
@pytest.mark.parametrize("mix", SAMPLE_MIXES)
@pytest.mark.parametrize("V", [20000, 128256, 151936])
def test_gpu_sample_one_launch_equals_two_launches(cuda, monkeypatch, mix, V):
    """The one-launch sampler (a row's P programs <= SM count) draws exactly the two launches' token
    for the same seed and offset (the two-launch path is the chi-square-tested one)."""
    k = _k()
    calls = _count_wave_launches(monkeypatch, k, "sample_one_launch")
    seed = torch.tensor([11], device=cuda)
    for i in range(40):
        x = torch.randn(1, V, device=cuda) * (1 + i % 4)
        if i % 5 == 0:
            x[0, : V // 2] = -math.inf
        off_a = torch.full((1,), i, dtype=torch.int64, device=cuda)
        off_b = off_a.clone()
        one = ember.ops.sample(x, **mix, seed=seed, offset=off_a)
        two = _sample_two_launch(x, **mix, seed=seed, offset=off_b)
        assert torch.equal(one, two), (i, one, two)
        assert off_a.item() == off_b.item() == i + 1
    assert len(calls) == 40
    torch.cuda.synchronize()
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", x.device.index)])
    assert k.barrier_give_ups(x.device) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 40])
def test_gpu_sample_temperature_alone_without_barrier(cuda, monkeypatch, B):
    """Scalar temperature alone takes the barrier-free race (1 row, 8 rows in one launch; 40 in
    waves, launched directly: ``sample`` takes two launches there, for either): the tokens of the barrier path
    (the same temperature as a per-row tensor) and of the two launches for the same seed and offset,
    the offset advanced once per call, also when replayed in a graph (fresh tokens each replay)."""
    k = _k()
    from ember.kernels.sampling import sampler
    calls = _count_wave_launches(monkeypatch, k, "sample_one_launch")
    seed = torch.tensor([13], device=cuda)
    t_rows = torch.full((B,), 0.8, device=cuda)
    dev = torch.device(cuda)
    plan = k.wave_rows_plan(B, 128256, _grid()._device_sms(t_rows), k.min_chunk(dev)) if B > 16 else None

    def one_launch(x, t, off):
        if plan is None:
            return ember.ops.sample(x, temperature=t, seed=seed, offset=off)
        out = torch.empty(B, dtype=torch.int64, device=cuda)
        sampler.sample_one_launch(x, out, t, 0, 1.0, 0.0, seed, off, chunk=plan[0], rows_per_wave=plan[1])
        return out

    def free(x, off):
        return one_launch(x, 0.8, off)
    for i in range(6):
        x = torch.randn(B, 128256, device=cuda) * (1 + i % 3)
        offs = [torch.full((1,), i, dtype=torch.int64, device=cuda) for _ in range(3)]
        got = free(x, offs[0])
        barrier = one_launch(x, t_rows, offs[1])
        two = _sample_two_launch(x, 0.8, seed=seed, offset=offs[2])
        assert torch.equal(got, barrier) and torch.equal(got, two), (i, got, barrier, two)
        assert [int(o) for o in offs] == [i + 1] * 3
    assert len(calls) == 12
    off = torch.zeros(1, dtype=torch.int64, device=cuda)
    free(x, off)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tok = free(x, off)
    seen = set()
    for _ in range(50):
        g.replay()
        seen.add(int(tok[0]))
    assert off.item() == 51 and len(seen) > 5
    torch.cuda.synchronize()
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", x.device.index)])


@pytest.mark.gpu
def test_gpu_sample_one_launch_graph_replays(cuda, monkeypatch):
    k = _k()
    calls = _count_wave_launches(monkeypatch, k, "sample_one_launch")
    x = torch.randn(1, 128256, device=cuda) * 3
    seed = torch.tensor([42], device=cuda)
    off = torch.zeros(1, dtype=torch.int64, device=cuda)
    ember.ops.sample(x, temperature=0.7, top_k=50, top_p=0.9, seed=seed, offset=off)   # compile outside
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tok = ember.ops.sample(x, temperature=0.7, top_k=50, top_p=0.9, seed=seed, offset=off)
    probs = S.sampling_probs_reference(x, 0.7, 50, 0.9)[0]
    seen = set()
    for _ in range(200):
        g.replay()
        seen.add(int(tok))
        assert probs[int(tok)] > 0
    assert off.item() == 201 and len(seen) > 5 and len(calls) == 2
    torch.cuda.synchronize()
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", x.device.index)])


# ------------------------------------------------------------------ candidates sorted as a small block
def _candidate_count(x, temperature, top_k, top_p):
    """How many candidates a row's last program gets (the kernels' bound, restated in torch)."""
    k = _k()
    chunk, P, _ = k.split(x.numel(), k.min_chunk(x.device))
    z = x.double() / temperature
    cm = torch.nn.functional.pad(z, (0, P * chunk - z.numel()), value=-math.inf).view(P, chunk).amax(1)
    rank = min(top_k, P) if top_k > 0 else min(P, _grid().TOPP_CANDIDATE_CHUNKS)
    L = cm.sort(descending=True).values[rank - 1]
    return int((z >= L).sum())


def _candidate_rows():
    """[4, 20000] rows whose candidate lists fall on both sides of a 128 sort block, below CAP (512)
    (overflowing rows take the bisection, the same for both; it is slow in the interpreter)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 20000, generator=g) * 3
    x[1] = (x[1]).round()                                   # integer logits: ties at the thresholds
    x[2, :300] = 12 + torch.rand(300, generator=g)          # 300 top values in one chunk: > 128 candidates
    x[3, ::97] = 15.0                                       # a tie of 207 values on top: sorted path
    return x


SORT_MIXES = [dict(temperature=0.7, top_k=10, top_p=0.9, min_p=0.0),
              dict(temperature=1.0, top_k=15, top_p=1.0, min_p=0.0),
              dict(temperature=1.2, top_k=0, top_p=0.8, min_p=0.0),
              dict(temperature=0.9, top_k=12, top_p=0.95, min_p=0.02)]


@pytest.mark.parametrize("mix", [SORT_MIXES[0], SORT_MIXES[2]])   # the others on the GPU (slow here)
def test_sample_small_sort_equals_full_sort_interpreter(interpreter, mix):
    """Candidates sorted as a small block (``small_sort``: 128 here, n <= 128) draw the tokens the CAP
    sort draws, for the same seed and offset, over rows on both sides of the block; every token in
    the reference support."""
    k = _k()
    x = _candidate_rows()
    counts = [_candidate_count(r, mix["temperature"], mix["top_k"], mix["top_p"]) for r in x]
    assert min(counts) <= 128 < max(counts) <= k.CAP, counts
    toks = {}
    for cap in ("512", "128"):           # one seed and offset (each call takes ~6 s in the interpreter)
        toks[cap] = poisoned((4,), torch.int64, "cpu")
        with tuning.override("sampling", {"small_sort": {"block": int(cap)}}):
            k.sample(x, toks[cap], mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"], 5, 1)
    assert torch.equal(toks["512"], toks["128"])
    probs = S.sampling_probs_reference(x, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"])
    assert bool((probs[torch.arange(4), toks["128"]] > 0).all()), toks["128"]


def test_small_sort_tuning_entry_validated():
    k = _k()
    assert 16 <= k.small_sort(CPU) <= k.CAP                     # the rule
    with tuning.override("sampling", {"small_sort": {"block": 64}}):
        assert k.small_sort(CPU) == 64
    for bad in (0, 100, 8, 1024, -1, "64"):
        with tuning.override("sampling", {"small_sort": {"block": bad}}), \
                pytest.raises(ValueError, match="sampling/small_sort"):
            k.small_sort(CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("mix", SAMPLE_MIXES[:1] + SORT_MIXES)
def test_gpu_sample_small_sort_equals_full_sort(cuda, mix):
    """On the GPU (one launch at 128256, two launches at 20000): the small and the CAP sort draw the
    same token for the same seed and offset, rows on both sides of a 128 block."""
    seed = torch.tensor([5], device=cuda)
    rows = [_candidate_rows().to(cuda)] + [torch.randn(4, 128256, device=cuda) * s for s in (1, 3, 10)]
    for x in rows:
        toks = {}
        for cap in ("512", "128"):
            with tuning.override("sampling", {"small_sort": {"block": int(cap)}}):
                toks[cap] = torch.stack([torch.cat([ember.ops.sample(r[None], **mix, seed=seed,
                                                                     offset=torch.full((1,), i, device=cuda))
                                                    for r in x]) for i in range(5)])
        assert torch.equal(toks["512"], toks["128"]), (x.shape, toks)
        probs = S.sampling_probs_reference(x, mix["temperature"], mix["top_k"], mix["top_p"], mix["min_p"])
        for rep in toks["128"]:
            assert bool((probs[torch.arange(x.shape[0], device=probs.device), rep.to(probs.device)] > 0).all())


# ------------------------------------------------------------------ top-p alone: the nucleus search
def _nucleus_rows_full(device):
    """[1, 128256] rows for the nucleus search at the bench's vocabulary: LLM-like (a few tokens hold
    most of the mass), the bench's N(0, 3^2), wider N(0, 4.3^2) (nucleus of hundreds), a flat row
    (nucleus of ~10^5: several rounds, the race above the bracket), integer logits (ties at every
    pivot), a tie of 1000 values on top (wider than the list: the bisection fallback)."""
    g = torch.Generator().manual_seed(7)
    V = 128256
    rows = [torch.randn(V, generator=g) * 2, torch.randn(V, generator=g) * 3, torch.randn(V, generator=g) * 4.3,
            torch.rand(V, generator=g), (torch.randn(V, generator=g) * 3).round(), torch.randn(V, generator=g)]
    rows[0][torch.randperm(V, generator=g)[:5]] += 12.0
    rows[5][torch.randperm(V, generator=g)[:1000]] = 9.0
    return [r.view(1, V).to(device) for r in rows]


@pytest.mark.gpu
@pytest.mark.parametrize("mix", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_p=0.5),
                                 dict(temperature=1.3, top_p=0.99), dict(temperature=0.8, top_p=0.95, min_p=0.01)])
def test_gpu_nucleus_search_equals_two_launches(cuda, monkeypatch, mix):
    """Top-p alone at [1, 128256] takes the one-launch nucleus search; it draws the two launches'
    token (their candidate list or the exact bisection) for the same seed and offset, on rows that
    take one round, several, and the fallback. No program gives up waiting; the workspace is clean."""
    k = _k()
    calls = _count_wave_launches(monkeypatch, k, "sample_one_launch")
    seed = torch.tensor([3], device=cuda)
    give_ups = k.barrier_give_ups(torch.device(cuda))
    for x in _nucleus_rows_full(cuda):
        probs = S.sampling_probs_reference(x, **mix)[0]
        for i in range(6):
            off = torch.full((1,), i, dtype=torch.int64, device=cuda)
            one = ember.ops.sample(x, **mix, seed=seed, offset=off.clone())
            two = _sample_two_launch(x, **mix, seed=seed, offset=off.clone())
            assert torch.equal(one, two), (i, one, two)
            assert probs[int(one)] > 0
    assert len(calls) == 6 * 6
    torch.cuda.synchronize()
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", x.device.index)])
    assert k.barrier_give_ups(torch.device(cuda)) == give_ups


@pytest.mark.gpu
def test_gpu_nucleus_search_chi_square_graph_replays(cuda):
    """100,000 draws of top-p alone (one launch, nucleus search) from a CUDA graph of 100 calls that
    advance the offset, on a [1, 20000] row whose nucleus spans two rounds: the counts fit the
    float64 reference (chi-square), every draw in its support."""
    from tests.ops.test_sampling import P_FAIL, chi2_pvalue
    g = torch.Generator().manual_seed(11)
    V = 20000
    x = (torch.randn(1, V, generator=g) * 1.5).to(cuda)
    mix = dict(temperature=0.9, top_p=0.6)
    seed = torch.tensor([21], device=cuda)
    off = torch.zeros(1, dtype=torch.int64, device=cuda)
    out = torch.empty(100, dtype=torch.int64, device=cuda)
    ember.ops.sample(x, **mix, seed=seed, offset=off)                       # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(100):
            out[j] = ember.ops.sample(x, **mix, seed=seed, offset=off, check=False)[0]
    draws = []
    for _ in range(1000):
        graph.replay()
        draws.append(out.clone())
    tok = torch.cat(draws).cpu()
    probs = S.sampling_probs_reference(x.cpu(), **mix)[0]
    assert bool((probs[tok] > 0).all())
    exp_counts = probs * tok.numel()
    small = (exp_counts < 5) & (probs > 0)
    counts = torch.bincount(tok, minlength=V).double()
    counts = torch.cat([counts[~small], counts[small].sum().view(1)])
    probs = torch.cat([probs[~small], probs[small].sum().view(1)])
    assert chi2_pvalue(counts, probs) > P_FAIL


@pytest.mark.gpu
@pytest.mark.parametrize("B", [2, 8, 16, 40, 130])
def test_gpu_sample_few_rows_one_launch_equals_two_launches(cuda, monkeypatch, B):
    """2-16 rows of 128256 take one launch with bigger chunks (fit_split: 8 rows -> 16 programs of
    8192 a row), more rows one persistent launch of 8 rows at a time in waves; with per-row
    parameters (greedy, min-p, top-k up to 100 with and without top-p, top-p alone) every row draws
    the two launches' token for the same seeds and offset."""
    k = _k()
    calls = _count_wave_launches(monkeypatch, k, "sample_one_launch")
    V = 128256
    g = torch.Generator().manual_seed(B)
    mixes = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (0.7, 50, 0.9, 0.0), (0.9, 100, 1.0, 0.0),
             (0.7, 0, 0.9, 0.0), (1.2, 0, 0.5, 0.02), (0.8, 20, 1.0, 0.05), (1.0, 0, 0.99, 0.0)]
    rows = [mixes[i % len(mixes)] for i in range(B)]
    T, K, Pp, MP = (torch.tensor([r[j] for r in rows], device=cuda) for j in range(4))
    seed = torch.arange(B, device=cuda) + 3
    for i in range(8):
        x = (torch.randn(B, V, generator=g) * (1 + i % 4)).to(cuda)
        if i % 3 == 0:
            x[0, : V // 2] = -math.inf
        off = torch.full((1,), i, dtype=torch.int64, device=cuda)
        one = ember.ops.sample(x, temperature=T, top_k=K.long(), top_p=Pp, min_p=MP, seed=seed, offset=off.clone())
        two = _sample_two_launch(x, T, K.long(), Pp, MP, seed=seed, offset=off.clone())
        assert torch.equal(one, two), (i, one, two)
        probs = S.sampling_probs_reference(x, T, K.long(), Pp, MP)
        assert bool((probs[torch.arange(B), one.cpu()] > 0).all())
    assert len(calls) == 8
    torch.cuda.synchronize()
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", x.device.index)])
    assert k.barrier_give_ups(x.device) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 40])
@pytest.mark.parametrize("every_row", ["temperature_only", "top_k"])
def test_gpu_sample_every_row_promise_same_tokens(cuda, monkeypatch, B, every_row):
    """Per-row tensors with the promise take the specialised path (the barrier-free race / the tagged
    top-k words at 1 and 8 rows) and draw the same tokens as without it and as the two launches, for
    the same per-row seeds and offset."""
    k = _k()
    from ember.kernels.sampling import sampler
    taken = []
    for name in ("temperature_alone", "topk_tagged"):
        real = getattr(sampler, name)
        monkeypatch.setattr(sampler, name, lambda *a, _real=real, _name=name: taken.append((_name, _real(*a)))
                            or _real(*a))
    g = torch.Generator(device=cuda).manual_seed(B)
    t = 0.5 + torch.rand(B, device=cuda, generator=g)
    if every_row == "top_k":
        mix = dict(temperature=t, top_k=torch.randint(1, 120, (B,), device=cuda, generator=g),
                   top_p=0.5 + 0.5 * torch.rand(B, device=cuda, generator=g))
    else:
        mix = dict(temperature=t, top_k=torch.zeros(B, dtype=torch.int64, device=cuda))
    seeds = torch.arange(B, device=cuda) * 7 + 1
    for i in range(5):
        x = torch.randn(B, 128256, device=cuda, generator=g) * (1 + i % 3)
        offs = [torch.full((1,), i, dtype=torch.int64, device=cuda) for _ in range(3)]
        promised = ember.ops.sample(x, **mix, seed=seeds, offset=offs[0], every_row=every_row)
        plain = ember.ops.sample(x, **mix, seed=seeds, offset=offs[1])
        two = _sample_two_launch(x, **mix, seed=seeds, offset=offs[2])
        assert torch.equal(promised, plain) and torch.equal(promised, two), (i, promised, plain, two)
    want = "temperature_alone" if every_row == "temperature_only" else "topk_tagged"
    if B <= 8:  # one launch (40 rows: two launches, as for these scalars)
        assert (want, True) in taken, taken


# ------------------------------------------------------------------ advance_seed (the engine's draw)
_WRAP_SEEDS = [(1 << 63) - 5, -(1 << 63) + 3, 0, 12345, -7]   # both ends of int64: the advance wraps


def _advanced(seeds):
    return [((s + S.SEED_STEP + (1 << 63)) % (1 << 64)) - (1 << 63) for s in seeds]


def _advance_seed_case(path, B, device):
    """(per-row parameters, sample_one_launch keywords) for one of the sampler's paths."""
    def col(v, dtype=torch.float32):
        return torch.tensor(v, dtype=dtype, device=device)
    if path == "free":       # every row temperature alone: the barrier-free race
        return (dict(temperature=col([0.8 + 0.1 * r for r in range(B)]), top_k=col([0] * B, torch.int64),
                     top_p=col([1.0] * B), min_p=col([0.0] * B)), dict(every_row="temperature_only"))
    if path == "tagged":     # every row top-k: the tagged words
        return (dict(temperature=col([0.7] * B), top_k=col([10 + 5 * r for r in range(B)], torch.int64),
                     top_p=col([0.9] * B), min_p=col([0.0] * B)), dict(every_row="top_k"))
    mixes = [SAMPLE_MIXES[i % 5] for i in range(B)]   # top-k + top-p, min-p, greedy, top-p alone, k > pieces
    rows = dict(temperature=col([m["temperature"] for m in mixes]),
                top_k=col([m["top_k"] for m in mixes], torch.int64), top_p=col([m["top_p"] for m in mixes]),
                min_p=col([m["min_p"] for m in mixes]))
    return rows, {}


def test_sample_advance_seed_every_path_interpreter(interpreter):
    """``advance_seed``: the finisher of each row, on every path of the sampler (two launches, the grid
    barrier over mixed rows, waves, the barrier-free race, the tagged top-k words), writes the row's
    seed + SEED_STEP (wrapping at 2^64), and the tokens are those the same per-row seeds draw
    without it (the two launches' without advancing: the paths draw the same tokens)."""
    k = _k()
    B = len(_WRAP_SEEDS)
    x = torch.randn(B, 5000) * 3    # 5 programs a row (the interpreter's cost is per program)
    keys = torch.tensor(_WRAP_SEEDS, dtype=torch.int64)
    for group, paths in (("mixed", ("two_launch", "grid", "waves")), ("free", ("grid",)), ("tagged", ("grid",))):
        rows, kw = _advance_seed_case(group, B, CPU)
        want = poisoned((B,), torch.int64, "cpu")
        k.sample_two_launch(x, want, *rows.values(), keys, 3)
        for path in paths:
            seeds = keys.clone()
            got = poisoned((B,), torch.int64, "cpu")
            if path == "two_launch":
                k.sample_two_launch(x, got, *rows.values(), seeds, 3, advance_seed=True)
            else:
                k.sample_one_launch(x, got, *rows.values(), seeds, 3, spin_cap=2, advance_seed=True,
                                    **(dict(chunk=2048, rows_per_wave=2) if path == "waves" else kw))
            assert torch.equal(got, want), (group, path, got, want)
            assert seeds.tolist() == _advanced(_WRAP_SEEDS), (group, path)
    assert keys.tolist() == _WRAP_SEEDS
    _assert_workspace_clean(_grid()._WORKSPACES[("cpu", None)])


def test_sample_advance_seed_reference_and_errors():
    """The reference path advances the seeds as the kernels do; advance_seed needs a contiguous int64
    tensor of one seed per row, and says which part is wrong."""
    x = torch.randn(3, 50)
    seeds = torch.tensor(_WRAP_SEEDS[:3])
    want = S.sample_reference(x, 0.7, 5, 0.9, 0.0, seeds.clone())
    got = ember.ops.sample(x, temperature=0.7, top_k=5, top_p=0.9, seed=seeds, advance_seed=True)
    assert torch.equal(got, want)
    assert seeds.tolist() == _advanced(_WRAP_SEEDS[:3])
    with pytest.raises(ValueError, match="advance_seed: expected seed to be an int64 tensor.*seed=5"):
        ember.ops.sample(x, seed=5, advance_seed=True)
    with pytest.raises(ValueError, match=r"advance_seed: .*3 \(logits.shape\[0\]\) elements, got dtype int64, shape \(1,\)"):
        ember.ops.sample(x, seed=torch.tensor([1]), advance_seed=True)
    with pytest.raises(ValueError, match="int32"):
        ember.ops.sample(x, seed=torch.tensor([1, 2, 3], dtype=torch.int32), advance_seed=True)
    with pytest.raises(ValueError, match="not contiguous"):
        ember.ops.sample(x, seed=torch.arange(6)[::2], advance_seed=True)
    with pytest.raises(TypeError, match="advance_seed: expected a bool, got int"):
        ember.ops.sample(x, seed=seeds, advance_seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 40])
@pytest.mark.parametrize("path", ["mixed", "free", "tagged"])
def test_gpu_sample_advance_seed_same_tokens_in_a_graph(cuda, B, path):
    """On the GPU (every one-launch path is co-resident there): ``advance_seed`` draws the tokens the
    same per-row seeds draw without it, advances each seed by SEED_STEP, and in a captured graph each
    replay draws the next step's tokens, as eager calls with the advanced seeds do."""
    seeds0 = _advanced([(_WRAP_SEEDS * 8)[r] + r for r in range(B)])   # (distinct rows, wrapped to int64)
    rows, kw = _advance_seed_case(path, B, cuda)
    every_row = kw.get("every_row")
    x = torch.randn(B, 128256, device=cuda) * 3
    keys = torch.tensor(seeds0, device=cuda)
    eager = []
    for _ in range(3):
        want = ember.ops.sample(x, **rows, seed=keys.clone(), every_row=every_row)
        seeds = keys.clone()
        got = ember.ops.sample(x, **rows, seed=seeds, every_row=every_row, advance_seed=True)
        assert torch.equal(got, want), (B, path, got, want)
        assert seeds.tolist() == _advanced(keys.tolist())
        eager.append(got)
        keys = seeds
    seeds = torch.tensor(seeds0, device=cuda)
    out = torch.empty(B, dtype=torch.int64, device=cuda)
    ember.ops.sample(x, **rows, seed=seeds.clone(), every_row=every_row, advance_seed=True, check=False)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(ember.ops.sample(x, **rows, seed=seeds, every_row=every_row, advance_seed=True, check=False))
    seeds.copy_(torch.tensor(seeds0, device=cuda))
    for step in range(3):
        graph.replay()
        assert torch.equal(out, eager[step]), (B, path, step)
    torch.cuda.synchronize()
    _assert_workspace_clean(_grid()._WORKSPACES[("cuda", x.device.index)])
