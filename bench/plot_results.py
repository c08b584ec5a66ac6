"""Redraw the speedup chart from committed suite JSONs (measured figures only).

Rows whose baseline is not the like-for-like stock figure are left out of the chart: the batch-8
MoE row (its baseline field is HF at batch 1) and the eager-dispatch row (ember vs ember through
torch.library). Files without suite rows (sweeps, A/B runs) are not charted.

    python bench/plot_results.py [--results bench/results/h200] [--out bench/results/h200/speedups.png]
"""
import argparse
import glob
import json
import pathlib

HERE = pathlib.Path(__file__).parent / "results" / "h200"
NOT_LIKE_FOR_LIKE = {"qwen3_moe_30b_a3b_bf16_b8", "add_rmsnorm_1x2048_eager_dispatch"}


def collect(results_dir: pathlib.Path) -> dict:
    from ember.bench import Row
    results = {}
    for f in sorted(glob.glob(str(results_dir / "*.json"))):
        d = json.load(open(f))
        if "rows" not in d or "suite" not in d:
            continue
        rows = [Row(r["name"], r["unit"], r["ember"], r["baseline"], r["baseline_name"]) for r in d["rows"]
                if r.get("speedup") and r.get("baseline") and r["name"] not in NOT_LIKE_FOR_LIKE]
        if rows:
            results.setdefault(d["suite"], []).extend(rows)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(HERE), help="folder of suite JSON files")
    ap.add_argument("--out", default=str(HERE / "speedups.png"), help="PNG to write")
    a = ap.parse_args()
    from ember.bench import plot
    results = collect(pathlib.Path(a.results))
    plot(a.out, results)
    print(f"wrote {a.out}: {sum(len(v) for v in results.values())} rows")
