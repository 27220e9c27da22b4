#!/usr/bin/env bash
# Issue 22's figures on one GPU (logs, JSON and PNGs in $OUT): `pagedserve bench throughput
# --plot` (each step's time against its roofline floor, MBU / MFU), then a server with
# `pagedserve bench serve` over a concurrency sweep (--plot: throughput against latency) and
# the server's own MBU / MFU from /metrics.
#   bash benchmarks/observability_gpu.sh [PRESET] [TOKENIZER] [SWEEP] [NUM_PROMPTS] [DEVICE]
# defaults: llama-3.1-8b, .gpu_assets/tokenizers/llama3, 1,4,16,64,128, 128, cuda
set -u
PRESET=${1:-llama-3.1-8b} TOKENIZER=${2:-.gpu_assets/tokenizers/llama3}
SWEEP=${3:-1,4,16,64,128} NUM_PROMPTS=${4:-128} DEVICE=${5:-cuda}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ] && [ "$DEVICE" = cuda ]; then  # what the device image lacks, as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
git log -1 --format='commit %h %s' 2>/dev/null || true
CLI=(python3 -m pagedserve.entrypoints.cli)
MODEL=$(mktemp -d)/$PRESET
python3 -c "
import sys; from pathlib import Path; from benchmarks.presets import materialize
materialize('$PRESET', Path('$MODEL').parent)"
cp "$TOKENIZER"/* "$MODEL"/  # the server needs a tokenizer; the weights are dummy
ENGINE=(--load-format dummy --dtype bfloat16 --max-model-len 512 --device "$DEVICE")

echo "=== bench throughput, 2,000 x 128 / 128, --plot"
timeout 300 "${CLI[@]}" bench throughput --model "$MODEL" "${ENGINE[@]}" --max-num-seqs 512 \
  --num-prompts 2000 --input-len 128 --output-len 128 --plot "$OUT/steps_$PRESET.png" \
  --save-result --result-dir "$OUT" --result-filename "throughput_$PRESET.json" \
  > "$OUT/throughput.log" 2>&1
echo "rc=$?"; grep -E "^(Throughput|Total num|Roofline|plot)" "$OUT/throughput.log"

echo "=== server, bench serve --max-concurrency $SWEEP"
PORT=8321
"${CLI[@]}" serve "$MODEL" "${ENGINE[@]}" --port $PORT --max-num-seqs 256 \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1
done
timeout 420 "${CLI[@]}" bench serve --port $PORT --num-prompts "$NUM_PROMPTS" \
  --random-input-len 128 --random-output-len 128 --ignore-eos --max-concurrency "$SWEEP" \
  --percentile-metrics ttft,tpot,e2el --metric-percentiles 50,99 --plot "$OUT/sweep_$PRESET.png" \
  --save-result --result-dir "$OUT/sweep" > "$OUT/sweep.log" 2>&1
echo "rc=$?"
tar -cf "$OUT/sweep_results.tar" -C "$OUT" sweep && rm -r "$OUT/sweep"  # one file back
grep -E "Maximum request concurrency|Output token throughput|Median (TTFT|TPOT)|plot saved" \
  "$OUT/sweep.log"
curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt"
grep -E "^pagedserve:(mbu|mfu|step_mbu_(sum|count)|step_mfu_(sum|count))\{" "$OUT/metrics.txt"
grep -E "MBU" "$OUT/server.log" | tail -n 3
kill $SERVER; wait $SERVER 2>/dev/null
