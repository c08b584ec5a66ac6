"""Model oracle for Qwen3.5-MoE: tiny random transformers models (fp32) — the text-only
Qwen3_5MoeForCausalLM and the image-text Qwen3_5MoeForConditionalGeneration layout of the released
checkpoints — built by ember.models.qwen3_5_moe and compared with transformers' forward and greedy
generate (transformers' own conv / recurrent / KV cache)."""
import collections

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.models import _common, qwen3_5_moe
from tests.models.test_lfm2_moe import (NEW, PROMPT_LEN, allocate, assert_forward_matches_hf, assert_greedy_matches_hf,
                                        assert_two_lengths_match_hf, build_net, close, fake_quantized,
                                        graph_decode_matches_eager, greedy, hf_logits, randomize)

VOCAB = 96


def text_kwargs(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, initializer_range=0.1,
                max_position_embeddings=256)
    base.update(kw)
    return base


def build_hf(kind: str, seed: int = 0, **kw):
    import transformers
    torch.manual_seed(seed)
    if kind == "text":
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5MoeTextConfig(**text_kwargs(**kw)),
                                                              dtype=torch.float32)
    else:  # the released layout: text under model.language_model., plus a vision tower ember ignores
        vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64, patch_size=2,
                      spatial_merge_size=1, num_position_embeddings=16)
        cfg = transformers.Qwen3_5MoeConfig(text_config=text_kwargs(**kw), vision_config=vision)
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).to(torch.float32)
    # Qwen3.5's RMSNorm weights are offsets from 1 (zeros at init); the gated DeltaNet norm is a plain weight.
    return randomize(model.eval(), one=("linear_attn.norm",))


VARIANTS = {
    "text": ("text", {}),
    # the image-text checkpoint layout; 2 full-attention layers (interval 2), half-rotary heads
    "image_text": ("image_text", dict(layer_types=None, full_attention_interval=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    kind, kw = VARIANTS[request.param]
    hf = build_hf(kind, **kw)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, build_net(path, qwen3_5_moe), path


def test_checkpoint_layout(pair):
    hf, net, path = pair
    from safetensors import safe_open
    names = set(safe_open(str(path / "model.safetensors"), "pt").keys())
    prefix = "model.language_model." if hasattr(hf.model, "language_model") else "model."
    assert f"{prefix}layers.0.linear_attn.in_proj_qkv.weight" in names
    assert any(".mlp.shared_expert_gate.weight" in n for n in names)


def test_cache_free_forward_matches_transformers(pair):
    hf, net, _ = pair
    assert_forward_matches_hf(hf, net, VOCAB)


def test_greedy_decode_matches_transformers_generate(pair):
    hf, net, _ = pair
    assert_greedy_matches_hf(hf, net, VOCAB)


def test_batch_of_two_different_lengths(pair):
    hf, net, _ = pair
    assert_two_lengths_match_hf(hf, net, VOCAB)


def test_fp8_matches_transformers_with_the_same_quantised_weights(pair):
    """FP8 on load equals transformers run on dequant(quant(w)) weights (the permuted q/k rows keep
    their per-row scales). Against the unquantised model this tiny random DeltaNet is very sensitive
    (logit SNR ~5 dB, measured), so the quantisation itself is checked here, not its accuracy."""
    hf, _, path = pair
    net = build_net(path, qwen3_5_moe, fp8=True)
    ids = torch.randint(0, VOCAB, (2, 13))
    ref = hf_logits(fake_quantized(hf), ids)
    with torch.no_grad():
        got = net.prefill(ids)
    assert close(got, ref)


def test_cache_specs_layout(pair):
    hf, net, _ = pair
    c = hf.config.get_text_config()
    specs = net.cache_specs(2, 48, torch.bfloat16)
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    assert len(specs) == c.num_hidden_layers
    for kind, spec in zip(c.layer_types, specs):
        if kind == "linear_attention":
            assert spec == (((2, conv_dim, c.linear_conv_kernel_dim - 1), torch.bfloat16),
                            ((2, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), torch.float32))
        else:
            assert spec == (((2, c.num_key_value_heads, 48, c.head_dim), torch.bfloat16),) * 2


def test_rotary_permutation_matches_partial_rope():
    """The permuted full rotate-half equals transformers' partial RoPE on the original layout."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import apply_rotary_pos_emb
    D, R, T = 32, 8, 5
    x = torch.randn(1, 2, T, D, dtype=torch.float64)
    inv = 1.0 / (1000.0 ** (torch.arange(0, R, 2, dtype=torch.float64) / R))
    f = torch.arange(T, dtype=torch.float64)[:, None] * inv
    emb = torch.cat([f, f], -1)[None]
    ref, _ = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin())
    perm = qwen3_5_moe.rotary_permutation(D, R)
    cos, sin = qwen3_5_moe.rope_tables(D, R, 1000.0, T, "cpu")
    y = x[..., perm]
    y1, y2 = y.chunk(2, -1)
    c, s = cos.double()[None, None], sin.double()[None, None]
    got = torch.cat([y1 * c - y2 * s, y2 * c + y1 * s], -1)
    torch.testing.assert_close(got, ref[..., perm], rtol=1e-6, atol=1e-6)  # fp32 tables vs fp64 math


# ----------------------------------------------------------------------------- bad input
def _text_cfg(cfg):
    return cfg["text_config"] if "text_config" in cfg else cfg


def test_layer_types_length_mismatch(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match="layer_types has 3 entries but num_hidden_layers is 4"):
        build_net(path, qwen3_5_moe, cfg_edit=lambda c: _text_cfg(c).update(layer_types=_text_cfg(c)["layer_types"][:3]))


def test_unknown_layer_type(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match="layer_types entries must be in"):
        build_net(path, qwen3_5_moe, cfg_edit=lambda c: _text_cfg(c)["layer_types"].__setitem__(0, "conv"))


def test_conv_kernel_mismatch(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match=r"linear_conv_kernel_dim=3 does not match checkpoint tensor "
                                         r"model\.(language_model\.)?layers\.0\.linear_attn\.conv1d\.weight"):
        build_net(path, qwen3_5_moe, cfg_edit=lambda c: _text_cfg(c).update(linear_conv_kernel_dim=3))


def test_state_dims_mismatch(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match=r"linear_num_key_heads \* linear_key_head_dim .* does not match .*conv1d"):
        build_net(path, qwen3_5_moe, cfg_edit=lambda c: _text_cfg(c).update(linear_key_head_dim=8))
    with pytest.raises(ValueError, match=r"linear_value_head_dim=8 does not match|linear_num_key_heads"):
        build_net(path, qwen3_5_moe, cfg_edit=lambda c: _text_cfg(c).update(linear_value_head_dim=8))


def test_value_heads_mismatch_names_a_log(pair):
    """Heads moved between keys and values keep conv_dim; A_log still disagrees, and says so."""
    _, _, path = pair
    with pytest.raises(ValueError, match=r"linear_num_value_heads=2 does not match checkpoint tensor .*A_log"):
        build_net(path, qwen3_5_moe, cfg_edit=lambda c: _text_cfg(c).update(
            linear_num_value_heads=2, linear_value_head_dim=32))


def test_missing_tensor_named(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match=r"missing tensor\(s\).*shared_expert_gate"):
        build_net(path, qwen3_5_moe, tensors_edit=lambda t: [t.pop(n) for n in list(t)
                                                             if n.endswith("layers.1.mlp.shared_expert_gate.weight")])


def test_odd_partial_rotary_rejected(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        build_net(path, qwen3_5_moe, cfg_edit=lambda c: _text_cfg(c)["rope_parameters"].update(
            partial_rotary_factor=0.3))


def test_prefill_ignores_stale_state(pair):
    """A second request in the same cache row gets the same tokens as the first (state reset by prefill)."""
    _, net, _ = pair
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,)).tolist()
    caches = allocate(net, 1, 64, poison=False)
    outs = []
    with torch.no_grad():
        for _ in range(2):
            logits = net.prefill(torch.tensor([prompt]), caches, last_only=True)
            pos = torch.tensor([PROMPT_LEN])
            for _ in range(4):
                logits = net.decode(logits.argmax(-1), pos, (pos + 1).to(torch.int32), caches)
                pos = pos + 1
            outs.append(logits)
    assert torch.equal(outs[0], outs[1])


def test_triton_kernels_via_interpreter(interpreter, tmp_path):
    """The GPU code path (conv, delta rule, attention, MoE kernels) through Triton's interpreter on CPU."""
    hf = build_hf("text")
    hf.save_pretrained(tmp_path)
    assert_greedy_matches_hf(hf, build_net(tmp_path, qwen3_5_moe), VOCAB, new=8)


# ----------------------------------------------------------------------------- the DeltaNet mixer's launches
def torch_composed_mix(mixer, h, conv_state, state):
    """Oracle for ``GatedDeltaNet``: the same math as separate ops (the gates in torch, the plain conv,
    the delta rule given g and beta, then RMSNorm and the silu(z) gate), 16 launches at T = 1."""
    B, T, _ = h.shape
    qkv, z = mixer.proj(h).split(mixer.split, dim=-1)
    b, a = mixer.proj_ba(h).split([mixer.hv, mixer.hv], dim=-1)
    qkv = ember.ops.causal_conv1d(qkv.transpose(1, 2), mixer.conv_weight, conv_state=conv_state,
                                  activation="silu").transpose(1, 2).contiguous()
    kd = mixer.hk * mixer.dk
    q, k, v = qkv.split([kd, kd, mixer.hv * mixer.dv], dim=-1)
    g = mixer.neg_a * F.softplus(a.float() + mixer.dt_bias)
    o = ember.ops.gated_delta_rule(q.reshape(B, T, mixer.hk, mixer.dk), k.reshape(B, T, mixer.hk, mixer.dk),
                                   v.reshape(B, T, mixer.hv, mixer.dv), g, b.sigmoid(), state=state)
    o = ember.ops.rmsnorm(o, mixer.norm, mixer.eps)
    o = (o.float() * F.silu(z.reshape(B, T, mixer.hv, mixer.dv).float())).to(h.dtype)
    return mixer.out_proj(o.reshape(B, T, mixer.hv * mixer.dv))


def _mixer_vs_composed(mixer, h, cache):
    """(mixer output, composed output, mixer cache, composed cache): decode at T = 1 from the cache's
    states, prefill (states from zeros) otherwise."""
    caches = [cache, tuple(t.clone() for t in cache)]
    with torch.no_grad():
        if h.shape[1] == 1:
            got = mixer.decode(h[:, 0], None, None, None, None, caches[0])[:, None]
        else:
            got = mixer.prefill(h, None, None, caches[0])
            for t in caches[1]:
                t.zero_()
        want = torch_composed_mix(mixer, h, *caches[1])
    return got, want, caches[0], caches[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 9])
def test_mixer_matches_composed_ops_interpreter(interpreter, tmp_path, dtype, T):
    """The mixer (gates in the delta-rule kernel, gated norm, channels-last conv) against the composed
    ops, both through the kernels. The interpreter's exp (numpy) differs from torch's CPU exp in the
    last bit for ~40% of inputs, which the composed gates and silu use and the mixer's kernels do not
    (on the GPU both are CUDA's expf: the gpu test is bit-exact): the fp32 state and fp32 outputs agree
    to 1e-5 of their largest value (~80 fp32 ulps), bf16 outputs exactly."""
    build_hf("text", num_hidden_layers=2, num_experts=2, num_experts_per_tok=1).save_pretrained(tmp_path)
    mixer = build_net(tmp_path, qwen3_5_moe, dtype=dtype).layers[0].attn
    assert isinstance(mixer, qwen3_5_moe.GatedDeltaNet)
    B = 2
    cache = tuple((torch.randn(s) * 0.1).to(d) for s, d in mixer.cache_spec(B, 16, dtype))
    got, want, c_got, c_want = _mixer_vs_composed(mixer, torch.randn(B, T, 64).to(dtype), cache)
    assert torch.equal(c_got[0], c_want[0])  # the conv state: the projection's values, copied
    assert close(c_got[1], c_want[1], rel=1e-5)  # the fp32 recurrent state (the exp above)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert close(got, want, rel=1e-5)


def _count_launches(fn):
    """(non-view torch ops, Triton launches by kernel name) that ``fn()`` issues: what a CUDA
    graph of it would replay. Triton runs are counted at the interpreter's launch and hidden from
    the torch-op count (the interpreter itself calls torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from triton.runtime.interpreter import InterpretedFunction

    ops, launches = collections.Counter(), collections.Counter()

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if not (func.is_view or name == "aten::_unsafe_view" or name.startswith("aten::empty")):
                ops[name] += 1
            return func(*args, **(kwargs or {}))

    real_run = InterpretedFunction.run

    def counting_run(self, *a, **kw):
        launches[self.fn.__name__] += 1
        with _disable_current_modes():
            return real_run(self, *a, **kw)

    InterpretedFunction.run = counting_run
    try:
        with torch.no_grad(), CountOps():
            fn()
    finally:
        InterpretedFunction.run = real_run
    return ops, launches


@pytest.mark.parametrize("B", [1, 3])
def test_mixer_launch_count(interpreter, tmp_path, B):
    """One DeltaNet decode step (T = 1) in bf16: 6 launches (the figure in GatedDeltaNet._mix's
    docstring), against the composed ops' 16."""
    build_hf("text").save_pretrained(tmp_path)
    net = build_net(tmp_path, qwen3_5_moe, dtype=torch.bfloat16)
    mixer = net.layers[0].attn
    assert isinstance(mixer, qwen3_5_moe.GatedDeltaNet)
    cache = tuple(torch.zeros(s, dtype=d) for s, d in mixer.cache_spec(B, 16, torch.bfloat16))
    h = torch.randn(B, 64, dtype=torch.bfloat16)
    counts = {"mixer": _count_launches(lambda: mixer.decode(h, None, None, None, None, cache)),
              "composed": _count_launches(lambda: torch_composed_mix(mixer, h[:, None], *cache))}
    # the three projections: the GEMV kernel for one row, F.linear (aten::mm) for more
    projections = {"gemv_kernel": 3} if B == 1 else {"aten::mm": 3}
    ops, launches = counts["mixer"]
    assert ops + launches == collections.Counter({
        **projections, "_causal_conv1d_kernel": 1, "_gated_delta_rule_kernel": 1, "_rmsnorm_gated_kernel": 1})
    ops, launches = counts["composed"]
    # a.float(), + dt_bias, softplus, * neg_a; b.sigmoid(); o.float(), z.float(), silu, *, .to()
    assert ops + launches == collections.Counter({
        **projections, "_causal_conv1d_kernel": 1, "_gated_delta_rule_kernel": 1, "_add_rmsnorm_kernel": 1,
        "aten::_to_copy": 4, "aten::add.Tensor": 1, "aten::softplus": 1, "aten::mul.Tensor": 2, "aten::sigmoid": 1,
        "aten::silu": 1})
    total = {k: sum(o.values()) + sum(n.values()) for k, (o, n) in counts.items()}
    assert total == {"mixer": 6, "composed": 16}


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(cuda, tmp_path):
    hf = build_hf("text")
    hf.save_pretrained(tmp_path)
    net = build_net(tmp_path, qwen3_5_moe, dtype=torch.bfloat16, device=cuda)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,)).tolist()
    e_toks, g_toks, e_logits, g_logits = graph_decode_matches_eager(net, prompt, NEW)
    assert g_toks == e_toks
    assert torch.equal(g_logits, e_logits)


@pytest.mark.gpu
def test_gpu_kernels_match_transformers_fp32(cuda, tmp_path):
    """The Triton paths (conv, delta rule, attention, MoE) in fp32 on the GPU: transformers' greedy tokens."""
    hf = build_hf("text")
    hf.save_pretrained(tmp_path)
    net = build_net(tmp_path, qwen3_5_moe, device=cuda)
    assert_greedy_matches_hf(hf.to(cuda), net, VOCAB)


def _qwen35_deltanet(device, dtype=torch.bfloat16):
    """One GatedDeltaNet at Qwen3.5-35B-A3B's shapes (H 2048, 16 key / 32 value heads of 128, conv
    K = 4) with random weights."""
    H, hk, hv, d, K = 2048, 16, 32, 128, 4
    conv_dim, vd = 2 * hk * d + hv * d, hv * d

    def w(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    return qwen3_5_moe.GatedDeltaNet(
        _common.Linear(w(conv_dim + vd, H, scale=H ** -0.5)), _common.Linear(w(2 * hv, H, scale=H ** -0.5)),
        w(conv_dim, K, scale=0.5), torch.randn(hv, device=device) * 0.5, torch.randn(hv, device=device),
        w(d, scale=0.2) + 1, _common.Linear(w(H, vd, scale=vd ** -0.5)), num_k_heads=hk, num_v_heads=hv,
        k_dim=d, v_dim=d, eps=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (1, 300)])
def test_gpu_mixer_bit_exact_qwen35_shapes(cuda, B, T):
    """At Qwen3.5-35B-A3B's shapes on the GPU the mixer equals the composed ops bit for bit (outputs
    and both states)."""
    mixer = _qwen35_deltanet(cuda)
    h = torch.randn(B, T, 2048, device=cuda, dtype=torch.bfloat16)
    cache = tuple(torch.randn(s, device=cuda).to(d) * 0.1 for s, d in mixer.cache_spec(B, 16, torch.bfloat16))
    got, want, c_got, c_want = _mixer_vs_composed(mixer, h, cache)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(c_got, c_want))


@pytest.mark.gpu
def test_gpu_mixer_cuda_graph_qwen35_shapes(cuda):
    """A captured decode step replayed on new inputs equals the eager composed ops, bit for bit."""
    mixer = _qwen35_deltanet(cuda)
    h = torch.randn(1, 2048, device=cuda, dtype=torch.bfloat16)
    cache = tuple(torch.randn(s, device=cuda).to(d) * 0.1 for s, d in mixer.cache_spec(1, 16, torch.bfloat16))
    with torch.no_grad():
        saved = tuple(t.clone() for t in cache)
        mixer.decode(h, None, None, None, None, cache)  # compile outside capture
        for t, s in zip(cache, saved):
            t.copy_(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mixer.decode(h, None, None, None, None, cache)
        ref_cache = tuple(t.clone() for t in cache)
        for _ in range(3):
            h.copy_(torch.randn_like(h))
            graph.replay()
            exp = torch_composed_mix(mixer, h[:, None], *ref_cache)[:, 0]
            assert torch.equal(out, exp)
        assert all(torch.equal(a, b) for a, b in zip(cache, ref_cache))


# ----------------------------------------------------------------------------- the folded shared expert
def build_unfolded(path, monkeypatch, **kw):
    """The net with the shared expert kept as its own MLP (``fold_shared_expert`` declining): the
    reference the folded block is compared with."""
    with monkeypatch.context() as m:
        m.setattr(qwen3_5_moe, "fold_shared_expert", lambda moe: None)
        return build_net(path, qwen3_5_moe, **kw)


def test_folded_shared_expert_matches_transformers(tmp_path):
    """The shared expert stored as expert E (gate as router row E): transformers' greedy tokens, fp32."""
    hf = build_hf("text", shared_expert_intermediate_size=32)  # = moe_intermediate_size: foldable
    hf.save_pretrained(tmp_path)
    net = build_net(tmp_path, qwen3_5_moe)
    assert all(isinstance(layer.mlp, qwen3_5_moe.FoldedSharedMoe) for layer in net.layers)
    assert net.layers[0].mlp.w_gate_up.shape[0] == 9 and net.layers[0].mlp.router.shape[0] == 9
    assert_greedy_matches_hf(hf, net, VOCAB)


def test_fold_skipped_when_the_shared_expert_is_wider(pair):
    """shared_expert_intermediate_size 48 != 32: nothing to fold, the block stays as it is."""
    _, net, _ = pair
    assert all(isinstance(layer.mlp, qwen3_5_moe.SharedExpertMoe) for layer in net.layers)


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "interpreter"])
def test_folded_fp8_shared_expert_matches_unfolded(request, monkeypatch, tmp_path, kernels):
    """FP8 on load (row scales): the shared expert folds in with its own scales as expert E, giving the
    unfolded fp8 block's logits up to fp32 summation order (through the Triton kernels too)."""
    if kernels:
        request.getfixturevalue("interpreter")
    _assert_fp8_fold_matches_unfolded(monkeypatch, tmp_path, "cpu")


@pytest.mark.gpu
def test_gpu_folded_fp8_shared_expert_matches_unfolded(cuda, monkeypatch, tmp_path):
    _assert_fp8_fold_matches_unfolded(monkeypatch, tmp_path, cuda)


def _assert_fp8_fold_matches_unfolded(monkeypatch, tmp_path, device):
    build_hf("text", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
             shared_expert_intermediate_size=32).save_pretrained(tmp_path)
    nets = {"unfolded": build_unfolded(tmp_path, monkeypatch, fp8=True, device=device),
            "folded": build_net(tmp_path, qwen3_5_moe, fp8=True, device=device)}
    folded = [layer.mlp for layer in nets["folded"].layers]
    assert all(isinstance(m, qwen3_5_moe.FoldedSharedMoe) and m.gate_up_scale is not None for m in folded)
    assert folded[0].gate_up_scale.shape[0] == folded[0].w_gate_up.shape[0] == 5
    assert isinstance(nets["unfolded"].layers[0].mlp, qwen3_5_moe.SharedExpertMoe)
    ids = torch.randint(0, VOCAB, (2, 9), device=device)
    with torch.no_grad():
        unfolded_logits, folded_logits = nets["unfolded"].prefill(ids), nets["folded"].prefill(ids)
    assert close(folded_logits, unfolded_logits, rel=1e-5)


def test_fp8_fold_needs_matching_scale_layouts(monkeypatch, tmp_path):
    """Routed experts with row scales and a shared expert with 128-block scales: not folded."""
    from ember.nn import Fp8Linear
    build_hf("text", shared_expert_intermediate_size=32).save_pretrained(tmp_path)
    moe = build_unfolded(tmp_path, monkeypatch, fp8=True).layers[0].mlp
    assert qwen3_5_moe.fold_shared_expert(moe) is not None
    gu = moe.shared.gate_up
    moe.shared.gate_up = Fp8Linear.from_fp8(gu.weight, torch.ones(1, 1), dtype=torch.float32)  # one 128-block
    assert moe.shared.gate_up.granularity == "block"
    assert qwen3_5_moe.fold_shared_expert(moe) is None


def test_folded_shared_expert_kernels_interpreter(interpreter, monkeypatch, tmp_path):
    """Through the Triton kernels (router with the gate row, 3 experts per token): same tokens as the
    unfolded model, logits within fp32 summation-order differences."""
    build_hf("text", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
             shared_expert_intermediate_size=32).save_pretrained(tmp_path)
    nets = {"unfolded": build_unfolded(tmp_path, monkeypatch), "folded": build_net(tmp_path, qwen3_5_moe)}
    assert isinstance(nets["folded"].layers[0].mlp, qwen3_5_moe.FoldedSharedMoe)
    prompts = [torch.randint(0, VOCAB, (PROMPT_LEN,)).tolist()]
    out = []
    for f in ("unfolded", "folded"):
        torch.manual_seed(1)  # allocate() poisons the caches from the global generator
        out.append(greedy(nets[f], prompts, 4))
    (t0, l0), (t1, l1) = out
    assert torch.equal(t0, t1)
    assert close(l1, l0, rel=1e-5)
