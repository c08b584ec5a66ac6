"""ember.load: checkpoint formats (single file, sharded, stacked or per-expert experts, FP8 round trip
through `ember quantize`) and bad input with clear errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import ember
from tests.models import tiny


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    hf = tiny.build(tiny.moe_config())
    return hf, tiny.save(hf, tmp_path_factory.mktemp("moe"), tokenizer=True)


def _ids():
    return torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(1))


def _close(a, b):
    return (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def test_sharded_checkpoint(moe, tmp_path):
    hf, _ = moe
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        ref = hf(_ids()).logits
    assert _close(ember.load(tmp_path, max_seq_len=32)(_ids()), ref)


def test_stacked_experts_checkpoint(moe, tmp_path):
    hf, path = moe
    sd = hf.state_dict()  # transformers 5.17 in-memory layout: mlp.experts.gate_up_proj [E, 2I, H]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with torch.no_grad():
        ref = hf(_ids()).logits
    assert _close(ember.load(tmp_path, max_seq_len=32)(_ids()), ref)


@pytest.fixture(scope="module")
def moe_aligned(tmp_path_factory):
    """Projection sizes multiples of 128, so checkpoint block scales stack without requantising."""
    hf = tiny.build(tiny.moe_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                    moe_intermediate_size=128, num_experts=4))
    return hf, tiny.save(hf, tmp_path_factory.mktemp("moe128"), tokenizer=True)


def _with_weights(hf, quantize):
    """A copy of the transformers model whose projection / expert weights are replaced by
    ``quantize(w) -> (q, scale)`` dequantised: the exact weights an FP8 model computes with."""
    import copy
    from ember.ops import fp8 as fp8_ops
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                ws = p if p.dim() == 3 else p[None]
                for e in range(ws.shape[0]):
                    parts = ws[e].chunk(2) if name.endswith("gate_up_proj") else (ws[e],)  # gate, up quantised apart
                    ws[e].copy_(torch.cat([fp8_ops.dequantize_fp8(*quantize(w), torch.float32) for w in parts]))
    return ref


def test_fp8_round_trip_through_quantize_cli(moe_aligned, tmp_path):
    from ember.cli import main
    from ember.ops import fp8 as fp8_ops
    hf, path = moe_aligned
    out = tmp_path / "fp8"
    assert main(["quantize", str(path), str(out), "--fp8"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.float32  # router kept
    em = ember.load(out, max_seq_len=32)
    assert em.fp8 and em.tokenizer is not None
    ref = _with_weights(hf, lambda w: fp8_ops.quantize_fp8(w, "block"))
    with torch.no_grad():
        want = ref(_ids()).logits
    assert _close(em(_ids()), want)  # fp32 math on the same fp8 values: as tight as the bf16 oracle
    prompt = _ids()
    hf_tokens = ref.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[0, 10:].tolist()
    n = hf_tokens.index(1) if 1 in hf_tokens else 16  # ember stops at EOS (id 1); compare up to it
    assert em.generate(prompt[0].tolist(), max_new_tokens=16, stop=[])[0][:n] == hf_tokens[:n]


def test_fp8_on_load_uses_row_scales_exactly(moe_aligned):
    from ember.ops import fp8 as fp8_ops
    hf, path = moe_aligned
    em = ember.load(path, fp8=True, max_seq_len=32)
    ref = _with_weights(hf, lambda w: fp8_ops.quantize_fp8(w, "row"))
    with torch.no_grad():
        want = ref(_ids()).logits
    assert _close(em(_ids()), want)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ember.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        ember.load(tmp_path / "nope")


def test_unsupported_model_type_names_supported(moe, tmp_path):
    _, path = moe
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'llama' is not supported; ember supports .*qwen3, .*qwen3_moe"):
        ember.load(tmp_path)


def _copy_with(path, tmp_path, cfg_edit=None, tensors_edit=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file
    sd = load_file(str(path / "model.safetensors"))
    if tensors_edit:
        tensors_edit(sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_shape_mismatch_names_tensor_and_shapes(moe, tmp_path):
    _, path = moe
    p = _copy_with(path, tmp_path, cfg_edit=lambda c: c.update(moe_intermediate_size=16))
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight: expected shape \(16, 64\) .* got \(32, 64\)"):
        ember.load(p)


def test_missing_and_extra_tensors(moe, tmp_path):
    _, path = moe
    p = _copy_with(path, tmp_path / "a", tensors_edit=lambda sd: sd.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises((ValueError, KeyError), match="k_norm"):
        ember.load(p)
    p = _copy_with(path, tmp_path / "b", tensors_edit=lambda sd: sd.update({"model.layers.0.bonus.weight": torch.ones(2)}))
    with pytest.raises(ValueError, match=r"checkpoint has 1 tensor\(s\) the qwen3_moe model does not use, e\.g\. model\.layers\.0\.bonus"):
        ember.load(p)


def _config_and_one_file(path, tmp_path, name: str, data: bytes):
    """A checkpoint dir with ``path``'s config.json and one weights file holding ``data``."""
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    (tmp_path / name).write_bytes(data)
    return tmp_path


def test_corrupt_safetensors(moe, tmp_path):
    ckpt = _config_and_one_file(moe[1], tmp_path, "model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        ember.load(ckpt)


def test_pickle_only_checkpoint_is_refused(moe, tmp_path):
    ckpt = _config_and_one_file(moe[1], tmp_path, "pytorch_model.bin", b"whatever")
    with pytest.raises(ValueError, match="never unpickles"):
        ember.load(ckpt)


def test_prompt_and_batch_limits(moe):
    _, path = moe
    em = ember.load(path, max_seq_len=16, max_batch_size=2)
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
        em.generate(list(range(10)), max_new_tokens=7)
    with pytest.raises(ValueError, match="larger than max_batch_size=2"):
        em.generate([[1, 2]] * 3, max_new_tokens=2)
    with pytest.raises(ValueError, match="outside"):
        em.generate([[1, 500]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_seq_len: expected a positive int"):
        ember.load(path, max_seq_len=0)


def test_text_without_tokenizer(tmp_path):
    p = tiny.save(tiny.build(tiny.dense_config()), tmp_path)
    with pytest.raises(ValueError, match="no tokenizer files"):
        ember.load(p, max_seq_len=16).generate("hello", max_new_tokens=2)


def test_generate_text_stop_and_stream(moe):
    hf, path = moe
    em = ember.load(path, max_seq_len=64, max_batch_size=2)
    text = "once upon a time there lived a cat"
    ids = em.tokenizer.encode(text)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                      pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
    n = ref.index(1) if 1 in ref else len(ref)  # ember stops at EOS (id 1): compare up to it
    ref_text = em.tokenizer.decode(ref[:n])
    assert em.generate(text, max_new_tokens=12, stop=[])[0] == ref_text
    if n == len(ref):
        assert "".join(em.stream(text, max_new_tokens=12)) == ref_text
        # stopping on the 4th generated token id keeps the first three
        assert em.generate(ids, max_new_tokens=12, stop=[ref[3]])[0] == ref[: ref.index(ref[3])]
    # per-row sampling: seeded sampling is reproducible
    s = ember.SamplingParams(temperature=1.0, top_k=10, seed=3)
    a = em.generate([ids, ids], max_new_tokens=6, sampling=[s, s])
    assert a == em.generate([ids, ids], max_new_tokens=6, sampling=[s, s])
    assert len(a[0]) <= 6


def test_fp8_lm_head_quantises_the_head_per_row(moe_aligned):
    """fp8_lm_head=True: the lm_head becomes a row-scaled Fp8Linear whose logits are exactly those of
    the dequantised head applied to the same final hidden rows, close to the bf16-head model's."""
    from ember.nn.fp8_linear import Fp8Linear
    from ember.ops import fp8 as fp8_ops
    hf, path = moe_aligned
    base = ember.load(path, fp8=True, max_seq_len=32)
    em = ember.load(path, fp8=True, max_seq_len=32, fp8_lm_head=True)
    assert isinstance(em.net.lm_head, Fp8Linear) and em.net.lm_head.granularity == "row"
    w = base.net.lm_head.weight
    q, s = fp8_ops.quantize_fp8(w, "row")
    assert torch.equal(em.net.lm_head.weight, q) and torch.equal(em.net.lm_head.weight_scale, s)
    a, b = base(_ids()).float(), em(_ids()).float()
    snr_db = 10 * torch.log10(a.pow(2).mean() / (a - b).pow(2).mean())
    assert 20 < snr_db < 60  # fp8 rounding of the head: visible, and bounded (~30 dB for random weights)


def test_fp8_lm_head_needs_fp8_and_a_bool(moe):
    _, path = moe
    with pytest.raises(ValueError, match="fp8_lm_head: needs fp8=True or an FP8 checkpoint"):
        ember.load(path, max_seq_len=32, fp8_lm_head=True)
    with pytest.raises(TypeError, match="fp8_lm_head: expected a bool"):
        ember.load(path, fp8=True, max_seq_len=32, fp8_lm_head="yes")


# ----------------------------------------------------------------------------- hardening: named errors
@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf = tiny.build(tiny.dense_config())
    return hf, tiny.save(hf, tmp_path_factory.mktemp("dense"), tokenizer=True)


def _copy_dir(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_named(dense, tmp_path, value):
    _, path = dense
    def poison(sd):
        sd["model.layers.1.mlp.down_proj.weight"][3, 5] = value
    p = _copy_with(path, tmp_path, tensors_edit=poison)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.down_proj\.weight has "
                                         r"non-finite values .*check_weights=False"):
        ember.load(p, max_seq_len=16)
    em = ember.load(p, max_seq_len=16, check_weights=False)  # loads as asked
    assert not torch.isfinite(em.net.state_dict()[next(k for k in em.net.state_dict() if "layers.1" in k and
                                                        "down" in k)]).all()


def test_non_finite_fp8_weight_is_named(dense, tmp_path):
    from ember.quantize_cli import quantize_checkpoint
    _, path = dense
    out = tmp_path / "fp8"
    quantize_checkpoint(path, out, "cpu")
    sd = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    assert sd[name].dtype == torch.float8_e4m3fn
    sd[name].view(torch.uint8)[1, 2] = 0x7F  # e4m3fn NaN
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor {name} has non-finite values"):
        ember.load(out, max_seq_len=16)


@pytest.mark.gpu
def test_non_finite_weights_are_named_on_the_gpu(dense, tmp_path):
    _, path = dense
    p = _copy_with(path, tmp_path, tensors_edit=lambda sd: sd["model.norm.weight"].__setitem__(7, float("nan")))
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight has non-finite values"):
        ember.load(p, device="cuda", max_seq_len=16)
    assert ember.load(path, device="cuda", max_seq_len=16).net.lm_head.weight.is_cuda


def test_weight_map_pointing_at_the_wrong_shard(dense, tmp_path):
    hf, _ = dense
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    name = next(n for n, f in wm.items() if f == shards[0])
    wm[name] = shards[1]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"weight_map puts {name} in {shards[1]}, but that file does not hold it "
                                         rf"\(it is in {shards[0]}\)"):
        ember.load(tmp_path, max_seq_len=16)


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json", "generation_config.json",
                                  "model.safetensors.index.json"])
def test_bad_json_names_the_file(dense, tmp_path, file):
    hf, path = dense
    if file == "model.safetensors.index.json":
        hf.save_pretrained(tmp_path, max_shard_size="40KB")
    else:
        _copy_dir(path, tmp_path)
    (tmp_path / file).write_text('{"eos_token_id": 1,\n "oops": }')
    with pytest.raises(ValueError, match=rf"{file}: not valid JSON \(line 2, column 10"):
        ember.load(tmp_path, max_seq_len=16)


def test_num_hidden_layers_beyond_the_checkpoint(dense, tmp_path):
    _, path = dense
    p = _copy_with(path, tmp_path / "more", cfg_edit=lambda c: c.update(num_hidden_layers=4))
    with pytest.raises(ValueError, match=r"num_hidden_layers=4, but the checkpoint has no tensors for "
                                         r"model\.layers\.2\.\*, model\.layers\.3\.\*"):
        ember.load(p, max_seq_len=16)
    p = _copy_with(path, tmp_path / "fewer", cfg_edit=lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"does not use, e\.g\. model\.layers\.1\..*num_hidden_layers=1 but the "
                                         r"checkpoint also holds layer\(s\) 1"):
        ember.load(p, max_seq_len=16)


def test_wrong_model_type_is_suggested(moe, tmp_path):
    _, path = moe
    def as_dense(cfg):  # a dense config.json beside MoE weights: nothing in the config gives it away
        cfg.update(model_type="qwen3")
        for key in ("num_experts", "num_local_experts"):
            cfg.pop(key, None)
    p = _copy_with(path, tmp_path, cfg_edit=as_dense)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*the checkpoint has \d+ tensor\(s\) "
                                         r"under model\.layers\.0\.mlp\. the qwen3 model does not read, e\.g\. "
                                         r"model\.layers\.0\.mlp\.experts\..*; is model_type right\?"):
        ember.load(p, max_seq_len=16)


@pytest.mark.parametrize("device, words", [("nosuch", "not a device name"), ("cuda:9", "")])
def test_bad_device_is_named(dense, device, words):
    if device.startswith("cuda"):
        if torch.cuda.device_count() > 9:
            pytest.skip("cuda:9 exists")
        words = "only" if torch.cuda.is_available() else "no CUDA support"
    with pytest.raises(ValueError, match=rf"device '{device}'.*{words}"):
        ember.load(dense[1], device=device, max_seq_len=16)


def test_progress_bar_only_on_a_terminal(dense, capsys, monkeypatch):
    import os
    import pty
    import subprocess
    import sys
    import ember.loading
    _, path = dense
    monkeypatch.setattr(ember.loading, "PROGRESS_BYTES", 0)  # the tiny checkpoint counts as large
    ember.load(path, max_seq_len=16)
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    leader, follower = pty.openpty()
    code = ("import ember, ember.loading as l; l.PROGRESS_BYTES = 0; "
            f"ember.load({str(path)!r}, max_seq_len=16); print('done')")
    r = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=follower, timeout=300)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert r.returncode == 0 and r.stdout.strip() == b"done"
    assert b"loading " + path.name.encode() in shown
