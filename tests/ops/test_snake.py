import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ember
from ember import _dispatch, tuning
from tests.helpers import ROUNDED_ONCE, assert_close, check_compile_and_graph, poisoned

snake_mod = sys.modules["ember.ops.snake"]
snake_reference = snake_mod.snake_reference
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def float64_snake(x, alpha, beta=None, logscale=False):
    """The formula in float64, parameters broadcast over [B, C, T]."""
    a = alpha.double().reshape(1, -1, 1)
    d = a if beta is None else beta.double().reshape(1, -1, 1)
    if logscale:
        a, d = a.exp(), d.exp()
    x = x.double()
    return x + torch.sin(a * x) ** 2 / (d + 1e-9)


def params(C, shape3d, logscale, beta, dtype=torch.float32):
    shape = (1, C, 1) if shape3d else (C,)
    if logscale:  # logarithms: exp() lands in [0.37, 2.7]
        a = torch.empty(shape).uniform_(-1, 1)
        b = torch.empty(shape).uniform_(-1, 1) if beta else None
    else:
        a = torch.empty(shape).uniform_(0.2, 3.0)
        b = torch.empty(shape).uniform_(0.2, 3.0) if beta else None
    return a.to(dtype), (b.to(dtype) if b is not None else None)


def layout(x, kind):
    if kind == "channels_last":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "strided":
        return torch.cat([x, x], dim=2)[:, :, ::2]
    return x


@st.composite
def cases(draw, max_side=9):
    B, C, T = (draw(st.integers(1, 3)), draw(st.integers(1, max_side)), draw(st.integers(1, 2 * max_side)))
    return (B, C, T, draw(st.sampled_from(DTYPES)), draw(st.booleans()), draw(st.booleans()),
            draw(st.booleans()), draw(st.sampled_from(["contiguous", "channels_last", "strided"])))


# ------------------------------------------------------------------ reference vs float64
@settings(max_examples=60, deadline=None)
@given(cases(max_side=40))
def test_reference_matches_float64(case):
    B, C, T, dtype, beta, logscale, shape3d, kind = case
    a, b = params(C, shape3d, logscale, beta)
    x = layout((torch.randn(B, C, T) * 3).to(dtype), kind)
    y = snake_reference(x, a, b, logscale=logscale)
    assert y.dtype == dtype
    # float32 math rounded once: within the output dtype's rounding of the exact value
    assert_close(y, float64_snake(x, a, b, logscale), dtype)


# ------------------------------------------------------------------ the modules the op replaces
def test_reference_equals_transformers_dac_snake():
    from transformers.models.dac.modeling_dac import Snake1d
    m = Snake1d(7)
    with torch.no_grad():
        m.alpha.uniform_(0.1, 2.0)
    x = torch.randn(3, 7, 50) * 4
    with torch.no_grad():
        assert torch.equal(ember.ops.snake(x, m.alpha), m(x))
        assert torch.equal(ember.ops.snake(x, m.alpha.reshape(7)), m(x))


@pytest.mark.parametrize("logscale", [True, False])
def test_reference_equals_diffusers_oobleck_snake(logscale):
    from diffusers.models.autoencoders.autoencoder_oobleck import Snake1d
    m = Snake1d(6, logscale=logscale)
    with torch.no_grad():
        if logscale:
            m.alpha.uniform_(-1, 1), m.beta.uniform_(-1, 1)
        else:
            m.alpha.uniform_(0.2, 2), m.beta.uniform_(0.2, 2)
    x = torch.randn(2, 6, 40) * 4
    with torch.no_grad():
        assert torch.equal(ember.ops.snake(x, m.alpha, beta=m.beta, logscale=logscale), m(x))


def _swap_snakes(model, cls, with_beta):
    """Every ``cls`` module of ``model`` forwards through ember.ops.snake instead."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, cls):
            if with_beta:
                mod.forward = (lambda m: lambda h: ember.ops.snake(h, m.alpha, beta=m.beta, logscale=m.logscale))(mod)
            else:
                mod.forward = (lambda m: lambda h: ember.ops.snake(h, m.alpha))(mod)
            n += 1
    return n


@pytest.mark.parametrize("force", [False, True], ids=["reference", "interpreter"])
def test_tiny_dac_model_with_ember_snake(monkeypatch, force):
    from transformers import DacConfig, DacModel
    from transformers.models.dac.modeling_dac import Snake1d
    cfg = DacConfig(encoder_hidden_size=4, downsampling_ratios=[2, 2], decoder_hidden_size=8,
                    upsampling_ratios=[2, 2], n_codebooks=2, codebook_size=8, codebook_dim=4, hidden_size=8)
    model = DacModel(cfg).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Snake1d):
                mod.alpha.uniform_(0.3, 2.0)
    audio = torch.randn(1, 1, 64)
    with torch.no_grad():
        expected = model(audio).audio_values
        if force:
            monkeypatch.setenv("EMBER_FORCE_TRITON", "1")
            if not _dispatch.triton_available() or torch.cuda.is_available():
                pytest.skip("interpreter runs on CPU-only machines with triton")
        assert _swap_snakes(model, Snake1d, False) > 4
        got = model(audio).audio_values
    if force:  # the interpreter's numpy sin may differ from torch's in the last bit
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(got, expected)


def test_tiny_oobleck_decoder_with_ember_snake():
    from diffusers import AutoencoderOobleck
    from diffusers.models.autoencoders.autoencoder_oobleck import Snake1d
    vae = AutoencoderOobleck(encoder_hidden_size=4, downsampling_ratios=[2, 2], channel_multiples=[1, 2],
                             decoder_channels=4, decoder_input_channels=4, audio_channels=1).eval()
    with torch.no_grad():
        for mod in vae.modules():
            if isinstance(mod, Snake1d):
                mod.alpha.uniform_(-0.5, 0.5), mod.beta.uniform_(-0.5, 0.5)
    z = torch.randn(1, 4, 8)
    with torch.no_grad():
        expected = vae.decode(z).sample
        assert _swap_snakes(vae, Snake1d, True) > 4
        assert torch.equal(vae.decode(z).sample, expected)


# ------------------------------------------------------------------ kernel (interpreter) vs reference
def _kernel_close(y, exp, dtype):
    if dtype == torch.float32:  # the interpreter's numpy sin vs torch's: last-bit differences
        torch.testing.assert_close(y, exp, atol=2e-6, rtol=2e-6)
    else:  # ... which may flip one rounding to the output dtype
        atol, rtol = ROUNDED_ONCE[dtype]
        torch.testing.assert_close(y.float(), exp.float(), atol=atol, rtol=rtol)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_kernel_matches_reference_interpreter(interpreter, case):
    B, C, T, dtype, beta, logscale, shape3d, kind = case
    a, b = params(C, shape3d, logscale, beta, dtype=torch.bfloat16 if C % 2 else torch.float32)
    x = layout((torch.randn(B, C, T) * 3).to(dtype), kind)
    _kernel_close(ember.ops.snake(x, a, beta=b, logscale=logscale), snake_reference(x, a, b, logscale=logscale),
                  dtype)


@pytest.mark.parametrize("key", ["time", "strided"])
def test_kernel_small_tiles_cover_everything_interpreter(interpreter, key):
    x = torch.randn(3, 7, 13) * 3
    if key == "strided":
        x = layout(x, "channels_last")
    a, b = params(7, False, True, True)
    exp = snake_reference(x, a, b, logscale=True)
    for bc, bt in [(1, 1), (2, 4), (4, 2), (8, 16)]:
        with tuning.override("snake", {key: {"BLOCK_C": bc, "BLOCK_T": bt, "num_warps": 1}}):
            out = poisoned(x.shape, x.dtype, "cpu")
            ember.ops.snake(x, a, beta=b, logscale=True, out=out)
        _kernel_close(out, exp, torch.float32)


def test_kernel_out_views_and_in_place_interpreter(interpreter):
    x = (torch.randn(2, 5, 19) * 3).to(torch.bfloat16)
    a = (torch.rand(1, 10, 1) + 0.5)[:, ::2]  # a strided parameter view
    exp = snake_reference(x, a)
    out = poisoned((2, 19, 5), torch.bfloat16, "cpu").transpose(1, 2)  # a channels-last out
    assert ember.ops.snake(x, a, out=out) is out
    _kernel_close(out, exp, torch.bfloat16)
    y = x.clone()
    assert ember.ops.snake(y, a, out=y) is y
    _kernel_close(y, exp, torch.bfloat16)


def test_one_kernel_launch_interpreter(interpreter, monkeypatch):
    k = _dispatch.kernels("snake")
    launches = []
    real = k._snake_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(k, "_snake_kernel", Spy())
    x = torch.randn(2, 4, 9)
    ember.ops.snake(x, torch.ones(4), beta=torch.ones(4), logscale=True)
    assert len(launches) == 1


def test_empty_input():
    x = torch.randn(2, 3, 0)
    assert ember.ops.snake(x, torch.ones(3)).shape == (2, 3, 0)


# ------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("force", [False, True], ids=["reference", "interpreter"])
def test_compile_fullgraph(monkeypatch, force):
    from tests.helpers import force_triton_or_skip
    force_triton_or_skip(monkeypatch, force)
    a, b = torch.rand(4) + 0.5, torch.rand(4) + 0.5
    x = torch.randn(2, 4, 11)

    def f(x):
        y = ember.ops.snake(x, a, beta=b) * 2
        out = torch.empty_like(y)
        ember.ops.snake(y, a, out=out)
        return out

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(got, f(x), atol=0, rtol=0)


# ------------------------------------------------------------------ backward
@pytest.mark.parametrize("force", [False, True], ids=["reference", "interpreter"])
@pytest.mark.parametrize("beta,logscale,shape3d", [(False, False, False), (False, True, True), (True, False, True),
                                                   (True, True, False)])
def test_backward_matches_float64(monkeypatch, force, beta, logscale, shape3d):
    from tests.helpers import force_triton_or_skip
    force_triton_or_skip(monkeypatch, force)
    a, b = params(5, shape3d, logscale, beta)
    x = torch.randn(2, 5, 17) * 3
    g = torch.randn(2, 5, 17)
    leaves = [t.clone().requires_grad_() for t in (x, a) + ((b,) if beta else ())]
    ember.ops.snake(leaves[0], leaves[1], beta=leaves[2] if beta else None, logscale=logscale).backward(g)
    exact = [t.double().requires_grad_() for t in (x, a) + ((b,) if beta else ())]
    float64_snake(exact[0], exact[1], exact[2] if beta else None, logscale).backward(g.double())
    for got, ref in zip(leaves, exact):
        assert got.grad.shape == got.shape and got.grad.dtype == torch.float32
        # float32 sums of T * B = 34 terms
        torch.testing.assert_close(got.grad, ref.grad.float(), atol=1e-5, rtol=1e-5)


def test_backward_under_compile_and_bf16():
    a = (torch.rand(1, 4, 1) + 0.5).requires_grad_()
    x = (torch.randn(2, 4, 9) * 2).to(torch.bfloat16).requires_grad_()
    torch._dynamo.reset()
    y = torch.compile(lambda x, a: ember.ops.snake(x, a), fullgraph=True, backend="aot_eager")(x, a)
    y.float().sum().backward()
    xe, ae = x.detach().clone().requires_grad_(), a.detach().clone().requires_grad_()
    ember.ops.snake(xe, ae).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, xe.grad) and torch.equal(a.grad, ae.grad)


# ------------------------------------------------------------------ bad input
def test_bad_inputs():
    x, a = torch.randn(2, 4, 8), torch.ones(4)
    with pytest.raises(ValueError, match="x: expected a 3-d tensor"):
        ember.ops.snake(torch.randn(4, 8), a)
    with pytest.raises(TypeError, match="x: expected dtype"):
        ember.ops.snake(torch.ones(2, 4, 8, dtype=torch.int32), a)
    with pytest.raises(TypeError, match="x: expected dtype"):
        ember.ops.snake(x.double(), a)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        ember.ops.snake([1.0], a)
    with pytest.raises(ValueError, match=r"alpha: expected shape \(4,\) or \(1, 4, 1\)"):
        ember.ops.snake(x, torch.ones(5))
    with pytest.raises(ValueError, match="alpha: expected shape"):
        ember.ops.snake(x, torch.ones(4, 1))
    with pytest.raises(ValueError, match="beta: expected shape"):
        ember.ops.snake(x, a, beta=torch.ones(1, 3, 1))
    with pytest.raises(TypeError, match="alpha: expected dtype"):
        ember.ops.snake(x, torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="beta: expected a torch.Tensor"):
        ember.ops.snake(x, a, beta=1.0)
    with pytest.raises(ValueError, match="alpha: expected device"):
        ember.ops.snake(x, torch.ones(4, device="meta"))
    with pytest.raises(TypeError, match="logscale: expected a bool"):
        ember.ops.snake(x, a, logscale=1)
    with pytest.raises(TypeError, match="out: expected dtype"):
        ember.ops.snake(x, a, out=torch.empty(2, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out: expected shape"):
        ember.ops.snake(x, a, out=torch.empty(2, 4, 9))
    with pytest.raises(ValueError, match="out: expected x itself"):
        buf = torch.randn(2, 4, 9)
        ember.ops.snake(buf[:, :, :8], a, out=buf[:, :, 1:])
    with pytest.raises(ValueError, match="out: expected out=None when gradients are needed"):
        ember.ops.snake(x.requires_grad_(), a, out=torch.empty(2, 4, 8))


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,C,T,kind", [(1, 1536, 32768, "contiguous"), (4, 64, 100003, "contiguous"),
                                        (2, 768, 4097, "channels_last"), (3, 96, 999, "strided")])
@pytest.mark.parametrize("beta,logscale", [(False, False), (True, True), (True, False)])
def test_gpu_kernel_matches_reference(cuda, dtype, B, C, T, kind, beta, logscale):
    a, b = params(C, True, logscale, beta)
    a, b = a.to(cuda), (b.to(cuda) if b is not None else None)
    x = layout((torch.randn(B, C, T, device=cuda) * 3).to(dtype), kind)
    out = poisoned(x.shape, dtype, cuda)
    ember.ops.snake(x, a, beta=b, logscale=logscale, out=out)
    exp = snake_reference(x, a, b, logscale=logscale)
    if dtype == torch.float32:  # libdevice sinf / expf vs torch's CUDA kernels, fma contraction
        torch.testing.assert_close(out, exp, atol=2e-6, rtol=2e-6)
    else:
        assert_close(out, exp, dtype)
    assert_close(out, float64_snake(x, a, b, logscale), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_large_arguments(cuda, dtype):
    """Tiles whose alpha * x passes 16384 take libdevice's sinf instead of the reduced approximate one;
    tiles below it, the approximation: both as close to float64 as one rounding allows."""
    C, T = 8, 4096
    a = torch.linspace(0.5, 2.0, C, device=cuda)
    x = torch.randn(1, C, T, device=cuda) * 3
    x[..., :2048] *= 3000  # the first tiles hold arguments up to ~5e4 (fp16: inf-free, below 65504)
    x = x.to(dtype)
    out = ember.ops.snake(x, a)
    assert_close(out, float64_snake(x, a), dtype)


@pytest.mark.gpu
def test_gpu_compile_and_cuda_graph(cuda):
    a, b = torch.rand(1, 256, 1, device=cuda) - 0.5, torch.rand(1, 256, 1, device=cuda) - 0.5
    x = torch.randn(2, 256, 3000, device=cuda, dtype=torch.bfloat16)
    check_compile_and_graph(lambda x: ember.ops.snake(x, a, beta=b, logscale=True), x)


@pytest.mark.gpu
def test_gpu_64bit_offsets(cuda):
    x = torch.randn(1, 2, 2**30 + 7, device=cuda, dtype=torch.bfloat16)  # 2^31 + 14 elements
    a = torch.tensor([0.7, 1.3], device=cuda)
    y = ember.ops.snake(x, a)
    for sl in (slice(0, 4096), slice(-4096, None)):
        assert_close(y[:, :, sl], snake_reference(x[:, :, sl], a), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_backward_matches_float64(cuda):
    a, b = params(64, True, True, True)
    x = torch.randn(2, 64, 5000, device=cuda) * 3
    leaves = [t.to(cuda).requires_grad_() for t in (x, a, b)]
    g = torch.randn_like(x)
    ember.ops.snake(leaves[0], leaves[1], beta=leaves[2], logscale=True).backward(g)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    float64_snake(exact[0], exact[1], exact[2], True).backward(g.double())
    for got, ref in zip(leaves, exact):
        torch.testing.assert_close(got.grad, ref.grad.float(), atol=1e-4, rtol=1e-4)  # sums of 10^4 terms
