import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ember
from ember import _dispatch

# Reach the family module through the public name first: importing ``ember.ops.pad`` as a module
# before the function is looked up binds the package attribute to the module (same name).
assert callable(ember.ops.pad) and not isinstance(ember.ops.pad, type(sys))
pad_reference = sys.modules["ember.ops.pad"].pad_reference
from tests.helpers import poisoned

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64, torch.complex128]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers, so NaNs, -0.0 and fp8 compare exactly."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(bits(actual.contiguous()), bits(expected.contiguous()))


def make(shape, dtype, layout="contiguous"):
    base = torch.randn(shape) * 5
    if dtype.is_complex:
        base = torch.complex(base, torch.randn(shape))
    x = base.to(dtype)
    if layout == "transposed" and x.dim() >= 2:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    elif layout == "strided":
        x = torch.cat([x, x], dim=-1)[..., ::2] if x.dim() else x
    return x


@st.composite
def cases(draw, max_rank=5, max_side=5):
    rank = draw(st.integers(1, max_rank))
    shape = draw(st.lists(st.integers(0, max_side), min_size=rank, max_size=rank))
    n_padded = draw(st.integers(0, rank))
    pad = []
    for k in range(n_padded):
        n = shape[rank - 1 - k]
        lo = draw(st.integers(-n, 3))  # F.pad itself fails on a crop larger than the input side
        hi = draw(st.integers(max(-n, -(n + lo)), 3))
        pad += [lo, hi]
    dtype = draw(st.sampled_from(DTYPES))
    value = draw(st.sampled_from([0.0, 1.0, 3.0] if dtype == torch.uint8 else [0.0, 1.0, -2.5, 3.0]))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    return shape, tuple(pad), dtype, value, layout


# ------------------------------------------------------------------ reference vs F.pad
@settings(max_examples=300, deadline=None)
@given(cases(max_rank=6))
def test_reference_bitwise_equals_fpad(case):
    shape, pad, dtype, value, layout = case
    x = make(shape, dtype, layout)
    assert_bitwise(pad_reference(x, pad, value=value), F.pad(x, pad, value=value))


# ------------------------------------------------------------------ kernel (interpreter) vs F.pad
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_kernel_bitwise_equals_fpad_interpreter(interpreter, case):
    shape, pad, dtype, value, layout = case
    x = make(shape, dtype, layout)
    assert_bitwise(ember.ops.pad(x, pad, value=value), F.pad(x, pad, value=value))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_every_dtype_rank5_interpreter(interpreter, dtype):
    x = make((2, 3, 4, 5, 6), dtype, "transposed")
    for pad, value in [((1, 1, 1, 1, 2, 0), 0.0), ((-1, 2, 0, -2, 1, 1, 0, 0, -1, 1), 1.0)]:
        assert_bitwise(ember.ops.pad(x, pad, value=value), F.pad(x, pad, value=value))


def test_kernel_high_rank_interpreter(interpreter):
    x = make((2, 3, 3, 2, 2, 3, 2, 3, 2), torch.float32, "transposed")  # rank 9, 7 padded dims
    pad = (1, 0, 0, 1, -1, 1, 1, 1, 0, 1, 1, 0, 1, 1)
    assert_bitwise(ember.ops.pad(x, pad, value=2.0), F.pad(x, pad, value=2.0))


def test_too_many_padded_dims_is_a_clear_error_interpreter(interpreter):
    x = torch.randn(2, 2, 2, 2, 2, 2, 2, 2, 2)
    with pytest.raises(ValueError, match="pad: expected at most 8 dims"):
        ember.ops.pad(x, (1, 0) * 9)


def test_out_is_written_everywhere_interpreter(interpreter):
    x = make((3, 4, 7), torch.bfloat16, "strided")
    pad = (2, -1, 1, 1)
    expected = F.pad(x, pad, value=-1.0)
    out = poisoned(expected.shape, torch.bfloat16, "cpu")
    result = ember.ops.pad(x, pad, value=-1.0, out=out)
    assert result is out
    assert_bitwise(out, expected)
    # a non-contiguous out: a transposed view of a poisoned buffer
    out_t = poisoned(tuple(reversed(expected.shape)), torch.bfloat16, "cpu").permute(2, 1, 0)
    ember.ops.pad(x, pad, value=-1.0, out=out_t)
    assert_bitwise(out_t, expected)


def test_one_kernel_launch_interpreter(interpreter, monkeypatch):
    k = _dispatch.kernels("pad")
    launches = []
    real = k._pad_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(k, "_pad_kernel", Spy())
    x = make((2, 3, 4, 5, 6), torch.bfloat16, "transposed")
    out = ember.ops.pad(x, (1, 1, 1, 1, 2, 0))
    assert len(launches) == 1
    assert_bitwise(out, F.pad(x, (1, 1, 1, 1, 2, 0)))


WIDTHS = {1: [torch.int8, torch.bool, torch.float8_e5m2], 2: [torch.bfloat16], 4: [torch.float32],
          8: [torch.int64, torch.complex64], 16: [torch.complex128]}


@pytest.mark.parametrize("dtype", [d for ds in WIDTHS.values() for d in ds])
def test_wide_rows_every_alignment_interpreter(interpreter, dtype):
    # odd row widths and left pads that put source and output rows at every relative byte offset
    # inside the 8-byte words the 16-byte middle realigns (and rows spanning several word blocks)
    x = make((2, 3, 37), dtype)
    for pad, value in [((1, 1, 1, 1, 2, 0), 0.0), ((3, 2, 0, 1), -2.5), ((5, 0), 1.0), ((-3, 4, -1, 0), 3.0),
                       ((7, -5, 1, 0, 0, 1), 1.0), ((-1, -2), 0.0), ((20, 19), -2.5)]:
        value = 1.0 if dtype == torch.bool and value else value
        assert_bitwise(ember.ops.pad(x, pad, value=value), F.pad(x, pad, value=value))
    long_row = make((2, 700), dtype)  # > 256 words a row for 8-byte elements: the middle loops
    assert_bitwise(ember.ops.pad(long_row, (3, 5), value=1.0), F.pad(long_row, (3, 5), value=1.0))


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float64])
def test_wide_misaligned_views_interpreter(interpreter, dtype):
    base = make((3, 5, 41), dtype)
    for x in [base[..., 1:], base[:, 1:, 3:-2], base[:, ::2, 1:]]:  # odd offsets, strided rows
        pad = (1, 2, 1, 0, 1, 1)
        expected = F.pad(x, pad, value=1.0)
        assert_bitwise(ember.ops.pad(x, pad, value=1.0), expected)
        # an out whose start is off the 16-byte grid takes the element path for the whole row
        buf = poisoned((expected.numel() + 1,), dtype, "cpu")
        out = buf[1:].view(expected.shape)
        ember.ops.pad(x, pad, value=1.0, out=out)
        assert_bitwise(out, expected)


def test_negative_zero_fill_keeps_its_sign_interpreter(interpreter):
    x = make((2, 20), torch.bfloat16)
    for value in (0.0, -0.0, 0.0):  # 0.0 == -0.0: a cache keyed on the value would mix them up
        assert_bitwise(ember.ops.pad(x, (9, 9), value=value), F.pad(x, (9, 9), value=value))


def _launches(monkeypatch):
    k = _dispatch.kernels("pad")
    launches = []
    real = k._pad_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                launches.append(meta)
                return real[grid](*args, **meta)
            return launch

    monkeypatch.setattr(k, "_pad_kernel", Spy())
    return launches


def test_path_choice_interpreter(interpreter, monkeypatch):
    launches = _launches(monkeypatch)
    x = make((2, 3, 4, 6, 10), torch.bfloat16)
    assert_bitwise(ember.ops.pad(x, (1, 1, 1, 1, 2, 0)), F.pad(x, (1, 1, 1, 1, 2, 0)))
    xt = make((2, 3, 4, 6, 10), torch.bfloat16, "transposed")  # columns not unit-stride
    assert_bitwise(ember.ops.pad(xt, (1, 1, 1, 1, 2, 0)), F.pad(xt, (1, 1, 1, 1, 2, 0)))
    assert [m["WIDE"] for m in launches] == [True, False]
    assert [m["N_OUTER"] for m in launches] == [3, 4]


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.complex64])
def test_grid_rows_and_padding_frames_interpreter(interpreter, monkeypatch, dtype):
    # rows long enough that a program takes RB indices of outer dim 1 (grid dims 1, 2 for the
    # outer dims above it), and frames of time padding that take the fill-only branch
    launches = _launches(monkeypatch)
    base = make((1, 2, 12, 541), dtype)
    cases = [(base, (1, 1, 1, 1, 2, 0), 0.0),  # odd offsets below: every source alignment
             (base[..., 1:], (3, -2, 0, 2, 1, 1), 1.0), (base[:, :, 1:, 2:], (-7, 9, -1, 0, 0, 2), -2.5)]
    for x, pad, value in cases:
        assert_bitwise(ember.ops.pad(x, pad, value=value), F.pad(x, pad, value=value))
    assert not any(m["FLAT"] for m in launches) and all(m["WIDE"] for m in launches)


def test_grid_too_tall_falls_back_to_flat_rows_interpreter(interpreter, monkeypatch):
    k = _dispatch.kernels("pad")
    monkeypatch.setattr(k, "_GRID_YZ_MAX", 2)  # CUDA's 65535, made small
    launches = _launches(monkeypatch)
    x = make((2, 3, 5, 541), torch.bfloat16)
    assert_bitwise(ember.ops.pad(x, (1, 1, 1, 1, 2, 0)), F.pad(x, (1, 1, 1, 1, 2, 0)))
    assert [m["FLAT"] for m in launches] == [True]


@st.composite
def long_row_cases(draw):
    """Rows of hundreds of bytes: the 16-byte chunks, the grid rows and the fill-only branch."""
    rank = draw(st.integers(2, 4))
    shape = draw(st.lists(st.integers(1, 3), min_size=rank - 2, max_size=rank - 2))
    shape += [draw(st.integers(1, 12)), draw(st.integers(40, 600))]
    pad = []
    for k in range(draw(st.integers(1, rank))):
        n, most = shape[rank - 1 - k], 20 if k == 0 else 2  # wide row pads, few extra rows
        lo = draw(st.integers(-min(n, most), most))
        pad += [lo, draw(st.integers(max(-n, -(n + lo)), most))]
    dtype = draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.float64]))
    value = draw(st.sampled_from([0.0, 1.0, 3.0]))
    offset = draw(st.integers(0, 3))  # start x this many elements into its storage
    return shape, tuple(pad), dtype, value, offset


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=long_row_cases())
def test_long_rows_bitwise_equals_fpad_interpreter(interpreter, case):
    shape, pad, dtype, value, offset = case
    x = make(shape[:-1] + [shape[-1] + offset], dtype)[..., offset:]
    assert_bitwise(ember.ops.pad(x, pad, value=value), F.pad(x, pad, value=value))


def test_empty_and_zero_sized():
    x = torch.randn(0, 3)
    assert_bitwise(ember.ops.pad(x, (1, 1, 2, 0), value=5.0), F.pad(x, (1, 1, 2, 0), value=5.0))
    assert ember.ops.pad(torch.randn(3, 2), (0, 0, -3, 0)).shape == (0, 2)


def test_empty_input_nonempty_output_interpreter(interpreter):
    x = torch.randn(2, 0, 3)
    assert_bitwise(ember.ops.pad(x, (0, 1, 2, 1), value=7.0), F.pad(x, (0, 1, 2, 1), value=7.0))


def test_compiles_fullgraph():
    x = torch.randn(2, 3, 4)

    def f(t):
        return ember.ops.pad(t, (1, 2, 0, 1), value=0.5) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert_bitwise(compiled(x), F.pad(x, (1, 2, 0, 1), value=0.5) * 2)


# ------------------------------------------------------------------ value: bool, int, float as F.pad takes it
VALUES = [True, False, 0, 1, 3, -2, 0.5, -2.5, -0.0]


def _fits(dtype, value):
    try:
        F.pad(torch.empty(0, dtype=dtype), (1, 0), value=value)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_bool_int_float_reference(dtype):
    x = make((2, 3, 5), dtype, "transposed")
    for value in VALUES:
        if _fits(dtype, value):
            assert_bitwise(pad_reference(x, (1, 2, 0, 1), value=value), F.pad(x, (1, 2, 0, 1), value=value))
            assert_bitwise(ember.ops.pad(x, (1, 2, 0, 1), value=value), F.pad(x, (1, 2, 0, 1), value=value))


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_bool_int_float_interpreter(interpreter, dtype):
    x = make((2, 3, 37), dtype)
    for value in VALUES:
        if _fits(dtype, value):
            assert_bitwise(ember.ops.pad(x, (3, 2, 1, 0), value=value), F.pad(x, (3, 2, 1, 0), value=value))


@pytest.mark.parametrize("path", ["reference", "interpreter"])
def test_bool_tensor_true_false_bitwise(request, path):
    if path == "interpreter":
        request.getfixturevalue("interpreter")
    x = torch.rand(2, 3, 41) > 0.5
    for value in (True, False, 1, 0, 1.0, 0.0, 2, 0.5):
        for pad in [(1, 1, 1, 1, 2, 0), (5, 3), (-2, 7, 1, -1)]:
            expected = F.pad(x, pad, value=value)
            assert_bitwise(ember.ops.pad(x, pad, value=value), expected)
            assert_bitwise(pad_reference(x, pad, value=value), expected)
    assert ember.ops.pad(torch.zeros(2, dtype=torch.bool), (1, 1), value=True).tolist() == [True, False, False, True]


def test_value_int_past_2_53_rounds_as_fpad_does():
    x = torch.zeros(3, dtype=torch.int64)
    big = 2 ** 53 + 1  # not a float: F.pad converts it to one first
    assert_bitwise(ember.ops.pad(x, (1, 1), value=big), F.pad(x, (1, 1), value=big))
    assert_bitwise(pad_reference(x, (1, 1), value=big), F.pad(x, (1, 1), value=big))


@pytest.mark.parametrize("dtype, value", [(torch.uint8, -1), (torch.int8, 300), (torch.float16, 1e300),
                                          (torch.float8_e4m3fn, 1e300), (torch.int32, float("nan"))])
def test_value_that_does_not_fit_is_refused_as_fpad_refuses_it(dtype, value):
    x = torch.zeros(3, dtype=dtype)
    with pytest.raises(RuntimeError):
        F.pad(x, (1, 1), value=value)
    for fn in (ember.ops.pad, pad_reference):
        with pytest.raises(ValueError, match=f"value: .* does not fit in {dtype}"):
            fn(x, (1, 1), value=value)


@pytest.mark.parametrize("value", [1 + 2j, "1", torch.tensor(1.0), None])
def test_value_of_another_type_is_refused(value):
    with pytest.raises(TypeError, match="value: expected a bool, int or float"):
        ember.ops.pad(torch.zeros(3), (1, 1), value=value)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("args, kwargs, exc, words", [
    (("nope", (1, 1)), {}, TypeError, "x: expected a torch.Tensor"),
    ((torch.randn(3), (1,)), {}, ValueError, "pad: expected an even number"),
    ((torch.randn(3), (1, 1, 1, 1)), {}, ValueError, "pad: expected at most 2 amounts"),
    ((torch.randn(3), (1.0, 1)), {}, TypeError, "pad: expected ints"),
    ((torch.randn(3), 2), {}, TypeError, "pad: expected a sequence"),
    ((torch.randn(3), (-2, -2)), {}, ValueError, "negative size -1 in dim 0"),
    ((torch.randn(3), (1, 1)), {"value": "a"}, TypeError, "value: expected a bool, int or float"),
    ((torch.randn(3), (1, 1), 1.0), {}, ValueError, "pass it as value="),
    ((torch.randn(1, 3), (1, 1), "mirror"), {}, ValueError, "mode: expected one of 'constant', 'reflect'"),
    ((torch.randn(3), (1, 1)), {"out": torch.empty(4)}, ValueError, "out: expected shape (5,)"),
    ((torch.randn(3), (1, 1)), {"out": torch.empty(5, dtype=torch.float16)}, TypeError, "out: expected dtype"),
])
def test_bad_input(args, kwargs, exc, words):
    with pytest.raises(exc, match=None) as info:
        ember.ops.pad(*args, **kwargs)
    assert words in str(info.value)


def test_out_sharing_x_is_rejected():
    buf = torch.zeros(10)
    with pytest.raises(ValueError, match="out: expected memory separate from x"):
        ember.ops.pad(buf[:3], (1, 1), out=buf[5:10])


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_rank5_bf16_large_plane_exact(cuda):
    # H*W = 256*512 = 131072 >= 65536: the size at which rank-5 F.pad went wrong on Apple GPUs
    x = torch.randn(1, 16, 4, 256, 512, device=cuda).to(torch.bfloat16)
    for pad in [(1, 1, 1, 1, 2, 0), (-3, 2, 1, -1, 0, 1, 2, 2)]:
        assert_bitwise(ember.ops.pad(x, pad), F.pad(x, pad))
    xt = x.permute(0, 2, 1, 3, 4)  # non-contiguous
    pad = (1, 1, 1, 1, 0, 0, 0, 0)
    assert_bitwise(ember.ops.pad(xt, pad, value=3.0), F.pad(xt, pad, value=3.0))


@pytest.mark.gpu  # (examples bounded by compile time: ~1.5 s for each new kernel variant they reach)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(max_rank=6, max_side=9))
def test_gpu_bitwise_equals_fpad(cuda, case):
    shape, pad, dtype, value, layout = case
    x = make(shape, dtype, layout).to(cuda)
    assert_bitwise(ember.ops.pad(x, pad, value=value), F.pad(x, pad, value=value))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_every_dtype_out(cuda, dtype):
    x = make((2, 3, 5, 67, 130), dtype, "transposed").to(cuda)
    expected = F.pad(x, (1, 2, -1, 3, 2, 0), value=1.0)
    out = torch.empty(expected.shape, dtype=dtype, device=cuda)
    if dtype.is_floating_point:
        out.fill_(float("nan")) if dtype.itemsize > 1 else out.view(torch.uint8).fill_(0x7F)
    ember.ops.pad(x, (1, 2, -1, 3, 2, 0), value=1.0, out=out)
    assert_bitwise(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.float64])
def test_gpu_video_shapes_every_width(cuda, dtype):
    # causal-conv pads on video-like shapes: the grid rows, the fill-only time frames, x at every
    # alignment and a wide, strided out
    x = make((1, 8, 4, 64, 258), dtype).to(cuda)
    for xv in [x, x[..., 1:], x[..., 3:-2], x[:, :, :, 1:, :]]:
        for pad, value in [((1, 1, 1, 1, 2, 0), 0.0), ((1, 1, 1, 1, 0, 0, 0, 0), 1.0), ((-3, 5, 2, -1, 1, 1), 3.0)]:
            assert_bitwise(ember.ops.pad(xv, pad, value=value), F.pad(xv, pad, value=value))
    out = torch.empty(1, 8, 6, 66, 300, dtype=dtype, device=cuda)[..., 8:268]
    ember.ops.pad(x, (1, 1, 1, 1, 2, 0), value=1.0, out=out)
    assert_bitwise(out, F.pad(x, (1, 1, 1, 1, 2, 0), value=1.0))


@pytest.mark.gpu
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=long_row_cases())
def test_gpu_long_rows_bitwise_equals_fpad(cuda, case):
    shape, pad, dtype, value, offset = case
    x = make(shape[:-1] + [shape[-1] + offset], dtype)[..., offset:].to(cuda)
    assert_bitwise(ember.ops.pad(x, pad, value=value), F.pad(x, pad, value=value))

