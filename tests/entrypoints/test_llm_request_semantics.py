"""The offline API's request semantics (issue 13): the default max_tokens near the context
limit, empty prompts, and `LLM.chat` messages rendered as the server renders them."""

import json
from pathlib import Path

import pytest
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.sampling_params import DEFAULT_MAX_TOKENS, is_default_max_tokens

SHARED = Path(__file__).resolve().parents[3] / "shared"
QWEN3_CONFIG = SHARED / "tokenizers" / "qwen3" / "tokenizer_config.json"
QWEN3_TEMPLATE = json.loads(QWEN3_CONFIG.read_text())["chat_template"]
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
BOS = 1


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20)


def test_the_default_max_tokens_is_16_and_marked() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16 and is_default_max_tokens(params.max_tokens)
    assert "max_tokens=16" in repr(params)
    assert not is_default_max_tokens(SamplingParams(max_tokens=16).max_tokens)
    assert DEFAULT_MAX_TOKENS == 16


def test_left_out_max_tokens_is_capped_to_the_context(llm: LLM) -> None:
    """vLLM caps an unchosen max_tokens to what the context leaves; it was a ValueError."""
    prompt = {"prompt_token_ids": [BOS] + [300] * 119}  # 120 of 128 tokens
    params = SamplingParams(temperature=0, ignore_eos=True)
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 8
    assert output.outputs[0].finish_reason == "length"
    default = llm.generate(prompt, use_tqdm=False)[0]  # sampling_params=None
    assert 1 <= len(default.outputs[0].token_ids) <= 8
    with pytest.raises(ValueError, match=r"\(120 tokens\) \+ max_tokens \(16\)"):
        llm.generate(prompt, SamplingParams(max_tokens=16), use_tqdm=False)
    with pytest.raises(ValueError, match=r"min_tokens \(10\).*8 tokens") as error:
        llm.generate(prompt, SamplingParams(min_tokens=10), use_tqdm=False)
    assert error.value.param == "min_tokens"  # type: ignore[attr-defined]
    # None: up to the context, as before; far from the limit the default stays 16.
    unlimited = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    assert len(llm.generate(prompt, unlimited, use_tqdm=False)[0].outputs[0].token_ids) == 8
    short = llm.generate("Once", SamplingParams(temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(short[0].outputs[0].token_ids) == 16
    assert not llm.llm_engine.has_unfinished_requests()


def test_empty_text_is_the_bos_token(llm: LLM) -> None:
    """The tokenizer adds BOS, so "" is a one-token prompt (as /tokenize and vLLM say)."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = llm.generate(["", {"prompt": ""}], params, use_tqdm=False)
    for output in outputs:
        assert output.prompt == "" and output.prompt_token_ids == [BOS]
        assert len(output.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_empty_text_without_bos_is_refused() -> None:
    """GPT-2's tokenizer adds nothing: "" has no token, and is refused naming the prompt."""
    gpt2 = transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "gpt2")
    processor = InputProcessor(gpt2, max_model_len=128, vocab_size=50257, eos_token_ids=())
    with pytest.raises(ValueError, match="the prompt is empty") as error:
        processor.process("", SamplingParams())
    assert error.value.param == "prompt"  # type: ignore[attr-defined]
    assert processor.process("a", SamplingParams()).prompt_token_ids == [64]


def test_chat_takes_text_parts_as_the_server_does(llm: LLM) -> None:
    """A list of text parts raised jinja's UndefinedError with the Qwen3 template, and a
    plain template received the list's Python repr."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    text = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=2)
    for template in (QWEN3_TEMPLATE, PLAIN_TEMPLATE):
        as_parts = llm.chat(parts, params, chat_template=template, use_tqdm=False)[0]
        as_text = llm.chat(text, params, chat_template=template, use_tqdm=False)[0]
        assert as_parts.prompt == as_text.prompt and "Hi" in (as_parts.prompt or "")
        assert as_parts.prompt_token_ids == as_text.prompt_token_ids
    assert as_parts.prompt == "user: Hi\n"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="content\\[0\\] is an image, but this model is text-only"):
        llm.chat(image, params, chat_template=PLAIN_TEMPLATE, use_tqdm=False)
    shapes = [{"role": "developer", "content": "Be kind"}, {"role": "user", "content": None}]
    shaped = llm.chat(shapes, params, chat_template=PLAIN_TEMPLATE, use_tqdm=False)[0]
    assert shaped.prompt == "system: Be kind\nuser: \n"
    thinking = llm.chat(
        text, params, chat_template=QWEN3_TEMPLATE, use_tqdm=False,
        chat_template_kwargs={"enable_thinking": False},
    )[0]  # fmt: skip
    assert (thinking.prompt or "").endswith("<think>\n\n</think>\n\n")
    assert not llm.llm_engine.has_unfinished_requests()
