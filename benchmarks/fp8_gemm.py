"""FP8 W8A8 matmuls vs bf16 for one model's linear layers on the GPU.

    PYTHONPATH=. python3 benchmarks/fp8_gemm.py [--preset llama-3.1-8b] [--tokens 1 16 ... 4096]

For each decoder linear layer (merged QKV, output projection, merged gate/up, down
projection) and each token count M, times (CUDA events, median of `triton.testing.do_bench`):
  bf16        F.linear(x, W) in bfloat16 (the unquantized layer)
  fp8_tensor  torch._scaled_mm, per-tensor x and W scales (tensor-wise)
  fp8_row     torch._scaled_mm, per-token x and per-channel W scales (row-wise)
  quant       the dynamic per-tensor activation quantization of x (the fused Triton kernels
              `apply` uses; the JSON lines also give `quant_torch`, the PyTorch chain)
  layer       the whole `Fp8LinearMethod.apply` of online FP8 (quant + tensor-wise GEMM)
and prints a short table (ms; speedup of `layer` over bf16), then one JSON line per row.
The throughput target itself runs through benchmarks/throughput.py with --quantization fp8.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.gemm_rates import layer_shapes  # noqa: E402
from benchmarks.presets import PRESETS  # noqa: E402
from pagedserve.layers.kernels.fp8_quant import quantize_fp8_dynamic  # noqa: E402
from pagedserve.layers.quantization.fp8 import (  # noqa: E402
    Fp8LinearMethod,
    fp8_dynamic_scale,
    quantize_fp8,
)
from pagedserve.quant_config import Fp8Config  # noqa: E402


def time_ms(fn: Any) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def layer_rows(name: str, n: int, k: int, tokens: list[int]) -> list[dict[str, Any]]:
    """Time one linear layer's variants (see the module docstring) at each token count."""
    device, dtype = "cuda", torch.bfloat16
    weight = torch.randn(n, k, dtype=dtype, device=device) * 0.02
    layer = torch.nn.Module()
    method = Fp8LinearMethod(Fp8Config(checkpoint_fp8=False))
    with torch.device(device):
        method.create_weights(layer, k, [n], k, n, dtype, None)
    layer.weight.data.copy_(weight)
    method.process_weights_after_loading(layer)
    assert method.backend == "scaled_mm", method.backend
    w_q, w_tensor = layer.weight, layer.weight_scale
    w_row = (weight.float().abs().amax(dim=1) / 448.0).reshape(1, n).contiguous()
    rows = []
    for m in tokens:
        x = torch.randn(m, k, dtype=dtype, device=device)
        x_tensor = fp8_dynamic_scale(x, per_token=False)
        x_row = fp8_dynamic_scale(x, per_token=True)
        x_q = quantize_fp8(x, x_tensor)
        row: dict[str, Any] = dict(layer=name, m=m, n=n, k=k)
        row["bf16"] = time_ms(lambda x=x: F.linear(x, weight))
        row["fp8_tensor"] = time_ms(
            lambda a=x_q, s=x_tensor: torch._scaled_mm(
                a, w_q.t(), scale_a=s, scale_b=w_tensor, out_dtype=dtype
            )
        )
        row["fp8_row"] = time_ms(
            lambda a=x_q, s=x_row: torch._scaled_mm(
                a, w_q.t(), scale_a=s, scale_b=w_row, out_dtype=dtype
            )
        )
        row["quant"] = time_ms(lambda x=x: quantize_fp8_dynamic(x, False))
        row["quant_torch"] = time_ms(lambda x=x: quantize_fp8(x, fp8_dynamic_scale(x, False)))
        row["layer"] = time_ms(lambda x=x: method.apply(layer, x))
        row = {key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}
        row["speedup"] = round(row["bf16"] / row["layer"], 2)
        print(f"{name:>13} {m:>5} {row['bf16']:>8.4f} {row['fp8_tensor']:>10.4f} "
              f"{row['fp8_row']:>8.4f} {row['quant']:>7.4f} {row['layer']:>7.4f} "
              f"{row['speedup']:>7.2f}", flush=True)  # fmt: skip
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    args = parser.parse_args()
    torch.manual_seed(0)
    header = dict(gpu=torch.cuda.get_device_name(), commit=git_commit(), torch=torch.__version__)
    print(f"{'layer':>13} {'M':>5} {'bf16':>8} {'fp8_tensor':>10} {'fp8_row':>8} "
          f"{'quant':>7} {'layer':>7} {'speedup':>7}")  # fmt: skip
    shapes = layer_shapes(PRESETS[args.preset])
    shapes.pop("lm_head")  # not quantized
    rows = [row for name, (n, k) in shapes.items() for row in layer_rows(name, n, k, args.tokens)]
    for row in rows:
        print(json.dumps(dict(row, **header)))


if __name__ == "__main__":
    main()
