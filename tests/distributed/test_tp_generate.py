"""``Model.generate`` / ``stream`` and ``ember generate --tp N`` under tensor parallel on CPU (gloo):
every rank runs the scheduler on the same submissions (SPMD) and must take the same steps and draw
the same seeds, so the tokens equal one process's and agree across ranks."""
from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest
import torch

import ember
from ember.engine.scheduler import QueueFull, Request, Scheduler
from tests.distributed import _generate_worker
from tests.distributed.test_tensor_parallel import _spawn
from tests.models import tiny

NEW = 10
PROMPTS = [[5, 9, 17, 3, 40, 2, 11], [7, 30, 12]]  # two lengths: rows join and leave at different steps


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """With the tiny tokenizer (the CLI's text prompt) and so an EOS id (1), which may end a sampled row early."""
    return tiny.save(tiny.build(tiny.moe_config()), tmp_path_factory.mktemp("tp_gen"), tokenizer=True)


@pytest.fixture(scope="module")
def ids_ckpt(tmp_path_factory):
    """No tokenizer, no EOS: every row runs its NEW tokens whatever the (unseeded) draws are."""
    return tiny.save(tiny.build(tiny.moe_config()), tmp_path_factory.mktemp("tp_gen_ids"))


def test_generate_split_two_ways_matches_one_process(ids_ckpt, tmp_path):
    ckpt = ids_ckpt
    torch.save(PROMPTS, tmp_path / "prompts.pt")
    codes = _spawn(_generate_worker.generate_run, 2, str(tmp_path), str(ckpt), NEW)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for r, res in enumerate((r0, r1)):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    assert codes == [0, 0]
    single = ember.load(ckpt, device="cpu", max_seq_len=64, max_batch_size=2)
    greedy = single.generate(PROMPTS, max_new_tokens=NEW)
    seeded = single.generate(PROMPTS, max_new_tokens=NEW, sampling=ember.SamplingParams(temperature=1.0, seed=7))
    for res in (r0, r1):
        assert res["greedy"] == greedy
        assert res["seeded"] == seeded
    # no seed: each rank draws it from its model's seed source, seeded from rank 0 at load
    assert r0["seedless"] == r1["seedless"] and r0["stream"] == r1["stream"]
    assert r0["seedless"][0] != r0["seedless"][1]  # fresh seeds each call, not one fixed seed
    assert all(len(row) == NEW for run in r0["seedless"] for row in run)


def test_models_with_one_sampling_seed_draw_the_same_seedless_tokens(ids_ckpt):
    ckpt = ids_ckpt
    hot = ember.SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        model = ember.load(ckpt, device="cpu", max_seq_len=64, max_batch_size=2)
        model.seed_source = random.Random(1234)  # as ember.load seeds it from rank 0 under tensor parallel
        runs.append(model.generate(PROMPTS, max_new_tokens=NEW, sampling=hot))
    assert runs[0] == runs[1]


def test_submit_many_queues_all_or_none(ckpt):
    model = ember.load(ckpt, device="cpu", max_seq_len=64)
    sched = Scheduler(model, max_queue=1)
    req = Request(prompt=[3, 4], max_tokens=2, sampling=ember.SamplingParams(temperature=0.0))
    with pytest.raises(QueueFull, match="max_queue=1"):
        sched.submit_many([req, req])
    assert sched.metrics()["requests"] == 0 and sched.metrics()["queue_depth"] == 0
    with pytest.raises(ValueError, match="max_tokens"):
        sched.submit_many([req, Request(prompt=[3], max_tokens=0, sampling=req.sampling)])
    assert sched.metrics()["requests"] == 0
    (h,) = sched.submit_many([req])
    assert h.wait(30) and len(h.tokens) == 2
    Scheduler(model)  # the default queue again


def test_a_batch_is_admitted_in_one_loop_iteration_however_slow_its_submission(ckpt):
    """The loop must not start on the first prompt while the second is still being submitted
    (ranks would then run different steps); slow validation widens that window to 0.2 s."""
    model = ember.load(ckpt, device="cpu", max_seq_len=64, max_batch_size=2)
    sched = Scheduler(model)
    calls, validate = [], sched._validate
    sched._validate = lambda r: (time.sleep(0.2), validate(r))[1]
    for name in ("_set_row_sampling", "_prefill_chunk"):
        def spy(row, *a, _name=name, _fn=getattr(model, name)):
            calls.append((_name, row))
            return _fn(row, *a)
        setattr(model, name, spy)
    assert model.generate(PROMPTS, max_new_tokens=3) == ember.load(ckpt, device="cpu", max_seq_len=64,
                                                                    max_batch_size=2).generate(PROMPTS, max_new_tokens=3)
    # both rows admitted (their parameters set) before the first prefill; each row's join sets them
    # again (a no-op unless a decode step refilled the row)
    assert calls[:3] == [("_set_row_sampling", 0), ("_set_row_sampling", 1), ("_prefill_chunk", 0)], calls
    assert [c for c in calls if c[0] == "_prefill_chunk"][:2] == [("_prefill_chunk", 0), ("_prefill_chunk", 1)]


def test_generate_when_a_row_stops_at_its_first_draw(ids_ckpt):
    """A row whose first token is a stop id emits nothing; the batch's figures still come out."""
    model = ember.load(ids_ckpt, device="cpu", max_seq_len=64, max_batch_size=2)
    first = model.generate(PROMPTS[:1], max_new_tokens=1)[0][0]
    out = model.generate(PROMPTS, max_new_tokens=4, stop=[[first], []])
    assert out[0] == [] and len(out[1]) == 4
    assert model.stats.new_tokens == 4 and model.stats.prefill_s > 0
    assert model.generate(PROMPTS[:1], max_new_tokens=4, stop=[first]) == [[]]


def _cli(*args, torchrun: bool = False, input: str | None = None, timeout: float = 120):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] \
        if torchrun else [sys.executable]
    return subprocess.run([*launcher, "-m", "ember", "generate", *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=timeout)


def test_cli_tp_prints_once_and_matches_one_process(ckpt):
    # --standalone: torchrun's rendezvous on localhost at a free port (no --master-port to pick)
    # the ranks' prompt from stdin: rank 0 reads it and hands it on (two readers would split the pipe)
    args = ("--model", ckpt, "--max-new-tokens", NEW, "--device", "cpu", "--temperature", "1.0", "--seed", "11")
    one = _cli(*args, "--prompt", "once upon a time there")
    two = _cli(*args, "--prompt", "-", "--tp", "2", torchrun=True, input="once upon a time there\n")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert one.stdout.strip(), one.stdout  # some text, or the comparison below shows nothing
    assert two.stdout == one.stdout  # rank 0 alone printed it, the same text
    assert two.stderr.count("new tokens:") == 1, two.stderr  # one statistics line


def test_cli_tp_without_torchrun_says_so():
    r = _cli("--model", "unused", "--prompt", "x", "--tp", "2")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert "--tp 2: needs `torchrun --nproc-per-node 2`" in line and "RANK" in line, line


def test_cli_tp_other_than_the_process_count_says_so(ckpt):
    r = _cli("--model", ckpt, "--prompt", "once", "--tp", "3", "--device", "cpu", torchrun=True)
    assert r.returncode != 0
    # each rank exits 2 with the one line; torchrun then reports the failed ranks
    assert r.stderr.count("ember generate: --tp 3: torchrun started 2 process(es); expected 3") == 2, r.stderr
    assert "exitcode  : 2" in r.stderr, r.stderr

