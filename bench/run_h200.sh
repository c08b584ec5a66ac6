#!/usr/bin/env bash
# Everything the H200 has to run, for one device call per group (each call is limited to 10 minutes):
#   bash bench/run_h200.sh tests                  # every GPU test, in parallel processes (~2 min)
#   bash bench/run_h200.sh norm sampling fp8 linear  # fast suites (~3 min)
#   bash bench/run_h200.sh moe_ops moe            # MoE suites (~5 min; the moe rows judge 5x HF only with
#                                                 #   EMBER_BENCH_HF_COMPILE=1, which adds ~90 s of HF compiling)
#   bash bench/run_h200.sh moe_hybrid             # LFM2 / Qwen3.5 (HF baselines are slow)
#   bash bench/run_h200.sh vae                    # needs the diffusers wheel in .whl/ (README of the device tool)
#   bash bench/run_h200.sh sweeps                 # fp8 GEMV tiles, MoE T=1 v1 vs v2 (pick the defaults from these)
#   bash bench/run_h200.sh prefill_sweep profile_vae profile_llm  # MoE prefill tiles; where VAE / LLM time goes
#   python bench/step_variants.py $OUT/step_variants.json [--names A,B] [--sizes 400] [--batch 8] [--variants F.json]  # decode-step A/B (~4 min)
#   python bench/step_timeline.py $OUT/step_timeline.json [--fp8]  # what each decode-step kernel adds to the chain (~1 min)
#   python bench/l2_prefetch_probe.py $OUT/l2_prefetch.json [cache_len]  # o_proj weight prefetched into L2 (measured: no)
#   python bench/tma_gemv_probe.py $OUT/tma_gemv.json; python bench/fp8_m16_tma_probe.py $OUT/fp8_m16.json  # TMA-fed GEMVs
#   python bench/fp8_gemm_alternation.py $OUT/fp8_gemm_alternation.json  # fp8 GEMM vs torch._scaled_mm, in turn
#   git show HEAD:ember/kernels/sampling.py > before_sampling.py; python bench/nucleus_probe.py $OUT/nucleus_probe.json before_sampling.py  # top-p alone vs an older sampler
#   python bench/pivot_partials_probe.py $OUT/pivot_partials_probe.json  # the nucleus search's per-program sums, by formulation
#   python bench/few_rows_sample_probe.py $OUT/few_rows_sample_probe.json  # 2-16 rows: one launch vs two
#   python bench/many_rows_sample_probe.py $OUT/many_rows_sample_probe.json  # 32-256 rows: waves vs two launches
#   python bench/sampler_ab_probe.py before_sampling.py $OUT/sampler_ab_probe.json  # 1 row: vs an earlier module
#   python bench/sample_warps_probe.py $OUT/sample_warps_probe.json 4,2,8  # 1 row: warps per sampler program
#   python bench/sample_tagged_probe.py $OUT/sample_tagged_probe.json [VARIANTS [MIXES]]  # 1-4 rows top-k: tagged words vs acq_rel, offset variants
#   python bench/sampling_tagged_stages_probe.py $OUT/sampling_tagged_stages.json  # 1 row top-k: per-stage timestamps of the tagged path
#   python bench/softmax_evict_probe.py $OUT/softmax_evict_probe.json  # many-row softmax: cache hints x L2 prefetch depth
# Results land in $OUT (or ./out): <suite>.json, gpu_tests.txt, doctor.txt; copy them to bench/results/h200/.
set -u
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
  if [ "$what" = sweeps ]; then
    timeout 200 python -c "from ember.bench.fp8 import sweep; sweep('$OUT/fp8_sweep.json')" 2>&1 | tail -20
    timeout 200 python -c "from ember.bench.moe_ops import sweep; sweep('$OUT/moe_t1_sweep.json')" 2>&1 | tail -20
  elif [ "$what" = prefill_sweep ]; then
    timeout 200 python -c "from ember.bench.moe_ops import sweep; sweep('$OUT/moe_prefill_sweep.json', parts=('prefill',))" 2>&1 | tail -15
  elif [ "$what" = profile_vae ]; then
    timeout 200 python bench/profile_vae.py 2>&1 | tail -45 | tee "$OUT/profile_vae.txt"
  elif [ "$what" = profile_llm ]; then
    timeout 200 python bench/profile_llm.py 2>&1 | grep -v "^-" | cut -c1-200 | tee "$OUT/profile_llm.txt" | tail -90
  elif [ "$what" = tests ]; then
    timeout 400 python -m pytest -m gpu -n 14 -q --tb=line -p no:cacheprovider tests/ > "$OUT/gpu_tests.txt" 2>&1
    grep -E "^FAILED|passed|failed" "$OUT/gpu_tests.txt" | tail -30
  else
    timeout 560 python -m ember bench "$what" --json "$OUT/$what.json" 2>&1 | tail -25
  fi
done
