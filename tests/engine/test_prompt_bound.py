"""The token lower bound that refuses megabyte prompts before tokenizing: it must never exceed
the true count (a prompt that fits is never refused), on every tokenizer we ship or test."""

from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.engine.prompt_bound import check_prompt_chars, min_tokens, token_bound
from pagedserve.errors import InvalidRequestError

SHARED = Path(__file__).resolve().parents[3] / "shared"
TOKENIZERS = {
    "stories260k": SHARED / "models" / "stories260k",  # fuse_unk with a full byte fallback
    "tinystories-656k": SHARED / "models" / "tinystories-656k",  # fuse_unk, no byte tokens
    "sentencepiece-32k": SHARED / "tokenizers" / "sentencepiece-32k",
    "gpt2": SHARED / "tokenizers" / "gpt2",
    "llama3": SHARED / "tokenizers" / "llama3",
    "qwen3": SHARED / "tokenizers" / "qwen3",  # NFC normalizer
}
# Known letters, whitespace, the replacement characters, combining marks that compose under
# NFC, and characters outside small vocabularies.
ALPHABET = "ab eo\n\t▁\u0301\u0323\u0302\u0345\u0342\u0314α中🌍<>0x"


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return transformers.AutoTokenizer.from_pretrained(TOKENIZERS[request.param])


def test_every_shipped_tokenizer_has_a_bound(tokenizer: Any) -> None:
    assert token_bound(tokenizer) is not None


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=st.text(alphabet=ALPHABET, max_size=60))
def test_the_bound_never_exceeds_the_true_count(tokenizer: Any, text: str) -> None:
    bound = min_tokens(tokenizer, text, 1)  # enough=1: always the full computation
    assert bound is not None
    assert bound <= len(tokenizer.encode(text, add_special_tokens=False)), text


@pytest.mark.parametrize("name", ["stories260k", "tinystories-656k"])
def test_megabytes_are_refused_without_tokenizing(name: str) -> None:
    """The bundled model's tokenizer had no bound (fuse_unk): "hello " * 3333333 tokenized
    for 18 minutes and peaked at 10 GB."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZERS[name])
    with pytest.raises(InvalidRequestError, match="characters\\) is too long") as error:
        check_prompt_chars(tokenizer, "hello " * 3_333_333, 512)
    assert error.value.param == "prompt"
    if name == "tinystories-656k":  # "中" is unknown there: one token per run
        check_prompt_chars(tokenizer, "中" * 100_000, 512)


def test_offline_llm_refuses_megabytes_in_generate_and_chat() -> None:
    from pagedserve import LLM, SamplingParams

    llm = LLM(device="cpu", kv_cache_memory_bytes=1 << 20)  # stories260k, 512 tokens
    huge = "hello " * 3_333_333
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="characters\\) is too long"):
        llm.generate(huge, params, use_tqdm=False)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="characters\\) is too long") as error:
        llm.chat([{"role": "user", "content": huge}], params, False, chat_template=template)
    assert error.value.param == "messages"  # type: ignore[attr-defined]
    assert llm.generate("Once", params, use_tqdm=False)[0].finished
