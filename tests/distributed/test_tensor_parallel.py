"""Tensor / expert parallel on CPU: ranks spawned by the test (gloo), a tiny transformers Qwen3-MoE
as the oracle. Spawning costs seconds, so each spawn checks several things."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

import ember
import ember.distributed as ed
from tests.distributed import _worker
from tests.models import tiny

NEW = 12
PROMPT = 9


def _spawn(fn, world: int, *args, timeout_s: float = 150) -> list[int]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes; their exit codes (a process
    still running at the timeout is killed and the test fails: that is a hang)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"rank(s) {hung} still running after {timeout_s} s (a hang)"
    return [p.exitcode for p in procs]


def _config():
    # 3 layers: MoE, dense MLP, MoE; 4 query / 2 KV heads (4 ranks replicate each KV head twice)
    return tiny.moe_config(num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=96)


def _fp8_config() -> dict:
    """A Qwen3-MoE config small enough for a CPU whose FP8 block scales split on 128-row edges."""
    return dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                vocab_size=256, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    hf = tiny.build(_config())
    path = tiny.save(hf, tmp_path_factory.mktemp("ckpt"))
    prompt = torch.randint(0, 128, (1, PROMPT))
    with torch.no_grad():
        ref_logits = hf(prompt).logits
        ref_tokens = hf.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)[0, PROMPT:].tolist()
        full = torch.cat([prompt, torch.tensor([ref_tokens])], 1)
        ref_decode = hf(full).logits[0, PROMPT - 1:-1]
    single = ember.load(path, max_seq_len=64)
    tokens, decode = _worker.greedy(single, prompt, NEW)
    return dict(path=path, prompt=prompt, ref_logits=ref_logits, ref_tokens=ref_tokens, ref_decode=ref_decode,
                single_logits=single(prompt), single_tokens=tokens, single_decode=decode)


def _close(got, ref, rtol=1e-5):
    err = (got - ref).abs().max().item()
    assert err <= rtol * ref.abs().max().item(), f"max abs error {err} vs scale {ref.abs().max().item()}"


@pytest.mark.parametrize("world", [2, 4])
def test_split_matches_one_process_and_transformers(oracle, tmp_path, world):
    torch.save(oracle["prompt"], tmp_path / "prompt.pt")
    torch.save(_fp8_config(), tmp_path / "fp8_cfg.pt")
    codes = _spawn(_worker.split_run, world, str(tmp_path), str(oracle["path"]), NEW)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    assert codes == [0] * world
    for r, res in enumerate(results):
        # logits (fp32): as transformers and as one process, to ~1e-5; the same greedy tokens
        _close(res["logits"], oracle["ref_logits"])
        _close(res["logits"], oracle["single_logits"])
        _close(res["decode_logits"], oracle["ref_decode"])
        _close(res["decode_logits"], oracle["single_decode"])
        assert res["tokens"] == oracle["ref_tokens"] == oracle["single_tokens"]
        # this rank's layer 0: its heads, KV heads, experts (router replicated)
        nh, kvh, d, E, H = 4, 2, 16, 8, 64
        shapes = res["local_shapes"]
        assert shapes["layers.0.attn.qkv.weight"] == ((nh // world + 2 * max(kvh // world, 1)) * d, H)
        assert shapes["layers.0.attn.o.inner.weight"] == (H, nh // world * d)
        assert shapes["layers.0.mlp.router"] == (E, H)
        assert shapes["layers.0.mlp.w_gate_up"] == (E // world, 2 * 32, H)
        # the random FP8 shard: fp8 experts, this rank's share, logits identical on every rank
        assert res["fp8_expert_dtype"] == "torch.float8_e4m3fn" and res["fp8_experts_local"] == 8 // world
        assert torch.isfinite(res["fp8_logits"]).all() and res["fp8_logits"].shape == (1, 256)
        assert torch.equal(res["fp8_logits"], results[0]["fp8_logits"])
    _check_reads(results, world, oracle["path"])


def _check_reads(results, world: int, ckpt) -> None:
    """Each rank read only its slices: its experts' tensors and no other's, 1/world of each split
    tensor's rows, and the split tensors' reads of all ranks add up to the whole tensor once."""
    from safetensors import safe_open
    reads = [{n: (shape, nbytes) for n, shape, nbytes in res["reads"]} for res in results]
    for r, rd in enumerate(reads):
        e0, e1 = r * 8 // world, (r + 1) * 8 // world
        experts = {int(n.split(".")[5]) for n in rd if ".mlp.experts." in n}
        assert experts == set(range(e0, e1)), f"rank {r} read experts {sorted(experts)}"
        assert rd["model.layers.0.self_attn.q_proj.weight"][0] == (4 // world * 16, 64)
        assert rd["model.layers.0.self_attn.o_proj.weight"][0] == (64, 4 // world * 16)
        assert rd["model.layers.1.mlp.down_proj.weight"][0] == (64, 96 // world)
        assert rd["lm_head.weight"][0] == (128 // world, 64)
        assert rd["model.layers.0.mlp.gate.weight"][0] == (8, 64)  # replicated
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        full = {n: f.get_slice(n).get_shape() for n in f.keys()}
    nbytes = {n: 4 * int(torch.tensor(shape).prod()) for n, shape in full.items()}  # fp32 checkpoint
    for n, b in nbytes.items():
        if any(k in n for k in ("q_proj", "o_proj", "lm_head", ".experts.", "layers.1.mlp.")):
            copies = 1  # split: every row read by exactly one rank
        elif "k_proj" in n or "v_proj" in n:
            copies = max(world // 2, 1)  # 2 KV heads: replicated on world / 2 ranks past 2
        else:
            copies = world  # norms, router, embedding: on every rank
        assert sum(rd.get(n, (None, 0))[1] for rd in reads) == copies * b, n
    for r, rd in enumerate(reads):
        assert sum(b for _, b in rd.values()) < sum(nbytes.values()), f"rank {r} read the whole checkpoint"


def test_a_failing_rank_makes_every_rank_raise(oracle, tmp_path):
    """A damaged tensor only rank 1 reads (its expert 7): both ranks raise, naming rank 1 and the
    tensor; then rank 1 dies before a collective: rank 0 raises within the group's timeout, no hang."""
    from safetensors.torch import load_file, save_file
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(oracle["path"], bad)
    sd = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.experts.7.down_proj.weight"
    sd[name][0, 0] = float("nan")
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    codes = _spawn(_worker.failing_run, 2, str(tmp_path), str(bad), timeout_s=90)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for res in (r0, r1):
        assert "load" in res, (codes, r0, r1)
        assert res["load"].startswith("RuntimeError: loading the shard failed on 1 of 2 rank(s): rank 1: ValueError")
        assert name in res["load"] and "non-finite" in res["load"]
    assert codes[1] == 3
    assert "collective" in r0 and r0["collective"] != "returned" and r0["collective_s"] < 25, (codes, r0)


def test_load_names_tensor_parallel_without_a_process_group(oracle):
    with pytest.raises(ValueError, match=r"tensor_parallel=2: no torch.distributed process group"):
        ember.load(oracle["path"], tensor_parallel=2)
    with pytest.raises(ValueError, match=r"tensor_parallel: expected a positive int, got 0"):
        ember.load(oracle["path"], tensor_parallel=0)


def test_plan_splits_and_names_what_does_not():
    cfg = dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
               num_key_value_heads=4, head_dim=128, num_experts=128, vocab_size=151936, intermediate_size=12288,
               mlp_only_layers=[], decoder_sparse_step=1)
    for world, heads, kv in ((2, 32, 2), (4, 16, 1), (8, 8, 1)):
        plans = [ed.ShardPlan.from_config(cfg, r, world) for r in range(world)]
        assert [p.heads for p in plans] == [(r * heads, (r + 1) * heads) for r in range(world)]
        assert all(p.kv_heads[1] - p.kv_heads[0] == kv for p in plans)
        # every rank's query heads read its KV heads (GQA group = 16 query heads a KV head)
        assert all(p.kv_heads[0] == p.heads[0] // 16 for p in plans)
        assert [p.experts for p in plans] == [(r * 128 // world, (r + 1) * 128 // world) for r in range(world)]
    p = ed.ShardPlan.from_config(cfg, 3, 8)
    assert p.slice_for("model.layers.5.self_attn.k_proj.weight_scale_inv") == ed.Slice(0, 1, 2, 4)
    assert p.slice_for("model.layers.5.self_attn.o_proj.weight") == ed.Slice(1, 3 * 1024, 4 * 1024, 8192)
    assert p.local_expert("model.layers.5.mlp.experts.2.up_proj.weight") == "model.layers.5.mlp.experts.50.up_proj.weight"
    assert p.slice_for("model.layers.5.mlp.gate.weight") is None
    with pytest.raises(ValueError, match="num_experts=128 does not split into 3"):
        ed.ShardPlan.from_config(dict(cfg, num_attention_heads=48), 0, 3)
    with pytest.raises(ValueError, match="num_key_value_heads=4 neither splits into 6"):
        ed.ShardPlan.from_config(dict(cfg, num_attention_heads=48, num_experts=132, vocab_size=151938), 0, 6)
    small = dict(cfg, head_dim=64)
    with pytest.raises(ValueError, match="do not fall on 128-row FP8 block edges"):
        ed.ShardPlan.from_config(small, 1, 8).slice_for("model.layers.0.self_attn.k_proj.weight_scale_inv")


def test_local_routes_keep_only_this_ranks_experts():
    from ember.distributed.layers import local_routes
    w = torch.tensor([[0.5, 0.25, 0.25], [0.6, 0.3, 0.1]])
    ids = torch.tensor([[5, 1, 6], [0, 2, 3]], dtype=torch.int32)
    lw, lid = local_routes(w, ids, 4, 4)  # experts 4..7
    assert lw.tolist() == [[0.5, 0.0, 0.25], [0.0, 0.0, 0.0]]
    assert lid.tolist() == [[1, 1, 2], [0, 0, 0]] and lid.dtype == torch.int32
