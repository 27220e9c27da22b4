"""Config-only model folders of well-known architectures, for `--load-format dummy` runs.

Each preset writes just config.json (the published architecture's hyperparameters); weights
are random, which does not change timing once `ignore_eos` fixes the output lengths. With a
weight quantization (`--quantization gptq|awq`, see `add_quantization_args`) the config.json
also gets the `quantization_config` a GPTQ / AWQ checkpoint of it would carry, so the dummy
model is built with the quantized linear layers (integer tensors 0, scales random).
"""

import argparse
import json
from pathlib import Path
from typing import Any

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

PRESETS: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": {
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # meta-llama/Llama-2-70b-hf config.json
    "llama-2-70b": {
        **_LLAMA_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float16",
    },
    # Qwen/Qwen3-0.6B config.json
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # openai-community/gpt2-large config.json
    "gpt2-large": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": 1280,
        "n_layer": 36,
        "n_head": 20,
        "n_positions": 1024,
        "n_ctx": 1024,
        "vocab_size": 50257,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "torch_dtype": "float32",
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    },
    # google/gemma-3-4b-it's text_config (transformers' Gemma3TextConfig defaults written
    # out) as a text-only Gemma3ForCausalLM: 5 local layers (window 1024, RoPE base 10k) per
    # global one (RoPE base 1M, linear scaling x8).
    "gemma-3-4b": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
    },
    # microsoft/Phi-3-mini-4k-instruct config.json (sliding_window 2047 on every layer)
    "phi-3-mini-4k": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": 2047,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": 32064,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
    },
    # Qwen3-0.6B's vocabulary (so that the Qwen3 tokenizer fits) on a 2-layer body, for CPU
    # smoke runs of benchmarks that need a real tokenizer (structured_outputs.py).
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 151936,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # A ~4M-parameter Llama for CPU runs.
    "tiny-llama-4m": {
        **_LLAMA_COMMON,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 2048,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
}


# `--quantization` values whose checkpoints carry a quantization_config that a preset can be
# given (the others, e.g. online fp8, are passed to the engine as they are).
CHECKPOINT_QUANTIZATIONS = ("gptq", "awq")


def add_quantization_args(parser: argparse.ArgumentParser) -> None:
    """--quantization and the GPTQ / AWQ parameters of the preset's quantization_config."""
    parser.add_argument(
        "--quantization",
        help="weight quantization (the engine's option); with --preset, gptq / awq also write "
        "the quantization_config into the preset's config.json (dummy quantized weights)",
    )
    parser.add_argument("--quant-bits", type=int, default=4, help="gptq: 4 or 8")
    parser.add_argument("--quant-group-size", type=int, default=128, help="-1, 32, 64, 128")
    parser.add_argument("--quant-desc-act", action="store_true", help="gptq: act-order")
    parser.add_argument("--quant-asym", action="store_true", help="gptq: sym false")


def quantization_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The quantization_config of `add_quantization_args`' flags (defaults: 4-bit, group 128,
    symmetric, no act-order, AutoGPTQ's v1 format; AWQ GEMM with zero points), or None when
    --quantization is not a checkpoint format."""
    method = getattr(args, "quantization", None)
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": args.quant_bits,
            "group_size": args.quant_group_size,
            "desc_act": args.quant_desc_act,
            "sym": not args.quant_asym,
            "checkpoint_format": "gptq",
        }
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": args.quant_bits,
            "group_size": args.quant_group_size,
            "zero_point": True,
            "version": "gemm",
        }
    return None


def materialize(name: str, folder: Path, quantization: dict[str, Any] | None = None) -> Path:
    """Write preset `name`'s config.json (with `quantization` as its quantization_config
    when given) into `folder/name` and return that folder."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    config = dict(PRESETS[name])
    if quantization is not None:
        config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
