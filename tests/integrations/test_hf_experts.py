import pytest
import torch

from ember.integrations import hf_experts
from tests.models.test_lfm2_moe import build_hf, lfm2_config
from tests.models import tiny


def _families():
    return {"qwen3_moe": lambda: tiny.build(tiny.moe_config()), "lfm2_moe": lambda: build_hf(lfm2_config())}


@pytest.mark.parametrize("family", sorted(_families()))
def test_ember_backend_matches_eager(family):
    model = _families()[family]()
    ids = torch.randint(1, 90, (2, 11))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        want = model(input_ids=ids).logits
    hf_experts.enable(model)
    assert model.config._experts_implementation == "ember"
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fp32 both: summation order only


def test_unsupported_layout_is_named():
    model = tiny.build(tiny.moe_config())
    hf_experts.enable(model)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    experts.has_bias = True
    with pytest.raises(ValueError, match="has biases"):
        model(input_ids=torch.randint(1, 90, (1, 4)))
