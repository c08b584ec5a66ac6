"""`ember quantize DIR OUT --fp8` as a user runs it: it never touches its input, refuses unsafe or
occupied outputs, validates the source before writing, leaves nothing behind when it fails, and
--overwrite replaces every stale checkpoint file."""
import hashlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import ember
from ember.cli import main
from ember.quantize_cli import quantize_checkpoint
from tests.models import tiny


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ember", "quantize", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def _checksums(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _one_line_error(err: str, *words):
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember quantize: "), err
    for w in words:
        assert w in lines[0], (w, err)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return tiny.save(tiny.build(tiny.dense_config()), tmp_path_factory.mktemp("dense") / "src", tokenizer=True)


def _copy(src, dst):
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_out_equal_to_source_is_refused_by_the_cli(dense):
    before = _checksums(dense.parent)
    r = _cli(dense, dense, "--fp8", "--overwrite")
    assert r.returncode == 2
    _one_line_error(r.stderr, "is the source directory")
    assert _checksums(dense.parent) == before


@pytest.mark.parametrize("case", ["nested", "containing", "not_empty"])
def test_unsafe_or_occupied_out_is_refused(tmp_path, dense, capsys, case):
    src = _copy(dense, tmp_path / "box" / "src")
    out, extra = {"nested": (src / "fp8", []), "containing": (tmp_path / "box", ["--overwrite"]),
                  "not_empty": (tmp_path / "taken", [])}[case]
    if case == "not_empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before, paths = _checksums(tmp_path), sorted(tmp_path.rglob("*"))
    assert main(["quantize", str(src), str(out), "--fp8", *extra]) == 2
    words = {"nested": "is inside the source directory", "containing": "contains the source directory",
             "not_empty": "exists and is not empty; pass --overwrite"}[case]
    _one_line_error(capsys.readouterr().err, str(out), words)
    assert _checksums(tmp_path) == before and sorted(tmp_path.rglob("*")) == paths  # nothing written or removed


def test_overwrite_replaces_a_stale_sharded_checkpoint(tmp_path, dense):
    out = tmp_path / "out"
    tiny.save(tiny.build(tiny.moe_config(), seed=1), out, tokenizer=True, max_shard_size="40KB")
    (out / "README.md").write_text("kept")
    assert (out / "model.safetensors.index.json").is_file()
    source_before = _checksums(dense)
    r = _cli(dense, out, "--fp8", "--device", "cpu", "--overwrite")
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.iterdir())
    assert not any(n.startswith("model-") or n.endswith(".index.json") for n in names), names
    assert "README.md" in names and (out / "README.md").read_text() == "kept"
    assert _checksums(dense) == source_before
    # the new weights: exactly the block quantisation of the source's, and they load
    from ember.ops import fp8 as fp8_ops
    src_sd, out_sd = load_file(str(dense / "model.safetensors")), load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    q, s = fp8_ops.quantize_fp8(src_sd[name], "block")
    assert torch.equal(out_sd[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(out_sd[name.replace("weight", "weight_scale_inv")], s)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    em = ember.load(out, max_seq_len=16)
    assert em.fp8 and em.net.lm_head.weight.shape == (128, 64)


def test_a_crash_leaves_no_output_and_no_directories(tmp_path, dense, monkeypatch):
    from ember.ops import fp8 as fp8_ops
    real, calls = fp8_ops.quantize_fp8, []

    def interrupted(*args, **kw):  # Ctrl-C on the third weight
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(fp8_ops, "quantize_fp8", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(dense, tmp_path / "a" / "b" / "out", "cpu")
    assert list(tmp_path.iterdir()) == []


def test_bad_device_on_the_cli(tmp_path, dense):
    if torch.cuda.is_available():
        pytest.skip("cuda is a valid device here")
    r = _cli(dense, tmp_path / "out", "--fp8", "--device", "cuda")
    assert r.returncode == 2
    _one_line_error(r.stderr, "device 'cuda'", "no CUDA")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device, words", [("nosuch", "not a device name"), ("mps", "MPS is not available"),
                                           ("cuda:7", "")])
def test_bad_device(tmp_path, dense, capsys, device, words):
    if device == "mps" and torch.backends.mps.is_available() or device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip(f"{device} exists here")
    if device == "cuda:7":
        words = "only" if torch.cuda.is_available() else "no CUDA support"
    assert main(["quantize", str(dense), str(tmp_path / "out"), "--fp8", "--device", device]) == 2
    _one_line_error(capsys.readouterr().err, f"device {device!r}", words)
    assert list(tmp_path.iterdir()) == []


def _broken(dense, dst, kind):
    src = _copy(dense, dst)
    if kind == "shape":
        cfg = json.loads((src / "config.json").read_text())
        cfg["intermediate_size"] = 80
        (src / "config.json").write_text(json.dumps(cfg))
    else:
        sd = load_file(str(src / "model.safetensors"))
        if kind == "missing":
            del sd["model.layers.1.post_attention_layernorm.weight"]
        else:
            sd["model.layers.0.self_attn.o_proj.weight"][2, 3] = float("nan")
        save_file(sd, str(src / "model.safetensors"))
    return src


@pytest.mark.parametrize("kind, words", [
    ("shape", ["model.layers.0.mlp.gate_proj.weight", "(80, 64)", "(96, 64)"]),
    ("missing", ["model.layers.1.post_attention_layernorm.weight"]),
    ("nan", ["model.layers.0.self_attn.o_proj.weight", "non-finite"]),
])
def test_bad_source_is_refused_before_anything_is_written(tmp_path, dense, capsys, kind, words):
    src = _broken(dense, tmp_path / "src", kind)
    before = _checksums(tmp_path)
    assert main(["quantize", str(src), str(tmp_path / "out"), "--fp8", "--device", "cpu"]) == 2
    _one_line_error(capsys.readouterr().err, *words)
    assert _checksums(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
