"""On CUDA: the engine's cached, CUDA-graph decode agrees with the cache-free forward and with eager decode."""
import pytest
import torch

import ember
from tests.models import tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = tiny.moe_config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                          moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, num_hidden_layers=3,
                          vocab_size=512)
    return tiny.save(tiny.build(cfg), tmp_path_factory.mktemp("gpu_moe"))


@pytest.mark.gpu
def test_graph_greedy_tokens_equal_cache_free_forward(ckpt, cuda):
    em = ember.load(ckpt, device=cuda, dtype=torch.float32, max_seq_len=128)
    prompt = torch.randint(0, 512, (1, 20)).tolist()[0]
    out = em.generate(prompt, max_new_tokens=24)[0]
    assert len(out) == 24
    seq = torch.tensor([prompt + out], device=cuda)
    logits = em(seq)[0, len(prompt) - 1:-1]
    top2 = logits.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # skip near-ties, where fp32 kernel order may flip the argmax
    assert clear.sum() >= 20
    assert torch.equal(logits.argmax(-1)[clear].cpu(), torch.tensor(out)[clear.cpu()])


@pytest.mark.gpu
def test_graph_decode_equals_eager_decode(ckpt, cuda):
    em = ember.load(ckpt, device=cuda, dtype=torch.bfloat16, max_seq_len=128, max_batch_size=2)
    prompts = torch.randint(0, 512, (2, 17)).tolist()
    prompts[1] = prompts[1][:9]
    em.use_cuda_graph = False
    eager = em.generate(prompts, max_new_tokens=32)
    em.use_cuda_graph = True
    graph = em.generate(prompts, max_new_tokens=32)
    assert eager == graph and len(graph[0]) == 32


@pytest.mark.gpu
def test_graph_sampling_equals_eager_sampling(ckpt, cuda):
    em = ember.load(ckpt, device=cuda, dtype=torch.bfloat16, max_seq_len=128, max_batch_size=2)
    prompts = torch.randint(0, 512, (2, 17)).tolist()
    s = ember.SamplingParams(temperature=0.8, top_k=20, seed=7)
    em.use_cuda_graph = False
    eager = em.generate(prompts, max_new_tokens=16, sampling=s)
    em.use_cuda_graph = True
    assert em.generate(prompts, max_new_tokens=16, sampling=s) == eager


@pytest.mark.gpu
def test_bf16_logits_match_transformers(ckpt, cuda):
    import transformers
    # "Within bf16 tolerance" = no further from the fp32 truth than transformers' own bf16 forward
    # (rounding points differ: HF rounds routing weights and sums experts in bf16, ember in fp32).
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(cuda).eval()
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(cuda).eval()
    em = ember.load(ckpt, device=cuda, dtype=torch.bfloat16, max_seq_len=128)
    ids = torch.randint(0, 512, (1, 40), device=cuda)
    with torch.no_grad():
        truth, hf_err = hf32(ids).logits, None
        hf_err = (hf16(ids).logits.float() - truth).norm() / truth.norm()
    em_err = (em(ids).float() - truth).norm() / truth.norm()
    assert em_err <= 1.5 * hf_err, (em_err, hf_err)


@pytest.mark.gpu
def test_memory_flat_over_10000_decode_steps(ckpt, cuda):
    """No allocation grows per token: the peak over 10,000 graph-replayed steps equals the peak of the
    warm-up requests (static caches, captured step, host reads through pinned buffers)."""
    em = ember.load(ckpt, device=cuda, dtype=torch.bfloat16, max_seq_len=10_100)
    em.eos_ids = set()  # decode all 10,000 steps whatever the random model emits
    prompt = torch.randint(0, 512, (16,)).tolist()
    for _ in range(2):  # captures the decode graph
        em.generate(prompt, max_new_tokens=64, stop=[])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(cuda)
    start = torch.cuda.memory_allocated(cuda)
    n = sum(1 for _ in em.stream(prompt, max_new_tokens=10_000, stop=[]))
    torch.cuda.synchronize()
    assert n == 10_000  # a token-id prompt streams one id per step
    grown = torch.cuda.max_memory_allocated(cuda) - start
    assert grown <= 16 * 2**20, f"peak grew by {grown / 2**20:.1f} MiB over 10,000 steps"


@pytest.mark.gpu
def test_chunked_prefill_matches_whole_prefill(ckpt, cuda):
    """The scheduler's prefill (eager chunks, the last padded to a fixed length; later chunks attend
    over the cached prefix) = one whole-prompt eager prefill, logits and cache, in fp32, in any row."""
    from ember.engine.scheduler import Scheduler
    em = ember.load(ckpt, device=cuda, dtype=torch.float32, max_seq_len=200, max_batch_size=2)
    sched = Scheduler(em, prefill_chunk=64)
    for b, T in [(0, 5), (0, 7), (0, 64), (1, 17), (1, 65), (1, 100), (0, 200), (0, 199)]:
        prompt = torch.randint(0, 512, (T,)).tolist()
        chunked = sched.prefill_last(b, prompt)
        k_chunked = [layer[0][b, :, :T].clone() for layer in em.caches]
        row = [tuple(t[b:b + 1] for t in layer) for layer in em.caches]
        whole = em.net.prefill(torch.tensor([prompt], device=cuda), row, last_only=True)
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
        for kc, layer in zip(k_chunked, em.caches):
            torch.testing.assert_close(kc, layer[0][b, :, :T], rtol=1e-4, atol=1e-4)
    out = em.generate([prompt[:30], prompt[:3]], max_new_tokens=4)
    assert [len(o) for o in out] == [4, 4] and em.stats.warmup_s >= 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_programmatic_dependent_launch_changes_nothing(ckpt, cuda, monkeypatch, dtype):
    """The decode graph with the kernels launched under PDL (EMBER_PDL, read at capture; the default
    on sm_90+) produces the same tokens as without it, and as eager decode: each kernel waits for
    its predecessor before touching memory, so the overlap changes only timing."""
    prompts = torch.randint(0, 512, (2, 17)).tolist()
    prompts[1] = prompts[1][:9]
    runs = {}
    for pdl, graph in (("1", True), ("0", True), ("0", False)):
        monkeypatch.setenv("EMBER_PDL", pdl)
        em = ember.load(ckpt, device=cuda, dtype=dtype, max_seq_len=160, max_batch_size=2)
        em.use_cuda_graph = graph
        runs[(pdl, graph)] = em.generate(prompts, max_new_tokens=96)
    assert runs[("1", True)] == runs[("0", True)] == runs[("0", False)]
    assert len(runs[("1", True)][0]) == 96
