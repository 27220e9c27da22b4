"""A tiny random Qwen3 model with the real Qwen3 tokenizer, for structured-output tests.

Its logits are 151936 wide (Qwen3's `vocab_size`), wider than the tokenizer's 151669 tokens,
as in the real model: the grammar's bitmask must cover the padding too.
"""

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedserve import LLM

_REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = _REPO.parent / "shared" / "tokenizers" / "qwen3"
if not TOKENIZER_DIR.is_dir():  # the GPU machine: a copy carried in the tree
    TOKENIZER_DIR = _REPO / ".gpu_assets" / "tokenizers" / "qwen3"
QWEN3_VOCAB_SIZE = 151936


def build_tiny_qwen3(path: Path) -> Path:
    """1 layer, hidden size 32, random weights (seeded), the Qwen3 tokenizer's files."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = transformers.Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3") / "model")


def make_llm(model: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        device="cpu", max_model_len=512, kv_cache_memory_bytes=8 * 2**20, block_size=16
    )
    options.update(kwargs)
    return LLM(str(model), **options)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[LLM]:
    engine = make_llm(tiny_qwen3)
    try:
        yield engine
    finally:
        engine.llm_engine.shutdown()
