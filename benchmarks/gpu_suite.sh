#!/usr/bin/env bash
# One device call: GPU tests, then the issue-5 targets P2-P5 on one H200. Logs go to $OUT.
# Run from the repository root on the GPU machine:  bash benchmarks/gpu_suite.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PAGEDSERVE_TEST_MODELS=$PWD/.gpu_assets/models
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null || true
step() {  # name, timeout, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name"; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 14 "$OUT/$name.log"; echo "=== $name rc=$rc $((SECONDS - t0))s"
}
if [ -d .whl ]; then  # what the image lacks (msgspec for the engine; the web stack for P1), as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
step gpu_tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -n 4 tests/gpu tests/attention \
  tests/layers
step p2_llama8b 200 python3 benchmarks/throughput.py --preset llama-3.1-8b --dtype bfloat16 \
  --num-prompts 2000 --input-len 128 --output-len 128 --max-model-len 512 --max-num-seqs 512
step p3_qwen3 150 python3 benchmarks/throughput.py --preset qwen3-0.6b --dtype bfloat16 \
  --num-prompts 256 --input-len 100:1024 --output-len 100:1024 --max-model-len 2048 --max-num-seqs 256
step p4_roofline 120 python3 benchmarks/roofline.py --preset llama-3.1-8b --context 1024 --batch-size 1
if [ -d .whl ]; then
  step p1_seed_baseline 200 python3 benchmarks/seed_baseline.py \
    --preset gpt2-large --tokenizer .gpu_assets/tokenizers/gpt2 --device cuda
fi
step p5_generate_batch 240 python3 benchmarks/throughput.py --preset llama-3.1-8b --dtype bfloat16 \
  --num-prompts 256 --input-len 512 --output-len 128 --max-model-len 1024 --hf-continuous
