"""`ember quantize` on the hybrid families: every projection and expert is written in FP8 (experts
per expert, in the family's own names), and ember.load of the result computes exactly what
transformers computes with the same dequantised weights."""
import copy

import pytest
import torch
from safetensors import safe_open

import ember
from ember.cli import main
from ember.ops import fp8 as fp8_ops
from ember.quantize_cli import EXPERT_NAMES, quantizable
from tests.models import test_qwen3_5_moe as q35
from tests.models.test_lfm2_moe import build_hf, close, lfm2_config

# sizes that are multiples of 128 (and equal q/k/v widths) so block scales concatenate as stored
LFM2 = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=4)


def _dequantised_copy(hf):
    """transformers model whose converted weights are replaced by dequant(quant_block(w))."""
    ref = copy.deepcopy(hf)
    block = lambda w: fp8_ops.dequantize_fp8(*fp8_ops.quantize_fp8(w, "block"), torch.float32)  # noqa: E731
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if any(name.endswith(f"{parent}.{k}") for parent in EXPERT_NAMES for k in ("gate_up_proj", "down_proj")):
                for e in range(p.shape[0]):
                    parts = p[e].chunk(2) if name.endswith("gate_up_proj") else (p[e],)  # gate, up apart
                    p[e].copy_(torch.cat([block(w) for w in parts]))
            elif quantizable(name, p):
                p.copy_(block(p))
    return ref


@pytest.mark.parametrize("family", ["lfm2_moe", "qwen3_5_moe"])
def test_quantize_cli_round_trip(family, tmp_path):
    if family == "lfm2_moe":
        hf = build_hf(lfm2_config(**LFM2))
        expect_fp8 = ["model.layers.0.conv.in_proj.weight", "model.layers.1.self_attn.q_proj.weight",
                      "model.layers.0.feed_forward.w1.weight", "model.layers.2.feed_forward.experts.5.w3.weight"]
        expect_kept = ["model.layers.2.feed_forward.gate.weight", "model.layers.0.conv.conv.weight"]
    else:
        # DeltaNet widths multiples of 128 too: 2 * 2 * 32 (q, k) + 4 * 32 (v) = 256, z = 128
        hf = q35.build_hf("text", hidden_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                          linear_key_head_dim=32, linear_value_head_dim=32)
        expect_fp8 = ["model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_b.weight",
                      "model.layers.3.self_attn.q_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight",
                      "model.layers.1.mlp.shared_expert.down_proj.weight"]
        expect_kept = ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"]
    hf.save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "fp8"), "--fp8"]) == 0
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        for n in expect_fp8:
            assert f.get_tensor(n).dtype == torch.float8_e4m3fn, n
            assert f.get_tensor(n[: -len("weight")] + "weight_scale_inv").dtype == torch.float32
        for n in expect_kept:
            assert f.get_tensor(n).dtype == torch.float32, n
    model = ember.load(tmp_path / "fp8", dtype=torch.float32, max_seq_len=64)
    ids = torch.randint(1, 96, (1, 12))
    logits = model(ids)
    assert model.fp8
    with torch.no_grad():
        want = _dequantised_copy(hf)(input_ids=ids).logits
    assert close(logits, want)
