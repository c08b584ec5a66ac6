"""Where an eager (uncaptured) prefill spends host time: a Qwen3-30B-A3B-shaped model of a few layers
(random weights), 2048 tokens. Prints the eager and GPU-only times, any synchronising call
(``torch.cuda.set_sync_debug_mode("warn")``), and the ops with the most host time.

    python bench/eager_prefill_probe.py [layers]
"""
import sys
import time
import warnings

import torch

from profile_llm import make_models  # noqa: E402  (same directory)


def main(layers: int = 4) -> None:
    hf, em = make_models(layers)
    ids = torch.randint(100, 500, (1, 2048), device="cuda")
    caches = [(k[:1], v[:1]) for k, v in em.caches]
    run = lambda: em.net.prefill(ids, caches, last_only=True)  # noqa: E731
    with torch.no_grad():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        eager_ms = (time.perf_counter() - t0) / 5 * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
            with torch.cuda.graph(g):
                run()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        start.record()
        for _ in range(5):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        graph_ms = start.elapsed_time(end) / 5
        print(f"{layers} layers, 2048 tokens: eager {eager_ms:.2f} ms, graph {graph_ms:.2f} ms "
              f"(host-bound by ~{eager_ms - graph_ms:.2f} ms, {(eager_ms - graph_ms) / layers:.3f} ms a layer)")
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
        torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message).lower()]
        print(f"synchronising calls in one eager prefill: {len(syncs)}", *syncs[:8], sep="\n  ")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
