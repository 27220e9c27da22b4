#!/usr/bin/env bash
# Issue 19's CPU weight offload on one GPU: `pagedserve bench throughput` on a dummy-weight
# preset with and without `--cpu-offload-gb` (and eager without offload: offload turns CUDA
# graphs off, so that row separates the two costs).
#   bash benchmarks/offload_gpu.sh [PRESET] [TOKENIZER] [GIB] [NUM_PROMPTS]
# defaults: llama-3.1-8b, .gpu_assets/tokenizers/llama3, 8, 256 (128 in / 128 out)
set -u
PRESET=${1:-llama-3.1-8b} TOKENIZER=${2:-.gpu_assets/tokenizers/llama3} GIB=${3:-8}
NUM_PROMPTS=${4:-256}
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
MODEL=$(mktemp -d)/$PRESET
python3 -c "
from pathlib import Path; from benchmarks.presets import materialize
materialize('$PRESET', Path('$MODEL').parent)"
cp "$TOKENIZER"/* "$MODEL"/
RUN=(python3 -m pagedserve.entrypoints.cli bench throughput --model "$MODEL" --load-format dummy
     --dtype bfloat16 --max-model-len 512 --num-prompts "$NUM_PROMPTS" --input-len 128
     --output-len 128)
for extra in "" "--enforce-eager" "--cpu-offload-gb $GIB"; do
  echo "=== bench throughput $extra"
  # shellcheck disable=SC2086
  timeout 300 "${RUN[@]}" $extra 2>&1 | grep -E "^(Throughput|Total num|Roofline)|cpu offload|loaded weights|Error"
done
