"""Redraw bench/results/h200/speedups.png from the committed suite JSONs (measured figures only).

Rows whose baseline is not the like-for-like stock figure are left out of the chart: the batch-8
MoE row (its baseline field is HF at batch 1) and the eager-dispatch row (ember vs ember through
torch.library). Sweep tables and A/B runs (NOT_SUITES) are not charted. Usage: python bench/plot_results.py
"""
import glob
import json
import pathlib

from ember.bench import Row, plot

HERE = pathlib.Path(__file__).parent / "results" / "h200"
NOT_LIKE_FOR_LIKE = {"qwen3_moe_30b_a3b_bf16_b8", "add_rmsnorm_1x2048_eager_dispatch"}
# A/B or partial runs kept for the record (their rows are in the suite files or superseded)
NOT_SUITES = {"sampling_2launch.json", "moe_hybrid.json"}

results = {}
for f in sorted(glob.glob(str(HERE / "*.json"))):
    d = json.load(open(f))
    if "rows" not in d or pathlib.Path(f).name in NOT_SUITES:  # sweeps, A/B runs
        continue
    rows = [Row(r["name"], r["unit"], r["ember"], r["baseline"], r["baseline_name"]) for r in d["rows"]
            if r.get("speedup") and r.get("baseline") and r["name"] not in NOT_LIKE_FOR_LIKE]
    if rows:
        results[d["suite"]] = rows
plot(str(HERE / "speedups.png"), results)
print(f"wrote {HERE / 'speedups.png'}: {sum(len(v) for v in results.values())} rows")
