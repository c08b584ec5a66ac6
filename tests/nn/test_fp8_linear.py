import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import ember
from ember.nn import Fp8Linear
from tests.ops.test_fp8 import rel_frobenius, snr_db

E4M3 = torch.float8_e4m3fn


def float64_linear(x, weight_fp8, scale_full, bias):
    w = weight_fp8.double() * scale_full.double()
    out = x.double() @ w.t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("activations", [None, "dynamic"])
def test_from_linear_matches_float64_of_dequantised_weight(granularity, activations):
    lin = nn.Linear(300, 200, dtype=torch.float32)
    f = Fp8Linear.from_linear(lin, granularity=granularity, activations=activations)
    assert f.weight.dtype == E4M3 and f.weight_scale.dtype == torch.float32
    x = torch.randn(2, 5, 300)
    got = f(x)
    assert got.shape == (2, 5, 200) and got.dtype == torch.float32
    w_deq = f.dequantized_weight(torch.float32)
    exp = x.double() @ w_deq.double().t() + lin.bias.double()
    if activations is None:
        assert rel_frobenius(got, exp) <= 1e-5  # only fp32 rounding on exact fp8 weights
    else:
        assert snr_db(got, exp) >= 25  # activations are quantised too: ~3 mantissa bits
    assert rel_frobenius(w_deq, lin.weight.detach()) < 0.04


def test_bf16_io_and_no_bias():
    lin = nn.Linear(256, 64, bias=False, dtype=torch.bfloat16)
    f = Fp8Linear.from_linear(lin)
    assert f.bias is None and f.dtype == torch.bfloat16
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    y = f(x)
    assert y.dtype == torch.bfloat16
    exp = x.double() @ f.dequantized_weight(torch.float32).double().t()
    assert snr_db(y, exp) >= 40


def test_from_fp8_hf_block_weight_no_copy():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(300, 200, generator=gen) * 100).clamp(-448, 448).to(E4M3)
    scale_inv = torch.rand(3, 2, generator=gen) * 0.01 + 1e-3
    f = Fp8Linear.from_fp8(w, scale_inv)
    assert f.granularity == "block" and f.weight.data_ptr() == w.data_ptr()
    x = torch.randn(4, 200)
    full = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert rel_frobenius(f(x), float64_linear(x, w, full, None)) <= 1e-5


def test_from_fp8_row_and_bf16_scales():
    w = torch.randn(64, 96).to(E4M3)
    f = Fp8Linear.from_fp8(w, torch.full((64, 1), 0.5, dtype=torch.bfloat16), bias=torch.ones(64))
    assert f.granularity == "row" and f.weight_scale.dtype == torch.float32
    x = torch.randn(2, 96)
    torch.testing.assert_close(f(x), x @ (w.float() * 0.5).t() + 1, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: Fp8Linear.from_fp8(torch.randn(4, 4), torch.ones(1, 1)), TypeError, "weight"),
    (lambda: Fp8Linear.from_fp8(torch.randn(300, 200).to(E4M3), torch.ones(2, 2)), ValueError, r"weight_scale_inv: expected shape \[3, 2\]"),
    (lambda: Fp8Linear.from_fp8(torch.randn(4, 4).to(E4M3), torch.zeros(1, 1)), ValueError, "finite scales > 0"),
    (lambda: Fp8Linear.from_fp8(torch.randn(4, 4).to(E4M3), torch.ones(1, 1, dtype=torch.int32)), TypeError, "weight_scale_inv"),
    (lambda: Fp8Linear.from_linear(nn.Conv1d(2, 2, 1)), TypeError, "linear"),
    (lambda: Fp8Linear(4, 4, activations="static"), ValueError, "activations"),
    (lambda: Fp8Linear(4, 4, granularity="col"), ValueError, "granularity"),
    (lambda: Fp8Linear.from_linear(nn.Linear(8, 8))(torch.randn(2, 7)), ValueError, "x: expected last dimension 8"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
def test_state_dict_round_trips_through_safetensors(tmp_path, granularity):
    f = Fp8Linear.from_linear(nn.Linear(300, 130, dtype=torch.bfloat16), granularity=granularity)
    path = tmp_path / "layer.safetensors"
    save_file(f.state_dict(), str(path))
    loaded = load_file(str(path))
    assert loaded["weight"].dtype == E4M3
    g = Fp8Linear(300, 130, granularity=granularity, dtype=torch.bfloat16)
    g.load_state_dict(loaded)
    for k, v in f.state_dict().items():
        assert torch.equal(g.state_dict()[k].view(torch.uint8) if v.dtype == E4M3 else g.state_dict()[k],
                           v.view(torch.uint8) if v.dtype == E4M3 else v), k
    x = torch.randn(3, 300, dtype=torch.bfloat16)
    assert torch.equal(f(x), g(x))


def test_load_hf_names_on_meta_module():
    """HF fine-grained checkpoints name the decode scale weight_scale_inv; assign=True keeps fp8 storage."""
    w = torch.randn(256, 384).to(E4M3)
    sd = {"proj.weight": w, "proj.weight_scale_inv": torch.rand(2, 3) + 0.1}
    with torch.device("meta"):
        model = nn.Module()
        model.proj = Fp8Linear(384, 256, bias=False, granularity="block")
    model.load_state_dict(sd, assign=True)
    assert model.proj.weight.data_ptr() == w.data_ptr()
    assert torch.equal(model.proj.weight_scale, sd["proj.weight_scale_inv"])


def test_quantize_filter_and_model_output():
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(4, 64)
    ref = model(x).detach()
    ember.quantize_(model, ember.Fp8Config(granularity="row"))
    assert all(isinstance(model[i], Fp8Linear) for i in (0, 2))
    assert rel_frobenius(model(x), ref) < 0.05
