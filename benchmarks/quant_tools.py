"""Quantize a model with a format's own tool, for benchmarks/quant_quality.py (which runs this
file with the tool's Python: the tools live in their own venvs, with their own torch and
transformers). Imports nothing from pagedserve.

    python benchmarks/quant_tools.py gptqmodel MODEL CALIB.json OUT_ROOT JOBS.json
    python benchmarks/quant_tools.py autoawq   MODEL CALIB.json OUT_ROOT JOBS.json

CALIB.json: a list of token-id lists (the calibration samples). JOBS.json: a list of
{"label": ..., "params": {...}}; each job writes OUT_ROOT/<label>, a checkpoint as the tool
saves it. params: GPTQModel's QuantizeConfig arguments (bits, group_size, desc_act, sym), or
AutoAWQ's quant_config (w_bit, q_group_size, zero_point, version) and optionally
"quantize_options" (more arguments of its `quantize`, e.g. duo_scaling).

Tool set-ups that worked on the CPU (2026-12): GPTQModel 7.7.0 (pip install gptqmodel; it pulls
torch 2.14.1 and transformers 5.24; needs GPTQMODEL_CPU_WORKERS >= 2 on a 2-core machine, set
here); AutoAWQ 0.2.9 with torch 2.13.0 CPU and transformers 4.51.3 (pip install --no-deps
autoawq, plus accelerate, datasets, zstandard): AutoAWQ is deprecated and does not run with
transformers 5.
"""

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def quantize_gptqmodel(model: Path, calibration: list[list[int]], out: Path, params: Any) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig

    config = QuantizeConfig(**params, offload_to_disk=False)
    quantizer = GPTQModel.load(str(model), config, device="cpu")
    samples = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration]
    quantizer.quantize(samples, batch_size=8)
    quantizer.save(str(out))


def quantize_autoawq(model: Path, calibration: list[list[int]], out: Path, params: Any) -> None:
    import transformers
    from awq import AutoAWQForCausalLM

    # float32: AutoAWQ's float16 path is ~10x slower on the CPU (and gave the same quality:
    # perplexity 28.88 vs 28.75 at g128); real AWQ checkpoints store float16 scales
    quantizer = AutoAWQForCausalLM.from_pretrained(
        str(model), device_map="cpu", torch_dtype=torch.float32
    )
    params = dict(params)
    options = params.pop("quantize_options", {})  # e.g. duo_scaling
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    longest = max(len(ids) for ids in calibration)
    quantizer.quantize(
        tokenizer,
        quant_config=params,
        calib_data=calibration,  # token ids: AutoAWQ concatenates them and cuts blocks
        max_calib_samples=len(calibration),
        max_calib_seq_len=longest,
        **options,
    )
    quantizer.save_quantized(str(out))


def main() -> None:
    tool, model, calib, out_root, jobs = sys.argv[1:6]
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    calibration = json.loads(Path(calib).read_text())
    quantize = {"gptqmodel": quantize_gptqmodel, "autoawq": quantize_autoawq}[tool]
    for job in json.loads(Path(jobs).read_text()):
        out = Path(out_root) / job["label"]
        torch.manual_seed(0)
        quantize(Path(model), calibration, out, job["params"])
        for name in TOKENIZER_FILES:  # the engine's tokenizer (AutoAWQ saves none)
            if (Path(model) / name).exists() and not (out / name).exists():
                shutil.copy(Path(model) / name, out / name)
        print(f"quantized {job['label']} -> {out}", flush=True)


if __name__ == "__main__":
    main()
