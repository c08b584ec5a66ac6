import pytest
import torch
from torch import nn

import ember
from ember.nn import Fp8Linear
from ember.quantize import register_handler


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(64, 64)
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(64, 8)  # MoE router: kept by default
        self.mlp.up = nn.Linear(64, 128)


class Tiny(nn.Module):
    def __init__(self, tie=False):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.layers = nn.ModuleList([Block(), Block()])
        self.lm_head = nn.Linear(64, 100, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.layers:
            h = h + b.q_proj(h) + b.mlp.up(h)[..., :64]
        return self.lm_head(h)


def test_default_filter_keeps_head_router_embedding():
    m = Tiny()
    ember.quantize_(m, ember.Fp8Config())
    assert isinstance(m.layers[0].q_proj, Fp8Linear) and isinstance(m.layers[1].mlp.up, Fp8Linear)
    assert type(m.layers[0].mlp.gate) is nn.Linear
    assert type(m.lm_head) is nn.Linear and type(m.embed) is nn.Embedding


def test_tied_head_kept_even_when_renamed():
    m = Tiny(tie=True)
    m.out = m.lm_head
    del m.lm_head
    ember.quantize_(m, ember.Fp8Config())
    assert type(m.out) is nn.Linear


def test_filter_fn_sees_module_and_fqn():
    m = Tiny()
    seen = []

    def only_lm_head(module, fqn):
        seen.append(fqn)
        return fqn == "lm_head"

    ember.quantize_(m, ember.Fp8Config(granularity="block", filter_fn=only_lm_head))
    assert isinstance(m.lm_head, Fp8Linear) and m.lm_head.granularity == "block"
    assert type(m.layers[0].q_proj) is nn.Linear
    assert "layers.0.mlp.gate" in seen and "lm_head" in seen


def test_quantized_model_output_and_bytes():
    m = Tiny()
    ids = torch.randint(0, 100, (2, 5))
    ref = m(ids).detach().double()
    before = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    ember.quantize_(m, ember.Fp8Config(activations="dynamic"))
    after = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    got = m(ids).double()
    assert ((got - ref).norm() / ref.norm()).item() < 0.1
    assert after < before  # fp32 layers shrink 4x; the head and embedding stay


def test_training_flag_and_device_kept():
    m = Tiny().eval()
    ember.quantize_(m, ember.Fp8Config())
    assert not m.layers[0].q_proj.training
    assert m.layers[0].q_proj.weight.device.type == "cpu"


def test_meta_model_quantizes_without_data():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(4096, 4096, dtype=torch.bfloat16))
    ember.quantize_(m, ember.Fp8Config(granularity="block"))
    assert m[0].weight.is_meta and m[0].weight.dtype == torch.float8_e4m3fn
    assert m[0].weight_scale.shape == (32, 32)


def test_register_handler_extends_quantize():
    class Custom(nn.Module):
        pass

    class Replaced(nn.Module):
        pass

    @register_handler(ember.Fp8Config, Custom)
    def _(module, config, fqn):
        return Replaced()

    m = nn.Sequential(Custom(), nn.Linear(8, 8))
    ember.quantize_(m, ember.Fp8Config(filter_fn=lambda mod, fqn: True))
    assert isinstance(m[0], Replaced) and isinstance(m[1], Fp8Linear)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: ember.Fp8Config(granularity="channel"), ValueError, "granularity"),
    (lambda: ember.Fp8Config(activations="static"), ValueError, "activations"),
    (lambda: ember.Fp8Config(filter_fn=3), TypeError, "filter_fn"),
    (lambda: ember.quantize_("model", ember.Fp8Config()), TypeError, "model"),
    (lambda: ember.quantize_(nn.Linear(4, 4), object()), TypeError, "config"),
])
def test_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


def test_a_bare_linear_is_converted_and_returned_with_a_warning():
    layer = nn.Linear(7, 13)
    x = torch.randn(3, 7)
    with pytest.warns(UserWarning, match=r"the model is itself a Linear, which cannot be replaced in place; use the "
                                         r"returned Fp8Linear"):
        new = ember.quantize_(layer, ember.Fp8Config())
    assert isinstance(new, Fp8Linear) and type(layer) is nn.Linear
    ref = x @ new.dequantized_weight(torch.float32).t() + layer.bias
    torch.testing.assert_close(new(x), ref, atol=1e-5, rtol=1e-5)


def test_nothing_converted_names_each_module_and_why():
    m = Tiny()
    with pytest.warns(UserWarning, match=r"converted nothing; skipped layers\.0\.q_proj \(Linear\): filter_fn returned "
                                         r"False; .*and \d+ more"):
        ember.quantize_(m, ember.Fp8Config(filter_fn=lambda mod, fqn: False))
    head_only = nn.Module()
    head_only.lm_head = nn.Linear(16, 32)
    with pytest.warns(UserWarning, match=r"skipped lm_head \(Linear\): the default filter keeps 'lm_head' layers"):
        ember.quantize_(head_only, ember.Fp8Config())
    with pytest.warns(UserWarning, match=r"Sequential has no module of a type Fp8Config converts \(.*Linear"):
        ember.quantize_(nn.Sequential(nn.Embedding(4, 4)), ember.Fp8Config())


def test_plan_lists_every_decision_and_changes_nothing():
    from ember.quantize import plan
    m = Tiny(tie=True)
    decisions = {d.fqn: d for d in plan(m, ember.Fp8Config())}
    assert type(m.layers[0].q_proj) is nn.Linear  # nothing converted
    assert decisions["layers.0.q_proj"].converts and decisions["layers.1.mlp.up"].converts
    assert not decisions["layers.0.mlp.gate"].converts and "'gate'" in decisions["layers.0.mlp.gate"].reason
    assert not decisions["lm_head"].converts
    m.out = m.lm_head
    del m.lm_head
    assert plan(m, ember.Fp8Config())[-1].reason == "its weight is tied to an embedding"
