#!/usr/bin/env bash
# Everything the H200 has to run, for one device call per group (each call is limited to 10 minutes):
#   bash bench/run_h200.sh tests                     # every GPU test, in parallel processes (~2 min; GPU_WORKERS=5 on an 80 GB H100, where 14 run out of memory: ~7 min)
#   bash bench/run_h200.sh norm sampling fp8 linear  # fast suites (~3 min)
#   bash bench/run_h200.sh moe_ops moe               # MoE suites (~5 min)
#   bash bench/run_h200.sh moe_hybrid                # LFM2 / Qwen3.5 (HF baselines are slow)
#   bash bench/run_h200.sh vae                       # needs the diffusers wheel in .whl/ (README of the device tool)
#   bash bench/run_h200.sh audio pad                 # audio needs diffusers too (~4 min: the stock 600 s decodes)
#   bash bench/run_h200.sh train                     # liger-kernel / cut-cross-entropy wheels for the peers
#   bash bench/run_h200.sh serve                     # fastapi / uvicorn wheels; the full-size model (61 GB; fits an 80 GB card)
#   bash bench/run_h200.sh --list                    # what each word runs, without running it
# Suites take ember bench flags through BENCH_FLAGS, e.g. BENCH_FLAGS="--hf-compile --variants" for moe.
#   python bench/step_variants.py $OUT/step_variants.json [--names A,B] [--sizes 400] [--variants F.json]  # decode-step A/B
#   python bench/step_timeline.py $OUT/step_timeline.json [--fp8]  # what each decode-step kernel adds to the chain
# Results land in $OUT (or ./out): <suite>.json, gpu_tests.txt, doctor.txt; copy them to bench/results/h200/.
set -u
if [ "${1:-}" = --list ]; then
  echo "tests: pytest -m gpu over tests/ -> \$OUT/gpu_tests.txt"
  echo "<suite>: ember bench <suite> --json \$OUT/<suite>.json (suites: $(python -c 'from ember.bench import suites; print(" ".join(suites()))'))"
  exit 0
fi
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python -m ember doctor > "$OUT/doctor.txt"
for what in "$@"; do
  if [ "$what" = tests ]; then
    # SIGINT, not TERM, at the limit: pytest still prints which tests failed
    timeout -s INT 540 python -m pytest -m gpu -n "${GPU_WORKERS:-14}" -q -rfE --tb=line -p no:cacheprovider tests/ > "$OUT/gpu_tests.txt" 2>&1
    grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.txt" | tail -30
  else
    # the whole log in $OUT: a suite stopped at its limit still shows how far it got
    timeout 560 python -m ember bench "$what" ${BENCH_FLAGS:-} --json "$OUT/$what.json" 2>&1 | tee "$OUT/$what.log" | tail -25
  fi
done
