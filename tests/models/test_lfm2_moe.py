"""Model oracle for LFM2-MoE: tiny random transformers models (fp32) saved with save_pretrained, built
by ember.models.lfm2_moe, compared with transformers' forward and greedy generate (which runs
transformers' own conv-state / KV cache). The helpers here drive ember's net.prefill / net.decode
the way the engine does and are shared with test_qwen3_5_moe.py."""
import json

import pytest
import torch
from safetensors.torch import load_file

import ember
from ember.models import _common, lfm2_moe

PROMPT_LEN, NEW = 9, 32
VOCAB = 96


# ----------------------------------------------------------------------------- shared helpers
def randomize(model, scale: float = 0.2, one: tuple[str, ...] = ()):
    """Norm weights and expert biases away from their init so a swapped or ignored one shows.
    Norms start at 1 + noise unless their weight is an offset from 1 (``one`` lists the exceptions)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                base = 0.0 if not any(s in name for s in one) else 1.0
                p.copy_(base + scale * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def build_net(path, module, *, dtype=torch.float32, device="cpu", fp8=False, max_seq_len=64, cfg_edit=None,
              tensors_edit=None):
    """ember's net from a saved checkpoint, as ember.load builds it, checking every tensor is used."""
    cfg = json.loads((path / "config.json").read_text())
    if cfg_edit:
        cfg_edit(cfg)
    tensors = load_file(str(path / "model.safetensors"))
    if tensors_edit:
        tensors_edit(tensors)
    src = _common.TensorSource(set(tensors), tensors.__getitem__, torch.device(device), dtype)
    with torch.no_grad():
        net = module.build(src, cfg, fp8=fp8, max_seq_len=max_seq_len)
    assert src.names == src.used, f"unused checkpoint tensors: {sorted(src.names - src.used)}"
    return net


def allocate(net, batch, max_seq_len, poison=True):
    """Caches from net.cache_specs, filled with garbage: prefill must not read what was there."""
    caches = []
    for layer in net.cache_specs(batch, max_seq_len, net.embed.dtype):
        caches.append(tuple((torch.randn(s, dtype=d, device=net.embed.device) * 100 if poison else
                             torch.zeros(s, dtype=d, device=net.embed.device)) for s, d in layer))
    return caches


def row(caches, b):
    return [tuple(t[b:b + 1] for t in layer) for layer in caches]


def greedy(net, prompts, new, max_seq_len=64):
    """Prefill each prompt into its own cache row, then decode all rows together: (tokens [B, new],
    logits [B, new, V]) where logits[:, i] produced tokens[:, i]."""
    B, dev = len(prompts), net.embed.device
    caches = allocate(net, B, max_seq_len)
    with torch.no_grad():
        first = torch.cat([net.prefill(torch.tensor([p], device=dev), row(caches, b), last_only=True)
                           for b, p in enumerate(prompts)])                         # [B, V]
        logits, toks = [first], [first.argmax(-1)]
        pos = torch.tensor([len(p) for p in prompts], device=dev)
        for _ in range(new - 1):
            out = net.decode(toks[-1], pos, (pos + 1).to(torch.int32), caches)
            logits.append(out)
            toks.append(out.argmax(-1))
            pos = pos + 1
    return torch.stack(toks, 1), torch.stack(logits, 1)


def hf_greedy(model, ids, n):
    """transformers' greedy continuation. The explicit all-ones mask matters: without it generate
    treats token id pad_token_id in the prompt as padding and masks it out of the conv states."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def close(got, ref, rel=1e-4):
    scale = ref.abs().max().item()
    return (got - ref).abs().max().item() <= rel * scale


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_forward_matches_hf(hf, net, vocab):
    """The cache-free forward of two 13-token rows equals transformers' (fp32 logits)."""
    ids = torch.randint(0, vocab, (2, 13))
    ref = hf_logits(hf, ids)
    with torch.no_grad():
        got = net.prefill(ids)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert close(got, ref)


def assert_greedy_matches_hf(hf, net, vocab, new=NEW):
    """Greedy decode through the caches: transformers' generate tokens, and every step's logits against
    transformers' full forward over the generated sequence."""
    prompt = torch.randint(0, vocab, (1, PROMPT_LEN), device=next(hf.parameters()).device)
    ref = hf_greedy(hf, prompt, new)
    toks, logits = greedy(net, [prompt[0].tolist()], new)
    assert toks.tolist() == ref.tolist()
    assert close(logits, hf_logits(hf, torch.cat([prompt, ref], 1))[:, PROMPT_LEN - 1:-1])


def assert_two_lengths_match_hf(hf, net, vocab):
    """Two prompts of different lengths decoded together give each one's own transformers tokens."""
    a, b = torch.randint(0, vocab, (1, 5)), torch.randint(0, vocab, (1, 12))
    toks, _ = greedy(net, [a[0].tolist(), b[0].tolist()], 10)
    assert toks.tolist() == [hf_greedy(hf, a, 10)[0].tolist(), hf_greedy(hf, b, 10)[0].tolist()]


def fake_quantized(model):
    """A copy of a transformers model whose weights ember quantises with --fp8 (every projection and
    expert, per output row) are replaced by dequant(quant(w)); routers, shared-expert gate, convs,
    norms, embedding and lm_head stay as they are, as ember keeps them. ember's FP8 net must match it."""
    import copy

    from ember.ops import fp8 as fp8_ops
    model = copy.deepcopy(model)
    keep = ("embed_tokens", "lm_head", "mlp.gate.weight", "feed_forward.gate.weight", "shared_expert_gate",
            "in_proj_b", "in_proj_a",  # Qwen3.5's beta/decay rows stay in the model dtype
            "conv.weight", "conv1d.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not any(k in name for k in keep) and not name.startswith("model.visual"):
                q, s = fp8_ops.quantize_fp8(p.data, "row")
                p.copy_(q.float() * s)
    return model


# ----------------------------------------------------------------------------- LFM2 models
def lfm2_config(**kw):
    import transformers
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                layer_types=["conv", "full_attention", "conv", "full_attention"], routed_scaling_factor=2.5,
                max_position_embeddings=256, initializer_range=0.1,
                eos_token_id=None)  # min_new_tokens would otherwise forbid the EOS id in transformers only
    base.update(kw)
    return transformers.Lfm2MoeConfig(**base)


def build_hf(config, seed=0):
    import transformers
    torch.manual_seed(seed)
    return randomize(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())


VARIANTS = {
    # expert bias steering selection, scaled routing weights, tied embeddings
    "bias_scaled": dict(),
    # no expert bias, no top-k normalisation, conv bias, separate lm_head, two dense layers, K=4 taps
    "plain": dict(use_expert_bias=False, norm_topk_prob=False, conv_bias=True, tie_word_embeddings=False,
                  num_dense_layers=2, conv_L_cache=4, routed_scaling_factor=1.0),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf = build_hf(lfm2_config(**VARIANTS[request.param]))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, build_net(path, lfm2_moe), path


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
    hf, _, path = pair
    net = build_net(path, lfm2_moe, fp8=True)
    ids = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        ref = fake_quantized(hf)(ids).logits
        got = net.prefill(ids)
    assert close(got, ref)


def test_cache_specs_layout(pair):
    hf, net, _ = pair
    cfg = hf.config
    specs = net.cache_specs(3, 40, torch.bfloat16)
    assert len(specs) == cfg.num_hidden_layers
    hd = cfg.hidden_size // cfg.num_attention_heads
    for kind, spec in zip(cfg.layer_types, specs):
        if kind == "conv":
            assert spec == (((3, cfg.hidden_size, cfg.conv_L_cache - 1), torch.bfloat16),)
        else:
            assert spec == (((3, cfg.num_key_value_heads, 40, hd), torch.bfloat16),) * 2
    with pytest.raises(ValueError, match="max_seq_len"):
        net.cache_specs(1, 65, torch.float32)


def test_routing_semantics_match_transformers(pair):
    """The router alone: the same experts and weights as transformers' Lfm2MoeTopKRouter."""
    hf, net, _ = pair
    i = hf.config.num_dense_layers
    block = hf.model.layers[i].feed_forward
    x = torch.randn(7, hf.config.hidden_size)
    with torch.no_grad():
        _, ref_w, ref_ids = block.gate(x, block.expert_bias if block.use_expert_bias else None)
        w, ids = net.layers[i].mlp.route(x)
    order_ref, order = ref_ids.sort(-1), ids.long().sort(-1)
    assert torch.equal(order_ref.values, order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, order_ref.indices), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- bad input
def test_layer_types_length_mismatch(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match="layer_types has 3 entries but num_hidden_layers is 4"):
        build_net(path, lfm2_moe, cfg_edit=lambda c: c.update(layer_types=c["layer_types"][:3]))


def test_unknown_layer_type(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match="layer_types entries must be in"):
        build_net(path, lfm2_moe, cfg_edit=lambda c: c["layer_types"].__setitem__(0, "mamba"))


def test_conv_kernel_size_mismatch(pair):
    hf, _, path = pair
    K = hf.config.conv_L_cache
    with pytest.raises(ValueError, match=rf"conv_L_cache={K + 1} does not match checkpoint tensor "
                                         r"model\.layers\.0\.conv\.conv\.weight"):
        build_net(path, lfm2_moe, cfg_edit=lambda c: c.update(conv_L_cache=K + 1))


def test_layer_type_swapped_against_weights(pair):
    """A config that calls an attention layer 'conv' finds no conv weights: the missing tensor is named."""
    _, _, path = pair
    with pytest.raises(ValueError, match=r"missing tensor\(s\).*model\.layers\.1\.conv\.conv\.weight"):
        build_net(path, lfm2_moe, cfg_edit=lambda c: c["layer_types"].__setitem__(1, "conv"))


def test_expert_shape_mismatch_names_tensor(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight|experts\.0\.gate_proj\.weight"):
        build_net(path, lfm2_moe, cfg_edit=lambda c: c.update(moe_intermediate_size=c["moe_intermediate_size"] + 1))


def test_missing_num_experts_per_tok_range(pair):
    _, _, path = pair
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        build_net(path, lfm2_moe, cfg_edit=lambda c: c.update(num_experts_per_tok=c["num_experts"] + 1))


def test_triton_kernels_via_interpreter(interpreter, tmp_path):
    """The GPU code path (conv, attention, MoE kernels) through Triton's interpreter on CPU."""
    hf = build_hf(lfm2_config())
    hf.save_pretrained(tmp_path)
    assert_greedy_matches_hf(hf, build_net(tmp_path, lfm2_moe), VOCAB, new=8)


def torch_composed_conv(conv, h, state):
    """Oracle for ``ShortConv``: ``out_proj(c * conv(b * x))`` as three ops (the gates outside the conv)."""
    b, c, x = conv.in_proj(h).chunk(3, dim=-1)
    y = ember.ops.causal_conv1d((b * x).transpose(1, 2), conv.conv_weight, conv.conv_bias, conv_state=state)
    return conv.out_proj(c * y.transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 9])
def test_gated_conv_equals_three_ops_interpreter(interpreter, tmp_path, dtype, T):
    """The gated conv in one launch (gates inside the conv kernel) vs the three ops, through the kernels:
    the same outputs and conv state bit for bit (same roundings, same sums), prefill and decode."""
    build_hf(lfm2_config(conv_bias=True)).save_pretrained(tmp_path)
    conv = build_net(tmp_path, lfm2_moe, dtype=dtype).layers[0].attn
    assert isinstance(conv, lfm2_moe.ShortConv)
    B = 2
    h = torch.randn(B, T, 64).to(dtype)
    (spec, dt), = conv.cache_spec(B, 16, dtype)
    states = [torch.randn(spec).to(dt), None]
    states[1] = states[0].clone()
    with torch.no_grad():
        if T == 1:
            got = conv.decode(h[:, 0], None, None, None, None, (states[0],))[:, None]
        else:
            got = conv.prefill(h, None, None, (states[0],))
            states[1].zero_()
        want = torch_composed_conv(conv, h, states[1])
    assert torch.equal(got, want)
    assert torch.equal(states[0], states[1])


# ----------------------------------------------------------------------------- GPU
def graph_decode_matches_eager(net, prompt, steps):
    """Decode ``steps`` tokens eagerly and through one captured CUDA graph replayed per token, from the
    same post-prefill state; returns (eager tokens, graph tokens, eager logits, graph logits)."""
    dev = net.embed.device
    caches = allocate(net, 1, 64)
    with torch.no_grad():
        first = net.prefill(torch.tensor([prompt], device=dev), caches, last_only=True).argmax(-1)
    snapshot = [tuple(t.clone() for t in layer) for layer in caches]
    tok = first.clone()
    pos = torch.tensor([len(prompt)], device=dev)
    eager_toks, eager_logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            out = net.decode(tok, pos, (pos + 1).to(torch.int32), caches)
            tok, pos = out.argmax(-1), pos + 1
            eager_toks.append(tok.item())
            eager_logits.append(out.clone())
    for layer, snap in zip(caches, snapshot):
        for t, s in zip(layer, snap):
            t.copy_(s)
    s_tok, s_pos = first.clone(), torch.tensor([len(prompt)], device=dev)
    s_len = (s_pos + 1).to(torch.int32)
    s_logits = torch.empty_like(eager_logits[0])

    def step():
        out = net.decode(s_tok, s_pos, s_len, caches)
        s_logits.copy_(out)
        s_tok.copy_(out.argmax(-1))
        s_pos.add_(1)
        s_len.add_(1)

    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        saved = [t.clone() for layer in caches for t in layer]
        with torch.cuda.stream(stream):
            step()  # warm-up: Triton compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip([t for layer in caches for t in layer], saved):
            t.copy_(s)
        s_tok.copy_(first), s_pos.fill_(len(prompt)), s_len.fill_(len(prompt) + 1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for t, s in zip([t for layer in caches for t in layer], saved):  # capture ran nothing, but be exact
            t.copy_(s)
        s_tok.copy_(first), s_pos.fill_(len(prompt)), s_len.fill_(len(prompt) + 1)
        graph_toks, graph_logits = [], []
        for _ in range(steps):
            graph.replay()
            graph_toks.append(s_tok.item())
            graph_logits.append(s_logits.clone())
    return eager_toks, graph_toks, torch.cat(eager_logits), torch.cat(graph_logits)


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(cuda, tmp_path):
    hf = build_hf(lfm2_config())
    hf.save_pretrained(tmp_path)
    net = build_net(tmp_path, lfm2_moe, dtype=torch.bfloat16, device=cuda)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,)).tolist()
    e_toks, g_toks, e_logits, g_logits = graph_decode_matches_eager(net, prompt, NEW)
    assert g_toks == e_toks
    assert torch.equal(g_logits, e_logits)


@pytest.mark.gpu
def test_gpu_kernels_match_transformers_fp32(cuda, tmp_path):
    """The Triton paths (conv, attention, MoE) in fp32 on the GPU: transformers' greedy tokens."""
    hf = build_hf(lfm2_config())
    hf.save_pretrained(tmp_path)
    net = build_net(tmp_path, lfm2_moe, device=cuda)
    # fp32 kernels use IEEE dots; transformers runs without TF32
    assert_greedy_matches_hf(hf.to(cuda), net, VOCAB)
