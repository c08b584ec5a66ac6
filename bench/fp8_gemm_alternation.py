"""ember.ops.scaled_mm vs torch._scaled_mm, rowwise fp8, M=4096, N=K=8192, timed alternately.

Both kernels slow down as the GPU heats (torch measured 385 us first in a run and 446 us at its end),
so one pair of figures taken minutes apart can show either winning; timing them in turn, several
times, gives the ratio's spread. Usage: python bench/fp8_gemm_alternation.py OUT.json [rounds]
"""
import json
import sys

import torch

import ember
from ember.bench import _timing


def main(path: str, rounds: int = 6) -> None:
    dev = torch.device("cuda")
    M, N, K = 4096, 8192, 8192
    a, sa = ember.ops.quantize_fp8(torch.randn(M, K, device=dev), "row")
    qw, sw = ember.ops.quantize_fp8(torch.randn(N, K, device=dev), "row")
    b, sb = qw.t(), sw.t()

    def timed(f):
        return _timing.graph_time_us([f], calls_per_graph=20, replays=25)

    pairs = []
    for _ in range(rounds):
        ours = timed(lambda: ember.ops.scaled_mm(a, b, sa, sb, check=False))
        theirs = timed(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
        pairs.append((round(ours, 1), round(theirs, 1), round(theirs / ours, 3)))
        print("ember us, torch us, torch/ember:", pairs[-1], flush=True)
    json.dump(pairs, open(path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], *(int(v) for v in sys.argv[2:3]))
