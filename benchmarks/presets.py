"""Config-only model folders of well-known architectures, for `--load-format dummy` runs.

Each preset writes just config.json (the published architecture's hyperparameters); weights
are random, which does not change timing once `ignore_eos` fixes the output lengths.
"""

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


def materialize(name: str, folder: Path) -> Path:
    """Write preset `name`'s config.json into `folder/name` and return that folder."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    path = folder / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(PRESETS[name], indent=1))
    return path
