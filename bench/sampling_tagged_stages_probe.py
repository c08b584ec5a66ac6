"""Where the tagged top-k sampler's microseconds go: per-stage timestamps of ``_topk_tagged_row``.

The one-row [1, 128256] t0.7 k50 p0.9 sample takes ~6.5 us (bench/results/h200/sampling.json);
bench/sampling_stages_probe.py stamps only the acq_rel path. This writes a copy of
ember/kernels/sampling.py with timestamps (``%globaltimer`` ns, comparable across SMs, and
``%clock64`` cycles) stored by every program of the tagged path at:

    0 kernel start (after the dependent-launch wait)   5 candidate bound L computed
    1 chunk loaded, entering _topk_tagged_row          6 sender: slots reserved (atomic returned)
    2 piece maxima stored                              7 sender: candidate pairs stored
    3 grid barrier passed                              8 finisher: entered
    4 all piece maxima read (tags current)             9 finisher: token chosen

captures 20 calls in a CUDA graph on distinct rows (as the bench times them), replays it 30 times
and reports, per stage, the spread over programs (ns since the earliest start) of the last call,
plus the finisher's own cycle count per stage. The text patches are checked (an assertion names a
patch that no longer matches the kernel).

    python bench/sampling_tagged_stages_probe.py [out.json]
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from ember.bench import _timing, module_from_source
from ember.kernels import sampling as ks

V = 128256
STAGES = ("kernel_start", "chunk_loaded", "maxima_stored", "barrier_passed", "maxima_read", "bound",
          "reserved", "pairs_stored", "finisher_start", "token_chosen")
N_STAGES = len(STAGES)

_STAMP_FN = f'''

@triton.jit
def _stamp(ptr, i, c):
    g = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [c], dtype=tl.int64, is_pure=False, pack=1)
    k = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [c], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(ptr + c * {2 * N_STAGES} + i * 2, g)
    tl.store(ptr + c * {2 * N_STAGES} + i * 2 + 1, k)
'''

# (old, new) text patches; "c + (x > huge)" keeps a stamp after the value it follows (0 in practice)
PATCHES = [
    # the stamp buffer: a last argument of the row function and of the kernel, passed by the launch
    ("                     PACKED_RACE: tl.constexpr = False):\n    \"\"\"Program c's part of row ``row``",
     "                     PACKED_RACE: tl.constexpr = False, stamp_ptr=None):\n    \"\"\"Program c's part of row ``row``"),
    ("                              PACKED_RACE: tl.constexpr = False):\n    \"\"\"``_chunk_stats_kernel``",
     "                              PACKED_RACE: tl.constexpr = False, stamp_ptr=None):\n    \"\"\"``_chunk_stats_kernel``"),
    ("                         CAP, KC, FALLBACK_BLOCK, SMALL_SORT, LD_POLL, OFF_BY_FINISHER, PACKED_RACE)\n",
     "                         CAP, KC, FALLBACK_BLOCK, SMALL_SORT, LD_POLL, OFF_BY_FINISHER, PACKED_RACE,\n"
     "                         stamp_ptr=stamp_ptr)\n"),
    ("        LD_POLL=dev.type == \"cuda\", FREE=free, TAGGED=tagged, slots=grid_slots,\n",
     "        LD_POLL=dev.type == \"cuda\", FREE=free, TAGGED=tagged, slots=grid_slots, stamp_ptr=STAMPS,\n"),
    # the stamps
    ("    if TAGGED:\n        row = g.to(tl.int64)\n",
     "    if TAGGED:\n        _stamp(stamp_ptr, 0, c)\n        row = g.to(tl.int64)\n"),
    ("    rs = slots + row * GRID_SLOT_WORDS\n    if SUB == 1:\n",
     "    _stamp(stamp_ptr, 1, c + (tl.max(z, axis=0) > 3e38).to(tl.int32))\n"
     "    rs = slots + row * GRID_SLOT_WORDS\n    if SUB == 1:\n"),
    ("    first_prog = (row == 0) & (c == 0)\n    add = _arrival(first_prog, n_programs)\n",
     "    _stamp(stamp_ptr, 2, c + (m > 3e38).to(tl.int32))\n"
     "    first_prog = (row == 0) & (c == 0)\n    add = _arrival(first_prog, n_programs)\n"),
    ("    gave_up = _barrier_wait(bar_ptr, v, add, spin_cap, LD_POLL)\n    if OFFSET_TENSOR and not OFF_BY_FINISHER:\n",
     "    gave_up = _barrier_wait(bar_ptr, v, add, spin_cap, LD_POLL)\n"
     "    _stamp(stamp_ptr, 3, c + gave_up.to(tl.int32) * 0)\n"
     "    if OFFSET_TENSOR and not OFF_BY_FINISHER:\n"),
    ("        tl.atomic_add(bar_ptr + 1, 1)\n    M = tl.max(piece_max, axis=0)\n"
     "    L = _candidate_bound(piece_max, k, p, P * SUB, V, QB, CAP, KC)\n",
     "        tl.atomic_add(bar_ptr + 1, 1)\n    M = tl.max(piece_max, axis=0)\n"
     "    _stamp(stamp_ptr, 4, c + (M > 3e38).to(tl.int32))\n"
     "    L = _candidate_bound(piece_max, k, p, P * SUB, V, QB, CAP, KC)\n"
     "    _stamp(stamp_ptr, 5, c + (L > 3e38).to(tl.int32))\n"),
    ("        base = (old & 0xFFFFFFFF).to(tl.int32)\n",
     "        base = (old & 0xFFFFFFFF).to(tl.int32)\n        _stamp(stamp_ptr, 6, c + (base > 1 << 30).to(tl.int32))\n"),
    ("        tl.store(cand + 2 * slot + 1, (tag << 32) | cols.to(tl.int64), mask=ok)\n",
     "        tl.store(cand + 2 * slot + 1, (tag << 32) | cols.to(tl.int64), mask=ok)\n"
     "        _stamp(stamp_ptr, 7, c)\n"),
    ("    if finish:\n        exact = (L == float(\"inf\")) | (n > CAP)",
     "    if finish:\n        _stamp(stamp_ptr, 8, c)\n        exact = (L == float(\"inf\")) | (n > CAP)"),
    ("        tl.store(cnt_ptr + row, 0)\n        tl.store(out_ptr + row, tok.to(tl.int64))\n        if OFFSET_TENSOR and OFF_BY_FINISHER:",
     "        _stamp(stamp_ptr, 9, c + (tok > 1 << 30).to(tl.int32))\n"
     "        tl.store(cnt_ptr + row, 0)\n        tl.store(out_ptr + row, tok.to(tl.int64))\n        if OFFSET_TENSOR and OFF_BY_FINISHER:"),
]


def stamped_source(source: str | None = None) -> str:
    """ember/kernels/sampling.py (or ``source``) with the stamps above (every patch must match once)."""
    src = Path(source or ks.__file__).read_text()
    for old, new in PATCHES:
        assert src.count(old) == 1, f"patch no longer matches the kernel: {old[:80]!r}"
        src = src.replace(old, new)
    head, tail = src.split("\n\n@triton.jit\ndef _topk_tagged_row(", 1)
    return head + _STAMP_FN + "\n\nSTAMPS = None\n\n\n@triton.jit\ndef _topk_tagged_row(" + tail


def stages(mod, reps: int = 30, calls: int = 20) -> dict:
    dev = torch.device("cuda")
    xs = [torch.randn(1, V, device=dev) * 3 for _ in range(max(calls, _timing.copies_to_exceed_l2(4 * V)))]
    P = ks._split(V)[1]
    stamps = torch.zeros(P, N_STAGES, 2, dtype=torch.int64, device=dev)
    seed = torch.tensor([7], device=dev)
    off = torch.zeros(1, dtype=torch.int64, device=dev)
    out = torch.empty(1, dtype=torch.int64, device=dev)
    mod.STAMPS = stamps
    run = lambda x: mod.sample_one_launch(x, out, 0.7, 50, 0.9, 0.0, seed, off)  # noqa: E731
    for x in xs[:calls]:
        run(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x in xs[:calls]:
            run(x)
    per_rep = []
    for _ in range(reps):
        stamps.zero_()
        g.replay()
        torch.cuda.synchronize()
        s = stamps.cpu()
        # every program stamps stages 0-5 in every call, so those hold the last call's; a sender's or
        # the finisher's stamps from an earlier call are older than the last call's earliest start
        g0 = int(s[:, 0, 0].min())
        rep = {}
        for i, name in enumerate(STAGES):
            seen = s[:, i, 0][s[:, i, 0] >= g0]
            if seen.numel():
                rep[f"{name}_min_ns"], rep[f"{name}_max_ns"] = int(seen.min()) - g0, int(seen.max()) - g0
                rep[f"{name}_programs"] = int(seen.numel())
        fin = (s[:, 9, 0] >= g0).nonzero().flatten()
        if fin.numel():  # the last call's finisher: its own clock since its kernel start
            f = int(fin[0])
            rep.update({f"finisher_{name}_cycles": int(s[f, i, 1] - s[f, 0, 1]) for i, name in enumerate(STAGES)
                        if s[f, i, 1]})
        per_rep.append(rep)
    keys = sorted({k for r in per_rep for k in r})
    return {k: statistics.median(r[k] for r in per_rep if k in r) for k in keys}


def main(path: str | None = None) -> dict:
    mod = module_from_source("ember_sampling_tagged_stamped", stamped_source())
    res = {"stages": stages(mod), "give_ups": ks.barrier_give_ups(torch.device("cuda")),
           "note": "ns since the earliest program's kernel start (globaltimer; min/max over programs that reached "
                   "the stage) of the last of 20 graph-captured calls, and the finisher's clock64 cycles since its "
                   "own start; median of 30 replays. [1, 128256] fp32, t0.7 k50 p0.9, offset tensor."}
    for k, v in res["stages"].items():
        print(f"{k:>32}: {v}", flush=True)
    if path:
        Path(path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
