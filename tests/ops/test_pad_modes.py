"""ember.ops.pad's reflect / replicate / circular modes against F.pad, bit for bit.

The oracle is torch's own F.pad on CPU: where it pads, ours must give the same bits; where it
refuses, ours must refuse with a named ValueError / TypeError. One gap is deliberate: circular pads
larger than what is left of the dim after cropping, where F.pad either refuses (overlapping copy)
or returns memory it never wrote; ours always refuses.
"""
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ember
from ember import _dispatch

assert callable(ember.ops.pad)  # the function first: importing the module by name would shadow it
pad_reference = sys.modules["ember.ops.pad"].pad_reference
from tests.helpers import poisoned  # noqa: E402
from tests.ops.test_pad import DTYPES, _launches, assert_bitwise, make  # noqa: E402

MODES = ["reflect", "replicate", "circular"]
ALL_DTYPES = DTYPES + [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
# (rank, number of padded dims) F.pad accepts for these modes
RANKS = [(2, 1), (3, 1), (3, 2), (4, 2), (4, 3), (5, 3)]


def fpad_accepts(mode, dtype):
    try:
        F.pad(torch.zeros(1, 2, dtype=dtype), (1, 1), mode=mode)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def wraps_past_the_cropped_dim(shape, pad):
    """Circular pads beyond what is left after cropping: undefined in F.pad, refused by ours."""
    for k in range(len(pad) // 2):
        lo, hi, n = pad[2 * k], pad[2 * k + 1], shape[len(shape) - 1 - k]
        if max(lo, hi) > n + min(lo, 0) + min(hi, 0):
            return True
    return False


@st.composite
def mode_cases(draw, dtypes=None, max_side=5):
    mode = draw(st.sampled_from(MODES))
    rank, n_padded = draw(st.sampled_from(RANKS))
    shape = draw(st.lists(st.integers(1, max_side), min_size=rank, max_size=rank))
    if draw(st.integers(0, 9)) == 0:
        shape[draw(st.integers(0, rank - 1))] = 0  # empty dims: allowed in some places only
    pad = []
    for k in range(n_padded):
        n = shape[rank - 1 - k]
        # within reflect's limit mostly, now and then past it (replicate takes any pad)
        reach = n + 1 if draw(st.integers(0, 7)) == 0 else n - 1 if mode != "replicate" else n + 2
        reach = max(reach, -n)
        pad += [draw(st.integers(-n, reach)), draw(st.integers(-n, reach))]
    choices = [d for d in (dtypes or ALL_DTYPES) if mode == "circular" or fpad_accepts(mode, d)]
    dtype = draw(st.sampled_from(choices))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    return mode, shape, tuple(pad), dtype, layout


def check_against_fpad(fn, mode, x, pad):
    try:
        expected = F.pad(x, pad, mode=mode)
    except (RuntimeError, NotImplementedError):
        expected = None
    if expected is None or (mode == "circular" and wraps_past_the_cropped_dim(x.shape, pad)):
        with pytest.raises((ValueError, TypeError)):
            fn(x, pad, mode)
        return
    assert_bitwise(fn(x, pad, mode), expected)


# ------------------------------------------------------------------ bitwise vs F.pad
@settings(max_examples=150, deadline=None)
@given(case=mode_cases())
def test_reference_bitwise_equals_fpad(case):
    mode, shape, pad, dtype, layout = case
    check_against_fpad(pad_reference, mode, make(shape, dtype, layout), pad)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mode_cases())
def test_kernel_bitwise_equals_fpad_interpreter(interpreter, case):
    mode, shape, pad, dtype, layout = case
    check_against_fpad(ember.ops.pad, mode, make(shape, dtype, layout), pad)


@st.composite
def long_row_cases(draw):
    """Rows of hundreds of bytes: the 16-byte data chunks plus the border programs."""
    mode = draw(st.sampled_from(MODES))
    rank, n_padded = draw(st.sampled_from(RANKS[:4]))
    shape = [draw(st.integers(1, 3)) for _ in range(rank - 1)] + [draw(st.integers(40, 400))]
    pad = []
    for k in range(n_padded):
        n = shape[rank - 1 - k]
        most = min(n - 1, 40 if k == 0 else 2)  # wide row pads (reflect: below n), few extra rows
        pad += [draw(st.integers(-min(n - 1, 5), most)), draw(st.integers(-min(n - 1, 5), most))]
    dtype = draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.float64]))
    offset = draw(st.integers(0, 3))  # x starts this many elements into its storage
    return mode, shape, tuple(pad), dtype, offset


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=long_row_cases())
def test_long_rows_bitwise_equals_fpad_interpreter(interpreter, case):
    mode, shape, pad, dtype, offset = case
    x = make(shape[:-1] + [shape[-1] + offset], dtype)[..., offset:]
    check_against_fpad(ember.ops.pad, mode, x, pad)


@pytest.mark.parametrize("mode", MODES)
def test_rows_of_several_column_blocks_interpreter(interpreter, mode):
    # rows past one program's 2 KB of chunks: several data blocks, borders longer than a block
    x = make((2, 3100), torch.bfloat16)
    for pad in [(700, 900), (1, 2), (-3, 1500)]:
        assert_bitwise(ember.ops.pad(x, pad, mode), F.pad(x, pad, mode=mode))
    x8 = make((1, 2, 700), torch.float64)[..., 1:]
    assert_bitwise(ember.ops.pad(x8, (300, 5, 1, 1), mode), F.pad(x8, (300, 5, 1, 1), mode=mode))


@pytest.mark.parametrize("mode", MODES)
def test_one_launch_per_call_on_both_paths_interpreter(interpreter, monkeypatch, mode):
    launches = _launches(monkeypatch)
    x = make((2, 3, 300), torch.bfloat16)
    xt = make((2, 3, 30), torch.bfloat16, "transposed")  # columns not unit-stride: the element path
    assert_bitwise(ember.ops.pad(x, (37, 21), mode), F.pad(x, (37, 21), mode=mode))
    assert_bitwise(ember.ops.pad(xt, (3, 2, 1, 2), mode), F.pad(xt, (3, 2, 1, 2), mode=mode))
    assert [(m["WIDE"], m["MODE"]) for m in launches] == [(True, MODES.index(mode) + 1), (False, MODES.index(mode) + 1)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_every_dtype_as_fpad_takes_it_interpreter(interpreter, mode, dtype):
    x = make((2, 3, 37), dtype, "transposed")
    if not fpad_accepts(mode, dtype):  # bool, fp8 and the wide unsigned ints for reflect / replicate
        with pytest.raises(TypeError, match=f"x: mode '{mode}' expected dtype in .*got {str(dtype)[6:]}"):
            ember.ops.pad(x, (1, 1), mode)
        with pytest.raises(TypeError, match=f"mode '{mode}'"):
            pad_reference(x, (1, 1), mode)
        return
    for pad in [(3, 5), (-2, 4, 1, 0)]:
        expected = F.pad(x, pad, mode=mode)
        assert_bitwise(ember.ops.pad(x, pad, mode), expected)
        assert_bitwise(pad_reference(x, pad, mode), expected)
    wide = make((2, 2, 3, 45), dtype)[..., 1:]  # unit-stride rows, off the 4-byte grid
    assert_bitwise(ember.ops.pad(wide, (5, 3, 1, 1, 1, 0), mode), F.pad(wide, (5, 3, 1, 1, 1, 0), mode=mode))


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_inputs_and_out_interpreter(interpreter, mode):
    base = make((3, 5, 41), torch.bfloat16)
    for x in [base[..., 1:], base[:, 1:, 3:-2], base[:, ::2, 1:], base.transpose(1, 2)]:
        pad = (2, 3, 1, 0)
        expected = F.pad(x, pad, mode=mode)
        assert_bitwise(ember.ops.pad(x, pad, mode), expected)
        out = poisoned(expected.shape, torch.bfloat16, "cpu")
        assert ember.ops.pad(x, pad, mode, out=out) is out
        assert_bitwise(out, expected)
        buf = poisoned((expected.numel() + 1,), torch.bfloat16, "cpu")  # an out off the 16-byte grid
        ember.ops.pad(x, pad, mode, out=buf[1:].view(expected.shape))
        assert_bitwise(buf[1:].view(expected.shape), expected)
    out_t = poisoned((47, 5, 3), torch.bfloat16, "cpu").permute(2, 1, 0)  # a transposed out
    ember.ops.pad(base, (3, 3), mode, out=out_t)
    assert_bitwise(out_t, F.pad(base, (3, 3), mode=mode))


@pytest.mark.parametrize("path", ["reference", "interpreter"])
def test_out_on_the_reference_path(request, path):
    if path == "interpreter":
        request.getfixturevalue("interpreter")
    x = make((2, 3, 4, 5), torch.float32, "strided")
    for mode in MODES:
        expected = F.pad(x, (1, 2, -1, 3), mode=mode)
        out = poisoned(expected.shape, torch.float32, "cpu")
        ember.ops.pad(x, (1, 2, -1, 3), mode, out=out)
        assert_bitwise(out, expected)


def test_circular_crops_first_then_wraps():
    # F.pad crops, then wraps around what is left: (2, -1) on [0..4] wraps around [0..3]
    x = make((2, 5), torch.float32)
    for pad in [(2, -1), (-1, 3), (-2, 3), (4, -1), (0, -5)]:
        assert_bitwise(ember.ops.pad(x, pad, "circular"), F.pad(x, pad, mode="circular"))


def test_compiles_fullgraph():
    x = torch.randn(2, 3, 40)

    def f(t):
        return ember.ops.pad(t, (5, 7), "reflect") * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert_bitwise(compiled(x), F.pad(x, (5, 7), mode="reflect") * 2)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("mode, shape, pad, words", [
    ("reflect", (2, 3, 5), (5, 0), "mode 'reflect' expected amounts below the size of dim 2 (5), got (5, 0)"),
    ("reflect", (2, 4, 5), (1, 1, 0, 4), "below the size of dim 1 (4), got (0, 4)"),
    ("circular", (2, 3, 5), (1, 6), "mode 'circular' expected amounts of at most the size of dim 2 after cropping "
                                    "(5), got (1, 6)"),
    ("circular", (1, 3), (3, -2), "after cropping (1), got (3, -2)"),
    ("replicate", (5,), (1, 1), "mode 'replicate' pads the last 1, 2 or 3 dims"),
    ("reflect", (2, 3, 4, 5), (1, 1), "got 2 amounts for a 4-d x"),
    ("circular", (2, 3, 4, 5, 6), (1, 1) * 4, "got 8 amounts for a 5-d x"),
    ("reflect", (2, 0, 5), (1, 1), "mode 'reflect' expected non-empty dims (but the batch dim), got size 0 in dim 1"),
    ("replicate", (0, 5), (1, 1), "got size 0 in dim 0"),
    ("replicate", (2, 5), (-5, 0), "mode 'replicate' expected an output with at least one non-empty padded dim"),
])
def test_bad_amounts_name_the_dim_the_pad_and_the_mode(mode, shape, pad, words):
    x = torch.randn(shape)
    with pytest.raises((RuntimeError, NotImplementedError)):
        F.pad(x, pad, mode=mode)
    for fn in (ember.ops.pad, pad_reference):
        with pytest.raises(ValueError) as info:
            fn(x, pad, mode)
        assert words in str(info.value)


@pytest.mark.parametrize("mode", MODES)
def test_value_with_a_copying_mode(mode):
    x = torch.randn(2, 5)
    for value in (0, 0.0, -0.0, False):  # F.pad takes a zero value as no value
        assert_bitwise(ember.ops.pad(x, (1, 1), mode, value=value), F.pad(x, (1, 1), mode=mode, value=value))
    for value in (1.0, True, float("nan"), 1e-300):
        with pytest.raises(RuntimeError):
            F.pad(x, (1, 1), mode=mode, value=value)
        with pytest.raises(ValueError, match=f"value: mode '{mode}' takes its padding from x; expected value 0"):
            ember.ops.pad(x, (1, 1), mode, value=value)


def test_unknown_mode_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="mode: expected one of 'constant', 'reflect', 'replicate', 'circular', "
                                         "got 'symmetric'"):
        ember.ops.pad(torch.randn(2, 5), (1, 1), "symmetric")


# ------------------------------------------------------------------ bench
def test_bench_suite_quick_runs_on_cpu():
    from ember import bench
    rows = {r.name: r for r in bench.run_suite("pad", quick=True)}
    assert set(rows) == {"pad_reflect_bf16_2x4x4096", "pad_replicate_bf16_2x4x4096", "pad_circular_bf16_2x4x4096"}
    assert all(r.unit == "GB/s" and r.ember > 0 and r.baseline > 0 for r in rows.values())


# ------------------------------------------------------------------ GPU
def to_gpu(x, cuda):
    """x on the GPU with its strides kept (``.to`` would make a strided view contiguous)."""
    y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=cuda)
    return y.copy_(x)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_audio_shape_bf16(cuda, mode):
    # 16 x 64 channels of 2^20 samples, STFT centring for n_fft = 1024; the bench row's shape
    x = torch.randn(16, 64, 1048576, device=cuda).to(torch.bfloat16)
    assert_bitwise(ember.ops.pad(x, (512, 512), mode), F.pad(x, (512, 512), mode=mode))
    if mode == "reflect":
        xs = x[:2, :, 7:-3]  # off the 16-byte grid, odd row length
        assert_bitwise(ember.ops.pad(xs, (200, 201), mode), F.pad(xs, (200, 201), mode=mode))


@pytest.mark.gpu
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mode_cases(max_side=9))
def test_gpu_bitwise_equals_fpad(cuda, case):
    mode, shape, pad, dtype, layout = case
    x = make(shape, dtype, layout)
    if mode == "circular" and wraps_past_the_cropped_dim(shape, pad):
        return
    try:
        expected = F.pad(x, pad, mode=mode)  # the CPU oracle; the GPU run must match it
    except (RuntimeError, NotImplementedError):
        return
    assert_bitwise(ember.ops.pad(to_gpu(x, cuda), pad, mode).cpu(), expected)


@pytest.mark.gpu
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=long_row_cases())
def test_gpu_long_rows_bitwise_equals_fpad(cuda, case):
    mode, shape, pad, dtype, offset = case
    full = make(shape[:-1] + [shape[-1] + offset], dtype)
    x = full[..., offset:]
    try:
        expected = F.pad(x, pad, mode=mode)
    except (RuntimeError, NotImplementedError):
        return
    if mode == "circular" and wraps_past_the_cropped_dim(shape, pad):
        return
    assert_bitwise(ember.ops.pad(full.to(cuda)[..., offset:], pad, mode).cpu(), expected)
