"""Model oracle for dense Qwen3 (tiny random transformers model, fp32) and the checks every model
family's build shares: RoPE variants other than "default" refused by name (``rope_parameters`` and
the legacy ``rope_scaling``, keyed ``rope_type`` or ``type``), missing config keys and tensors named."""
import pytest
import torch

from ember.models import lfm2_moe, qwen3, qwen3_5_moe
from tests.models import test_lfm2_moe as lfm2_tests
from tests.models import test_qwen3_5_moe as qwen35_tests
from tests.models.test_lfm2_moe import assert_forward_matches_hf, assert_greedy_matches_hf, build_net
from tests.models.tiny import build, dense_config, moe_config

VOCAB = 128


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf = build(dense_config())
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    build(moe_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """Saved tiny LFM2-MoE and Qwen3.5-MoE text checkpoints, with their model modules."""
    out = {}
    path = tmp_path_factory.mktemp("lfm2")
    lfm2_tests.build_hf(lfm2_tests.lfm2_config()).save_pretrained(path)
    out["lfm2_moe"] = (lfm2_moe, path)
    path = tmp_path_factory.mktemp("qwen35")
    qwen35_tests.build_hf("text", num_hidden_layers=2, num_experts=2, num_experts_per_tok=1).save_pretrained(path)
    out["qwen3_5_moe"] = (qwen3_5_moe, path)
    return out


def test_forward_and_greedy_match_transformers(dense):
    hf, path = dense
    net = build_net(path, qwen3)
    assert_forward_matches_hf(hf, net, VOCAB)
    assert_greedy_matches_hf(hf, net, VOCAB, new=8)


# ----------------------------------------------------------------------------- RoPE variants
YARN = {"factor": 4.0, "original_max_position_embeddings": 64}


def _set_rope(cfg, key, value):
    cfg.pop("rope_parameters", None)
    cfg.pop("rope_scaling", None)
    cfg[key] = value


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("name", ["type", "rope_type"])
def test_yarn_refused_by_name(dense, hybrids, key, name):
    """A YaRN config, in the current or the legacy spelling, is refused naming it, in every family
    (before the legacy ``rope_scaling: {"type": "yarn"}`` was silently run as plain RoPE)."""
    rope = {name: "yarn", "rope_theta": 10000.0, **YARN}
    cases = [(qwen3, dense[1], lambda c: _set_rope(c, key, rope))]
    cases.append((lfm2_moe, hybrids["lfm2_moe"][1], lambda c: _set_rope(c, key, rope)))
    cases.append((qwen3_5_moe, hybrids["qwen3_5_moe"][1], lambda c: _set_rope(c, key, {**rope,
                                                                                      "partial_rotary_factor": 0.25})))
    for module, path, edit in cases:
        with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
            build_net(path, module, cfg_edit=edit)


def test_default_rope_in_either_spelling_loads(dense):
    """``rope_scaling`` naming the default variant (either key) builds the same model as none at all."""
    hf, path = dense
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        want = build_net(path, qwen3).prefill(ids)
        for rope in ({"type": "default"}, {"rope_type": "default"}):
            net = build_net(path, qwen3, cfg_edit=lambda c: c.update(rope_scaling=rope))
            assert torch.equal(net.prefill(ids), want)


def test_rope_scaling_must_be_an_object(dense):
    with pytest.raises(ValueError, match="rope_scaling to be an object"):
        build_net(dense[1], qwen3, cfg_edit=lambda c: c.update(rope_scaling="yarn"))


# ----------------------------------------------------------------------------- named errors
@pytest.mark.parametrize("family", ["qwen3", "lfm2_moe", "qwen3_5_moe"])
def test_missing_config_key_named(dense, hybrids, family):
    module, path = (qwen3, dense[1]) if family == "qwen3" else hybrids[family]
    key = "num_hidden_layers"

    def drop(c):
        (c.get("text_config") or c).pop(key)
    with pytest.raises(ValueError, match=key):
        build_net(path, module, cfg_edit=drop)


@pytest.mark.parametrize("family", ["qwen3", "lfm2_moe", "qwen3_5_moe"])
def test_missing_tensor_named(dense, hybrids, family):
    module, path = (qwen3, dense[1]) if family == "qwen3" else hybrids[family]
    name = "layers.1.post_attention_layernorm.weight" if family != "lfm2_moe" else "layers.1.ffn_norm.weight"
    with pytest.raises(ValueError, match=rf"missing tensor\(s\).*{name}"):
        build_net(path, module, tensors_edit=lambda t: [t.pop(n) for n in list(t) if n.endswith(name)])


def _experts_as(key):
    """A config edit: the expert count under ``key`` only (None: under neither spelling)."""
    def edit(c):
        n = c.pop("num_experts", None) or c.pop("num_local_experts", None)
        c.pop("num_local_experts", None)
        if key is not None:
            c[key] = n
    return edit


def test_qwen3_model_type_on_a_moe_checkpoint(moe_path):
    """The dense family given a Qwen3-MoE checkpoint: its config's expert count (either spelling) is
    named; without one, the first dense tensor the checkpoint lacks is."""
    for key in ("num_experts", "num_local_experts"):
        with pytest.raises(ValueError, match=rf"model_type 'qwen3' is the dense model, but the config has {key}=8"):
            build_net(moe_path, qwen3, cfg_edit=_experts_as(key))
    with pytest.raises(ValueError, match=r"missing tensor\(s\).*model\.layers\.0\.mlp\.gate_proj\.weight"):
        build_net(moe_path, qwen3, cfg_edit=_experts_as(None))
