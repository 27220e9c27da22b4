"""The BPE word cache is off where whole texts are its words (issue 13 item 16: the API server
grew ~2.8 KB per varied short prompt, without bound, when such tokenizers encoded from its
thread pool; benchmarks/soak_memory.py measures it)."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.llm_engine import drop_whole_text_word_cache, load_tokenizer

_SHARED = Path(__file__).resolve().parents[3] / "shared"


@pytest.mark.parametrize(
    ("path", "whole_text_words"),
    [
        ("models/stories260k", True),  # Metaspace(split=False): a prompt is one word
        ("tokenizers/sentencepiece-32k", True),
        ("models/tinystories-656k", True),  # no pre-tokenizer at all
        ("tokenizers/llama3", False),  # splits into words: the cache pays
        ("tokenizers/gpt2", False),
    ],
)
def test_the_cache_is_dropped_only_for_whole_text_words(path: str, whole_text_words: bool) -> None:
    fresh = AutoTokenizer.from_pretrained(_SHARED / path)
    assert drop_whole_text_word_cache(fresh) is whole_text_words
    # load_tokenizer applies it; the ids are those of the tokenizer with its cache.
    loaded = load_tokenizer(str(_SHARED / path))
    reference = AutoTokenizer.from_pretrained(_SHARED / path)
    for text in ("Once upon a time", "Once upon a time", "  spaces\tand\nlines 你好 🎉", ""):
        assert loaded.encode(text) == reference.encode(text)
