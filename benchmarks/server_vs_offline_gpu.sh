#!/usr/bin/env bash
# Issue 20's server-against-offline figures on one GPU (logs in $OUT): PRESET (dummy weights),
# 768 requests of 1,024 random tokens in / 128 out, offline (`bench throughput`) and through the
# server at --max-concurrency 256 (`bench serve`), then a serving sweep at concurrency 1, 16, 64
# on SWEEP_PROMPTS requests with --plot (TPOT against the offline step at that batch).
#   bash benchmarks/server_vs_offline_gpu.sh [PRESET] [TOKENIZER] [SWEEP_PROMPTS]
set -u
PRESET=${1:-llama-3.1-8b} TOKENIZER=${2:-.gpu_assets/tokenizers/llama3} SWEEP_PROMPTS=${3:-64}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
CLI=(python3 -m pagedserve.entrypoints.cli)
MODEL=$(mktemp -d)/$PRESET
python3 -c "
from pathlib import Path; from benchmarks.presets import materialize
materialize('$PRESET', Path('$MODEL').parent)"
cp "$TOKENIZER"/* "$MODEL"/
ENGINE=(--load-format dummy --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256)
echo "=== offline: bench throughput, 768 x 1024 / 128"
timeout 300 "${CLI[@]}" bench throughput --model "$MODEL" "${ENGINE[@]}" --num-prompts 768 \
  --input-len 1024 --output-len 128 > "$OUT/offline.log" 2>&1
echo "rc=$?"; grep -E "^(Throughput|Total num|Roofline)|Elapsed" "$OUT/offline.log"
PORT=8323
"${CLI[@]}" serve "$MODEL" "${ENGINE[@]}" --port $PORT > "$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
SERVE=(bench serve --port $PORT --random-input-len 1024 --random-output-len 128 --ignore-eos
       --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99)
"${CLI[@]}" "${SERVE[@]}" --num-prompts 16 --max-concurrency 16 > /dev/null 2>&1  # warm-up
echo "=== server: bench serve, 768 x 1024 / 128, --max-concurrency 256"
timeout 300 "${CLI[@]}" "${SERVE[@]}" --num-prompts 768 --max-concurrency 256 \
  > "$OUT/serve_256.log" 2>&1
echo "rc=$?"; grep -E "Benchmark duration|Output token throughput|(Median|P99) (TTFT|TPOT|ITL)" \
  "$OUT/serve_256.log"
echo "=== server: sweep 1,16,64 on $SWEEP_PROMPTS requests"
timeout 300 "${CLI[@]}" "${SERVE[@]}" --num-prompts "$SWEEP_PROMPTS" --max-concurrency 1,16,64 \
  --plot "$OUT/sweep_server_$PRESET.png" > "$OUT/sweep.log" 2>&1
echo "rc=$?"; grep -E "Maximum request concurrency|Output token throughput|Median (TTFT|TPOT)" \
  "$OUT/sweep.log"
kill $SERVER; wait $SERVER 2>/dev/null
# The device returns at most 8 files: the logs go back as one tar, the plot on its own.
tar -cf "$OUT/server_vs_offline_logs.tar" -C "$OUT" offline.log server.log serve_256.log sweep.log \
  && rm "$OUT"/offline.log "$OUT"/server.log "$OUT"/serve_256.log "$OUT"/sweep.log
