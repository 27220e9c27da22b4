#!/usr/bin/env bash
# Issue 15's W4A16 / W8A16 kernels on one H200, in four parts (each < 10 minutes; logs in $OUT):
#   bash benchmarks/gpu_quant.sh tests    # kernel tests (grid vs the torch reference, e2e greedy),
#                                         # the Triton set and the CUDA W4 set
#   bash benchmarks/gpu_quant.sh gemm     # GEMM micro-benchmark: in-loop vs deq+cuBLAS vs bf16
#   bash benchmarks/gpu_quant.sh w4       # the CUDA W4 kernels per Llama-8B linear at M 1 / 16 /
#                                         # 64: the picks' times, then every launch config
#   bash benchmarks/gpu_quant.sh decode   # Llama-3.1-8B decode step, GPTQ 4-bit g128 vs bf16,
#                                         # batch 1 and 64 at 1,024 context (the issue's targets)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # what the image lacks, as wheels (as gpu_suite.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
logged() {  # log name, time limit in s, command...
  echo "=== $1"; local log="$OUT/$1.log" limit=$2; shift 2
  timeout "$limit" "$@" > "$log" 2>&1; echo "=== rc=$? (full log $log)"; tail -n 40 "$log"
}
roofline() {  # batch size, log name, extra flags...
  local batch=$1 name=$2; shift 2
  logged "$name" 170 python3 benchmarks/roofline.py --preset llama-3.1-8b --context 1024 \
    --batch-size "$batch" "$@"
}
case "${1:-}" in
  tests)
    logged quant_tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 \
      tests/quantization/test_quant_kernels.py
    # one process: the extension builds once (about 100 s), then its tests
    logged w4_cuda_tests 240 python3 -X faulthandler -m pytest -q -m gpu -p no:cacheprovider \
      tests/quantization/test_w4_gemv_cuda.py ;;
  w4)
    logged w4_picks 120 python3 benchmarks/w4_gemv_cuda.py --m 1 --m 16 --m 64 --dtype bfloat16
    logged w4_sweep 400 python3 benchmarks/w4_gemv_cuda.py --sweep --m 1 --m 16 --m 64 \
      --dtype bfloat16 ;;
  gemm)
    logged quant_gemm 540 python3 benchmarks/quant_gemm.py --sweep ;;
  decode)
    roofline 1 decode_bf16_b1
    roofline 1 decode_gptq_b1 --quantization gptq
    roofline 64 decode_bf16_b64
    roofline 64 decode_gptq_b64 --quantization gptq
    python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
def result(name):
    lines = [l for l in (Path(sys.argv[1]) / f"{name}.log").read_text().splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else None
for batch, target in ((1, "<= 0.45x (goal 0.35x)"), (64, "<= 1.0x (goal 0.67x)")):
    bf16, gptq = result(f"decode_bf16_b{batch}"), result(f"decode_gptq_b{batch}")
    if bf16 and gptq:
        for key in ("forward_s", "step_s"):
            print(f"batch {batch} {key}: bf16 {bf16[key]*1e3:.3f} ms, gptq {gptq[key]*1e3:.3f} ms, "
                  f"ratio {gptq[key]/bf16[key]:.3f} (target {target})")
EOF
    ;;
  *) echo "usage: bash benchmarks/gpu_quant.sh tests|gemm|w4|decode" >&2; exit 2 ;;
esac
