#!/usr/bin/env bash
# Issue 23's MoE models on H200s, in parts (each < 10 minutes; logs in $OUT). Needs the fused
# MoE kernel (pagedserve/layers/moe/fused_moe.py dispatching to Triton on CUDA).
#   bash benchmarks/moe_gpu.sh tests      # MoE GPU tests (the two-GPU ones run on 2 GPUs)
#   bash benchmarks/moe_gpu.sh qwen3      # one H200: Qwen3-30B-A3B, 2,000 x 128/128, ours
#   bash benchmarks/moe_gpu.sh qwen3-hf   # one H200: the same, then transformers generate_batch
#   bash benchmarks/moe_gpu.sh mixtral    # two H200s: Mixtral-8x7B TP=2, then EP=2
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # what the image lacks, as wheels (as gpu_suite.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
logged() {  # log name, time limit in s, command...
  echo "=== $1"; local log="$OUT/$1.log" limit=$2; shift 2
  timeout "$limit" "$@" > "$log" 2>&1; echo "=== rc=$? (full log $log)"; tail -n 12 "$log"
}
WORKLOAD=(--dtype bfloat16 --num-prompts 2000 --input-len 128 --output-len 128
  --max-model-len 512 --max-num-seqs 512)
case "${1:-}" in
  tests)
    logged moe_gpu_tests 540 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_moe_gpu.py tests/layers -k moe ;;
  qwen3)
    logged qwen3_30b_a3b 540 python3 benchmarks/throughput.py --preset qwen3-30b-a3b \
      "${WORKLOAD[@]}" ;;
  qwen3-hf)
    logged qwen3_30b_a3b_vs_hf 580 python3 benchmarks/throughput.py --preset qwen3-30b-a3b \
      "${WORKLOAD[@]}" --hf-continuous ;;
  mixtral)
    logged mixtral_tp2 280 python3 benchmarks/throughput.py --preset mixtral-8x7b \
      "${WORKLOAD[@]}" --tensor-parallel-size 2
    logged mixtral_ep2 280 python3 benchmarks/throughput.py --preset mixtral-8x7b \
      "${WORKLOAD[@]}" --tensor-parallel-size 2 --enable-expert-parallel ;;
  *)
    echo "usage: bash benchmarks/moe_gpu.sh tests|qwen3|qwen3-hf|mixtral"; exit 2 ;;
esac
