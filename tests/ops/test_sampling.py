import math

import pytest
import torch

import ember
from ember import _dispatch
from ember.ops import sampling as S
from tests.helpers import poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# chi-square p-value below which a draw fails: a correct sampler fails < once in 10^6 runs
P_FAIL = 1e-6
# softmax in fp32: z = x / T rounds to fp32, so exp(z) carries |z| * 2^-24 relative error (|z| ~ 25
# here: 1.5e-6), plus the row sum's rounding; log-softmax carries |z| * 2^-24 absolute.
SOFTMAX_TOL = dict(atol=1e-7, rtol=1e-5)
LOG_SOFTMAX_TOL = dict(atol=5e-6, rtol=1e-5)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer ``counts`` to ``probs`` over the support (float64, no scipy)."""
    n = counts.sum().double()
    support = probs > 0
    exp = probs[support].double() * n
    stat = ((counts[support].double() - exp) ** 2 / exp).sum()
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def float64_filtered_probs(logits, T, k, p, mp):
    """An independent per-row float64 statement of the semantics (python loops over the sort)."""
    x = logits.double()
    if T == 0:
        out = torch.zeros_like(x)
        out[int(torch.argmax(x))] = 1
        return out
    z = x / T
    V = z.numel()
    keep = torch.ones(V, dtype=torch.bool)
    if 0 < k < V:
        kth = torch.sort(z, descending=True).values[k - 1]
        keep &= z >= kth
    pr = torch.softmax(torch.where(keep, z, -math.inf), 0)
    if p < 1:
        for i in range(V):
            if keep[i] and pr[z > z[i]].sum() >= p:
                keep[i] = False
    keep &= pr >= mp * pr.max()
    return torch.softmax(torch.where(keep, z, -math.inf), 0)


PARAM_MIXES = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.6, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=0.8, top_k=4, top_p=0.8, min_p=0.05),
]


# ------------------------------------------------------------------ softmax / log_softmax / argmax
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 111), (1, 32000)])
def test_reference_softmax_matches_float64(dtype, shape):
    x = (torch.randn(shape) * 4).to(dtype)
    for T in (None, 0.7):
        xd = x.double() / (T or 1.0)
        y, ly = ember.ops.softmax(x, temperature=T), ember.ops.log_softmax(x, temperature=T)
        assert y.dtype == torch.float32 and y.shape == x.shape
        torch.testing.assert_close(y.double(), torch.softmax(xd, -1), **SOFTMAX_TOL)
        torch.testing.assert_close(ly.double(), torch.log_softmax(xd, -1), **LOG_SOFTMAX_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 111), (2, 1000), (2, 20000)])
def test_kernel_softmax_matches_float64_interpreter(interpreter, dtype, shape):
    x = (torch.randn(shape) * 4).to(dtype)
    _dispatch.prepare_triton()
    from ember.kernels import sampling as k
    V = shape[-1]
    for log in (False, True):
        out = poisoned(shape, torch.float32, "cpu")
        k.softmax(x.view(-1, V), out.view(-1, V), 0.7, log)
        exp = (torch.log_softmax if log else torch.softmax)(x.double() / 0.7, -1)
        torch.testing.assert_close(out.double(), exp, **(LOG_SOFTMAX_TOL if log else SOFTMAX_TOL))
    am = poisoned(shape[:-1], torch.int64, "cpu")
    k.argmax(x.view(-1, V), am.view(-1))
    assert torch.equal(am, torch.argmax(x, -1))


def test_softmax_other_dim_and_non_contiguous_interpreter(interpreter):
    x = torch.randn(6, 50, 4)
    y = ember.ops.softmax(x, dim=1)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), 1), **SOFTMAX_TOL)
    xs = torch.randn(5, 300)[:, ::3]   # strided rows
    torch.testing.assert_close(ember.ops.log_softmax(xs).double(), torch.log_softmax(xs.double(), -1),
                               **LOG_SOFTMAX_TOL)
    assert torch.equal(ember.ops.argmax(x, dim=1), torch.argmax(x, 1))


def test_argmax_first_index_on_ties_interpreter(interpreter):
    x = torch.zeros(3, 20000)
    x[0, [5, 7000, 19999]] = 2.0
    x[1, [15000, 16000]] = 1.0
    x[2] = -math.inf
    x[2, 12345] = -1.0
    assert ember.ops.argmax(x).tolist() == [5, 15000, 12345]
    assert ember.ops.argmax(x[:, :100]).tolist() == [5, 0, 0]


# ------------------------------------------------------------------ the float64 reference is the spec
@pytest.mark.parametrize("mix", PARAM_MIXES + [dict(temperature=0.0, top_k=2, top_p=0.5, min_p=0.1)])
@pytest.mark.parametrize("V", [1, 7, 111])
def test_reference_probs_match_independent_statement(mix, V):
    x = torch.randn(3, V) * 2
    x[1] = torch.round(x[1])  # ties
    got = S.sampling_probs_reference(x, **mix)
    for r in range(3):
        torch.testing.assert_close(got[r], float64_filtered_probs(x[r], mix["temperature"], mix["top_k"],
                                                                  mix["top_p"], mix["min_p"]), atol=1e-12, rtol=0)


def test_reference_edge_semantics():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, -1.0]])
    one = S.sampling_probs_reference(x, top_k=1)
    assert one[0].tolist() == [1.0, 0, 0, 0, 0]
    assert torch.allclose(S.sampling_probs_reference(x, top_k=99), torch.softmax(x.double(), -1))
    assert torch.allclose(S.sampling_probs_reference(x, top_p=1.0), torch.softmax(x.double(), -1))
    assert S.sampling_probs_reference(x, top_p=1e-6)[0].tolist() == [1.0, 0, 0, 0, 0]
    ties = S.sampling_probs_reference(x, top_k=2)[0]          # the tie at the 2nd value keeps both
    assert (ties > 0).tolist() == [True, False, True, True, False]
    only = torch.full((1, 6), -math.inf)
    only[0, 4] = 0.5
    assert S.sampling_probs_reference(only, top_p=0.3, top_k=3)[0].tolist() == [0, 0, 0, 0, 1.0, 0]


def test_reference_sampler_chi_square_100k_draws():
    torch.manual_seed(1)
    for V, mix in [(7, PARAM_MIXES[1]), (11, PARAM_MIXES[2]), (5, PARAM_MIXES[4])]:
        x = torch.randn(1, V) * 2
        probs = S.sampling_probs_reference(x, **mix)[0]
        gen = torch.Generator().manual_seed(V)
        draws = S.sample_reference(x.expand(100_000, V), **mix, generator=gen)
        assert bool((probs[draws] > 0).all())
        assert chi2_pvalue(torch.bincount(draws, minlength=V), probs) > P_FAIL


# ------------------------------------------------------------------ kernel sampler (interpreter)
@pytest.mark.parametrize("mix", PARAM_MIXES)
@pytest.mark.parametrize("V", [7, 111])
def test_kernel_samples_in_support_interpreter(interpreter, mix, V):
    x = torch.randn(6, V) * 3
    x[2, 1:] = -math.inf  # one finite entry
    x[3] = 0.0            # flat row: all ties
    tok = ember.ops.sample(x, **mix, seed=7)
    probs = S.sampling_probs_reference(x, **mix)
    assert tok.dtype == torch.int64 and tok.shape == (6,)
    assert bool((probs[torch.arange(6), tok] > 0).all()), (tok, probs)
    assert tok[2] == 0


def test_kernel_small_draw_distribution_interpreter(interpreter):
    """A fixed-seed, modest-size fit on CPU (the 10^5-draw fits run on the GPU)."""
    V, mix = 4, dict(temperature=0.9, top_k=3, top_p=0.95, min_p=0.0)
    x = torch.tensor([[1.0, 0.2, -0.5, 0.6]])
    probs = S.sampling_probs_reference(x, **mix)[0]
    tok = ember.ops.sample(x.expand(40, V).contiguous(), **mix, seed=11)
    assert bool((probs[tok] > 0).all())
    assert chi2_pvalue(torch.bincount(tok, minlength=V), probs) > P_FAIL


def test_kernel_per_row_parameters_and_greedy_interpreter(interpreter):
    x = torch.randn(4, 50) * 2
    T = torch.tensor([0.0, 0.5, 1.0, 2.0])
    k = torch.tensor([0, 1, 5, 0])
    p = torch.tensor([1.0, 1.0, 0.5, 1e-6])
    mp = torch.tensor([0.5, 0.0, 0.0, 0.0])
    tok = ember.ops.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=torch.tensor([3, 4, 5, 6]))
    am = torch.argmax(x, -1)
    assert tok[0] == am[0] and tok[1] == am[1] and tok[3] == am[3]   # greedy, top-1, tiny top-p
    assert S.sampling_probs_reference(x, T, k, p, mp)[2, tok[2]] > 0


def test_kernel_fallback_path_interpreter(interpreter):
    """top_k above the number of chunk programs and a flat top-p row take the bisection fallback."""
    x = torch.randn(2, 1500)
    x[1] = torch.linspace(0, 0.01, 1500)   # flat: the nucleus reaches far below the candidates
    mix = dict(temperature=1.0, top_k=torch.tensor([5, 0]), top_p=torch.tensor([1.0, 0.5]), min_p=0.0)
    tok = ember.ops.sample(x, **mix, seed=9)
    probs = S.sampling_probs_reference(x, **mix)
    assert bool((probs[torch.arange(2), tok] > 0).all())


def test_kernel_fallback_draws_cover_the_support_interpreter(interpreter):
    """Thresholds decided by the fallback bisection: a 1600-wide row is 2 chunk programs, top-k 3 is
    above that, and for top-p alone the 576 values above the low chunk's max overflow the candidate
    list. 4 leading values hold 59% of the mass; over 30 draws every token of the 3-token support
    shows up (each has p > 0.29: missed with probability < 1e-4; seeds fixed) and nothing outside it."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1600, generator=g)
    x[0, :1024] -= 20.0
    x[0, [1100, 1300, 1500, 1580]] = torch.tensor([6.0, 5.9, 5.8, 5.7])
    for mix in (dict(top_k=3), dict(top_p=0.4)):
        probs = S.sampling_probs_reference(x, **mix)[0]
        support = set(probs.nonzero().flatten().tolist())
        assert len(support) == 3 and probs[probs > 0].min() > 0.29, (mix, probs[probs > 0])
        tok = ember.ops.sample(x.expand(30, 1600).contiguous(), **mix, seed=31)
        assert set(tok.tolist()) == support, mix


def test_seed_offset_reproducible_and_advancing_interpreter(interpreter):
    x = torch.randn(8, 30)
    off = torch.zeros(1, dtype=torch.int64)
    a = ember.ops.sample(x, seed=5, offset=torch.zeros(1, dtype=torch.int64))
    b = ember.ops.sample(x, seed=5, offset=off)
    assert torch.equal(a, b) and off.item() == 1
    c = ember.ops.sample(x, seed=5, offset=off)
    assert off.item() == 2 and not torch.equal(b, c)   # 8 rows of 30 tokens: equal by chance ~1e-9


def test_public_op_takes_kernel_under_force_triton(interpreter, monkeypatch):
    _dispatch.prepare_triton()
    from ember.kernels import sampling as kernels
    calls = []
    for name in ("sample", "softmax", "argmax"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    ember.ops.sample(torch.randn(2, 9), seed=1)
    ember.ops.softmax(torch.randn(2, 9))
    ember.ops.argmax(torch.randn(2, 9))
    assert calls == ["sample", "softmax", "argmax"]


# ------------------------------------------------------------------ compile, params
def test_torch_compile_fullgraph_cpu():
    def f(x):
        return ember.ops.softmax(x, temperature=0.5), ember.ops.argmax(x), ember.ops.sample(x, top_k=3, seed=1)

    x = torch.randn(3, 40)
    torch._dynamo.reset()
    sm, am, tok = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(sm, torch.softmax(x / 0.5, -1))
    assert torch.equal(am, torch.argmax(x, -1))
    assert bool((S.sampling_probs_reference(x, top_k=3)[torch.arange(3), tok] > 0).all())


def test_sampling_params():
    p = ember.SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3)
    assert p.as_kwargs() == dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.0, seed=3)
    assert ember.SamplingParams(temperature=0).greedy
    with pytest.raises(ValueError, match="top_p"):
        ember.SamplingParams(top_p=0.0)
    x = torch.randn(2, 10)
    assert torch.equal(ember.ops.sample(x, **ember.SamplingParams(temperature=0).as_kwargs()), torch.argmax(x, -1))


# ------------------------------------------------------------------ bad input
def _x():
    return torch.randn(2, 8)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: ember.ops.sample(torch.tensor([[0.0, float("nan")]])), ValueError, "NaN"),
    (lambda: ember.ops.sample(torch.tensor([[0.0, float("inf")]])), ValueError, r"\+inf"),
    (lambda: ember.ops.sample(torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]])), ValueError, "all -inf"),
    (lambda: ember.ops.sample(_x(), top_p=0.0), ValueError, "top_p"),
    (lambda: ember.ops.sample(_x(), top_p=1.5), ValueError, "top_p"),
    (lambda: ember.ops.sample(_x(), top_k=-1), ValueError, "top_k"),
    (lambda: ember.ops.sample(_x(), top_k=2.0), TypeError, "top_k"),
    (lambda: ember.ops.sample(_x(), min_p=1.0), ValueError, "min_p"),
    (lambda: ember.ops.sample(_x(), temperature=-0.1), ValueError, "temperature"),
    (lambda: ember.ops.sample(_x(), temperature=torch.tensor([1.0, -1.0])), ValueError, "temperature"),
    (lambda: ember.ops.sample(_x(), top_p=torch.tensor([0.5, 0.0])), ValueError, "top_p"),
    (lambda: ember.ops.sample(_x(), top_k=torch.tensor([1, 2, 3])), ValueError, r"shape \(2,\)"),
    (lambda: ember.ops.sample(_x(), top_k=torch.tensor([1.0, 2.0])), TypeError, "integer"),
    (lambda: ember.ops.sample(torch.randint(0, 3, (2, 8))), TypeError, "logits"),
    (lambda: ember.ops.sample(torch.randn(8)), ValueError, "logits"),
    (lambda: ember.ops.sample(_x(), seed=torch.tensor([1, 2, 3])), ValueError, "seed"),
    (lambda: ember.ops.sample(_x(), seed=1.5), TypeError, "seed"),
    (lambda: ember.ops.sample(_x(), offset=3), ValueError, "offset"),
    (lambda: ember.ops.softmax(_x(), temperature=0.0), ValueError, "temperature"),
    (lambda: ember.ops.softmax(_x(), dim=2), ValueError, "dim"),
    (lambda: ember.ops.argmax(torch.randint(0, 3, (2, 8))), TypeError, "x"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_device_mismatch_named():
    with pytest.raises(ValueError, match="top_k: expected device cpu"):
        ember.ops.sample(_x(), top_k=torch.tensor([1, 2], device="meta"))


def test_check_false_skips_value_checks():
    x = torch.tensor([[0.0, 1.0, 2.0]])
    assert ember.ops.sample(x, temperature=torch.tensor([1.0]), top_p=torch.tensor([0.5]), check=False).shape == (1,)


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128256), (4, 248320), (1, 1 << 20), (300, 32000), (7, 151936), (5, 7)])
def test_gpu_softmax_argmax(cuda, dtype, shape):
    x = (torch.randn(shape, device=cuda) * 4).to(dtype)
    for log in (False, True):
        got = (ember.ops.log_softmax if log else ember.ops.softmax)(x)
        exp = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
        torch.testing.assert_close(got.double(), exp, **(LOG_SOFTMAX_TOL if log else SOFTMAX_TOL))
    assert torch.equal(ember.ops.argmax(x), torch.argmax(x, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("V", [7, 111, 2000])
@pytest.mark.parametrize("mix", PARAM_MIXES)
def test_gpu_chi_square_200k_draws(cuda, V, mix):
    torch.manual_seed(V)
    x = torch.randn(1, V) * 2
    probs = S.sampling_probs_reference(x, **mix)[0]
    draws = 200_000
    tok = ember.ops.sample(x.to(cuda).expand(draws, V).contiguous(), **mix, seed=V + 17).cpu()
    assert bool((probs[tok] > 0).all())
    # pool tokens whose expected count is < 5 into one cell, so the chi-square approximation holds
    exp_counts = probs * draws
    small = (exp_counts < 5) & (probs > 0)
    counts = torch.bincount(tok, minlength=V).double()
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        probs = torch.cat([probs[~small], probs[small].sum().view(1)])
    assert chi2_pvalue(counts, probs) > P_FAIL


@pytest.mark.gpu
@pytest.mark.parametrize("V", [1, 7, 111, 32000, 128256, 151936, 248320])
def test_gpu_support_set(cuda, V):
    rows = 128
    x = torch.randn(rows, V, device=cuda) * 3
    T = torch.rand(rows, device=cuda) * 1.5
    T[::7] = 0.0
    k = torch.randint(0, 80, (rows,), device=cuda)
    p = torch.rand(rows, device=cuda) * 0.99 + 0.01
    p[::3] = 1.0
    mp = torch.rand(rows, device=cuda) * 0.3
    mp[::2] = 0.0
    x[1] = 0.0                    # flat
    x[2, 1:] = -math.inf          # one finite entry
    tok = ember.ops.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=torch.arange(rows, device=cuda))
    probs = S.sampling_probs_reference(x, T, k, p, mp)
    assert bool((tok >= 0).all()) and bool((tok < V).all())
    assert bool((probs[torch.arange(rows), tok.cpu()] > 0).all())


@pytest.mark.gpu
def test_gpu_fallback_flat_row_distribution(cuda):
    """A flat 128256 row with top-p 0.5 alone (nucleus of ~64k tokens) takes the bisection path."""
    V = 128256
    x = torch.linspace(0, 1, V, device=cuda).view(1, V)
    tok = ember.ops.sample(x.expand(2000, V).contiguous(), top_p=0.5, seed=1).cpu()
    probs = S.sampling_probs_reference(x[:1], top_p=0.5)[0]
    assert bool((probs[tok] > 0).all())
    lo = int((probs > 0).nonzero().min())
    assert abs(tok.double().mean().item() - (probs * torch.arange(V)).sum().item()) < 0.05 * (V - lo)


@pytest.mark.gpu
def test_gpu_cuda_graph_fresh_draws(cuda):
    x = torch.randn(16, 128256, device=cuda)
    seed = torch.tensor([42], device=cuda)
    off = torch.zeros(1, dtype=torch.int64, device=cuda)
    ember.ops.sample(x, temperature=0.7, top_k=50, top_p=0.9, seed=seed, offset=off)  # compile outside
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tok = ember.ops.sample(x, temperature=0.7, top_k=50, top_p=0.9, seed=seed, offset=off)
    seen = []
    for _ in range(4):
        g.replay()
        seen.append(tok.clone())
    assert off.item() == 5   # one eager call, then one advance per replay
    assert len({tuple(s.tolist()) for s in seen}) == 4
    probs = S.sampling_probs_reference(x, 0.7, 50, 0.9)
    for s in seen:
        assert bool((probs[torch.arange(16), s.cpu()] > 0).all())


@pytest.mark.gpu
def test_gpu_compile_fullgraph(cuda):
    x = torch.randn(4, 128256, device=cuda)
    seed = torch.tensor([1], device=cuda)
    f = torch.compile(lambda x: (ember.ops.softmax(x), ember.ops.sample(x, top_k=20, seed=seed)), fullgraph=True)
    sm, tok = f(x)
    torch.testing.assert_close(sm.double(), torch.softmax(x.double(), -1), **SOFTMAX_TOL)
    assert bool((S.sampling_probs_reference(x, top_k=20)[torch.arange(4), tok.cpu()] > 0).all())


def test_compile_inductor_sample_cpu():
    """Inductor (not just aot_eager) lowers the registered sample op, offset counter included."""
    x = torch.randn(3, 500)
    seed, off = torch.tensor([7]), torch.zeros(1, dtype=torch.int64)
    torch._dynamo.reset()
    f = torch.compile(lambda x: ember.ops.sample(x, top_k=5, seed=seed, offset=off), fullgraph=True)
    tok = f(x)
    assert off.item() == 1  # the counter advanced, so the next call draws fresh numbers
    allowed = S.sampling_probs_reference(x, top_k=5)[torch.arange(3), tok] > 0
    assert bool(allowed.all())


@pytest.mark.parametrize("mode", ["reference", "interpreter"])
def test_per_row_seed_draw_does_not_depend_on_the_row(mode, request):
    """A row keyed by its own seed draws the same token wherever it sits in the batch (what makes a
    seeded request independent of its engine slot); one batch-wide seed still draws rows apart."""
    if mode == "interpreter":
        request.getfixturevalue("interpreter")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 500, generator=g)
    others = torch.randn(3, 500, generator=g)
    mix = dict(temperature=1.0)   # the race over all 500 tokens (no bisection: the interpreter's time)
    alone = [int(ember.ops.sample(x, **mix, seed=torch.tensor([s]), offset=torch.full((1,), 4)))
             for s in range(3)]
    for pos in (0, 2, 3):
        batch = torch.cat([others[:pos], x, others[pos:]])
        for s in range(3):
            seeds = torch.tensor([100 + i for i in range(4)])
            seeds[pos] = s
            tok = ember.ops.sample(batch, **mix, seed=seeds, offset=torch.full((1,), 4))
            assert int(tok[pos]) == alone[s], (pos, s)
    # a batch-wide seed: rows are distinct streams (one shared stream gives 1 distinct token; 16
    # independent draws over these 500 tokens, none above p = 0.03, give <= 4 distinct with
    # probability < C(500, 4) * 0.12^16 < 1e-5)
    same = ember.ops.sample(x.expand(16, 500).contiguous(), **mix, seed=5)
    assert len(set(same.tolist())) > 4


# ------------------------------------------------------------------ every_row: the caller's promise
_T = torch.tensor


@pytest.mark.parametrize("kw, words", [
    (dict(every_row="top_p"), "every_row: expected None, 'temperature_only' or 'top_k', got 'top_p'"),
    (dict(every_row="top_k", top_k=0), r"every_row='top_k': expected top_k in \[1, vocab size\) in every row, got 0$"),
    (dict(every_row="top_k", top_k=8), r"top_k in \[1, vocab size\) in every row, got 8$"),  # 8 = the vocab: off
    (dict(every_row="top_k", temperature=0.0, top_k=3), "expected temperature > 0 in every row, got 0.0$"),
    (dict(every_row="temperature_only", top_p=0.9), r"expected top_p 1 \(off\) in every row, got 0.9$"),
    (dict(every_row="temperature_only", min_p=0.1), r"expected min_p 0 \(off\) in every row, got 0.1$"),
    (dict(every_row="temperature_only", top_k=_T([0, 4])), r"top_k 0 or >= the vocab size \(off\) in every row, "
                                                            r"got 4 \(row 1\)"),
    (dict(every_row="top_k", temperature=_T([0.5, 0.0]), top_k=2), r"temperature > 0 in every row, got 0.0 \(row 1\)"),
])
def test_every_row_promise_broken_is_named(kw, words):
    """A promise the parameters break is refused, naming the parameter, the value and the row."""
    with pytest.raises(ValueError, match=words):
        ember.ops.sample(_x(), **kw)


def test_every_row_tensor_promise_is_checked_only_with_check():
    """check=False trusts the promise for tensors (no device sync, as the engine calls it); scalars
    are always checked."""
    x = _x()
    assert ember.ops.sample(x, temperature=_T([0.0, 1.0]), top_k=_T([2, 2]), every_row="top_k",
                            check=False).shape == (2,)
    with pytest.raises(ValueError, match="top_k"):
        ember.ops.sample(x, temperature=1.0, top_k=0, every_row="top_k", check=False)


@pytest.mark.parametrize("every_row, mix", [
    ("top_k", dict(temperature=_T([0.7, 1.3, 0.9]), top_k=_T([5, 40, 1]), top_p=_T([0.9, 1.0, 0.5]))),
    ("temperature_only", dict(temperature=_T([0.7, 1.3, 2.0]), top_k=_T([0, 500, 0]))),
])
def test_every_row_promise_kept_draws_the_same_tokens(every_row, mix):
    """A kept promise is accepted by the checks and leaves the draws as they are: the same seeds and
    offset give the same tokens as the call without it. Only the GPU's one-launch paths read the
    promise (the interpreter would run the same kernel twice here);
    test_gpu_sample_every_row_promise_same_tokens covers the paths it selects."""
    g = torch.Generator().manual_seed(11)
    for i in range(4):
        x = torch.randn(3, 500, generator=g) * (1 + i)
        seeds = _T([3, 4, 5]) + i
        plain = ember.ops.sample(x, **mix, seed=seeds, offset=torch.full((1,), i))
        promised = ember.ops.sample(x, **mix, seed=seeds, offset=torch.full((1,), i), every_row=every_row)
        assert torch.equal(plain, promised), (i, plain, promised)
