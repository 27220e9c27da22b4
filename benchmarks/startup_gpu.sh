#!/usr/bin/env bash
# Issue 20's start-up figure: a server of PRESET (dummy weights) from launch to ready, with the
# engine's phase breakdown (logs in $OUT).   bash benchmarks/startup_gpu.sh [PRESET] [TOKENIZER]
set -u
PRESET=${1:-llama-3.1-8b} TOKENIZER=${2:-.gpu_assets/tokenizers/llama3}
MAX_LEN=${3:-4096} DEVICE=${4:-cuda}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=$(mktemp -d)/$PRESET
python3 -c "
from pathlib import Path; from benchmarks.presets import materialize
materialize('$PRESET', Path('$MODEL').parent)"
cp "$TOKENIZER"/* "$MODEL"/
for run in 1 2; do  # the second start finds warm caches (Triton's, the page cache)
  START=$(date +%s%N)
  python3 -m pagedserve.entrypoints.cli serve "$MODEL" --load-format dummy --dtype bfloat16 \
    --max-model-len "$MAX_LEN" --device "$DEVICE" --port 8322 > "$OUT/startup_$run.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 600); do
    curl -sf http://127.0.0.1:8322/health >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { tail -n 3 "$OUT/startup_$run.log"; break; }
    sleep 0.1
  done
  echo "run $run: launch to /health 200 in $(( ($(date +%s%N) - START) / 1000000 )) ms"
  grep -E "engine start-up in|captured CUDA graphs|warmed up|loaded weights in|engine core ready|serving " \
    "$OUT/startup_$run.log" | sed 's/^INFO[^:]*: //'
  kill $SERVER; wait $SERVER 2>/dev/null
done
