#!/usr/bin/env bash
# One device call for the FP8 KV cache (issue 15): its GPU tests, decode attention kernel time
# with a bf16 vs an fp8 cache (Qwen3-0.6B heads), and BENCHMARKS.md P3 with each cache dtype.
# Run from the repository root on the GPU machine:  bash benchmarks/kv_fp8_gpu.sh  (~8 min)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PAGEDSERVE_TEST_MODELS=$PWD/.gpu_assets/models
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
step() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 14 "$OUT/$name.log"; echo "=== $name rc=$rc $((SECONDS - t0))s"
}
step fp8_gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -k "fp8" tests/gpu tests/attention
for kv in auto fp8; do
  step "kernels_$kv" 120 python3 benchmarks/attention_kernels.py --model qwen3-0.6b --quick \
    --kv-cache-dtype "$kv"
done
for kv in auto fp8; do
  step "p3_qwen3_kv_$kv" 200 python3 benchmarks/throughput.py --preset qwen3-0.6b --dtype bfloat16 \
    --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --max-model-len 2048 \
    --max-num-seqs 256 --kv-cache-dtype "$kv"
done
