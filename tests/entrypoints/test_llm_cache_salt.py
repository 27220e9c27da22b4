"""The offline API's `cache_salt` prompt field (vLLM's TextPrompt / TokensPrompt field):
requests share prefix-cache blocks only when their salts are equal (or both absent)."""

from collections.abc import Iterator

import pytest

from pagedserve import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
PROMPT_IDS = [1] + [300 + i for i in range(40)]  # 41 tokens: two full blocks of 16


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM(device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    yield llm
    llm.llm_engine.shutdown()


def num_cached(llm: LLM, salt: str | None, prompt_ids: list[int] = PROMPT_IDS) -> int:
    prompt: dict[str, object] = {"prompt_token_ids": prompt_ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    return llm.generate(prompt, PARAMS, use_tqdm=False)[0].num_cached_tokens


def test_only_equal_salts_share_the_prefix_cache(llm: LLM) -> None:
    prompt_ids = [1] + [400 + i for i in range(40)]
    assert num_cached(llm, "alice", prompt_ids) == 0  # nothing cached yet
    assert num_cached(llm, "bob", prompt_ids) == 0  # another salt: no hit
    assert num_cached(llm, None, prompt_ids) == 0  # no salt: no hit on salted blocks
    assert num_cached(llm, "alice", prompt_ids) == 32  # the same salt: both full blocks
    assert num_cached(llm, "bob", prompt_ids) == 32
    assert num_cached(llm, None, prompt_ids) == 32  # no salt shares with no salt, as before


def test_salted_text_prompts_and_outputs(llm: LLM) -> None:
    text = "Once upon a time there was a little girl who liked to play in the park with her dog"
    first, second = llm.generate(
        [{"prompt": text, "cache_salt": "x"}, {"prompt": text, "cache_salt": "y"}],
        PARAMS,
        use_tqdm=False,
    )
    assert second.num_cached_tokens == 0 and first.num_cached_tokens == 0
    assert first.outputs[0].token_ids == second.outputs[0].token_ids  # the salt changes no output
    again = llm.generate({"prompt": text, "cache_salt": "y"}, PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0


@pytest.mark.parametrize("salt", ["", 7, ["a"], "\ud800"])
def test_a_salt_that_is_not_a_non_empty_string_is_refused(llm: LLM, salt: object) -> None:
    prompt = {"prompt_token_ids": PROMPT_IDS, "cache_salt": salt}
    with pytest.raises(ValueError, match="cache_salt") as error:
        llm.generate(prompt, PARAMS, use_tqdm=False)
    assert error.value.param == "cache_salt"  # type: ignore[attr-defined]
    assert not llm.llm_engine.has_unfinished_requests()


def test_reset_prefix_cache_forgets_the_cached_prefixes(llm: LLM) -> None:
    """vLLM's LLM.reset_prefix_cache: a prompt that hit before misses after it, then hits
    again (the blocks of the miss are cached anew)."""
    prompt_ids = [1] + [450 + i for i in range(40)]
    assert num_cached(llm, None, prompt_ids) == 0
    assert num_cached(llm, None, prompt_ids) == 32
    llm.reset_prefix_cache()
    assert num_cached(llm, None, prompt_ids) == 0
    assert num_cached(llm, None, prompt_ids) == 32
