"""LLM.chat(messages, tools=[...]) (vLLM's offline `tools`): the tools reach the chat template
as the server passes them (the real Qwen3 template renders them), malformed tools are a
ValueError naming `tools`, and generation runs on the rendered prompt (a tiny random Qwen3)."""

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.chat_utils import render_chat
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.serving_chat import chat_prompt
from tests.conftest import SHARED_TOKENIZERS

QWEN3_TOKENIZER = SHARED_TOKENIZERS / "qwen3"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """A 1-layer Qwen3 (hidden 64, random weights) with the Qwen3 tokenizer and its template."""
    path = tmp_path_factory.mktemp("qwen3_tools")
    tokenizer = transformers.AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
    config = transformers.Qwen3Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_TOKENIZER / name, path / name)
    engine = LLM(
        str(path), dtype="float32", device="cpu", max_model_len=1024, block_size=16,
        kv_cache_memory_bytes=4 << 20,
    )  # fmt: skip
    yield engine
    engine.llm_engine.shutdown()


def test_tools_are_rendered_by_the_template(llm: LLM) -> None:
    """The prompt holds the tool (name, description) in Qwen3's <tools> block, equals
    transformers' apply_chat_template(tools=...) and the server's rendering of the same chat
    request; without tools there is no tool block. Greedy generation equals generate() on the
    same token ids."""
    with_tools = llm.chat(MESSAGES, PARAMS, use_tqdm=False, tools=[WEATHER_TOOL])[0]
    without = llm.chat(MESSAGES, PARAMS, use_tqdm=False)[0]
    assert with_tools.prompt is not None and without.prompt is not None
    assert "get_current_weather" in with_tools.prompt
    assert "The current weather in a city" in with_tools.prompt
    assert "<tools>" in with_tools.prompt
    assert "get_current_weather" not in without.prompt and "<tools>" not in without.prompt

    tokenizer = llm.get_tokenizer()
    expected = tokenizer.apply_chat_template(
        MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    assert with_tools.prompt == expected
    assert with_tools.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER_TOOL]})
    chat = chat_prompt(tokenizer, request, None)
    assert (chat.text, chat.token_ids, chat.images) == (
        with_tools.prompt,
        with_tools.prompt_token_ids,
        [],
    )

    plain = llm.generate({"prompt_token_ids": with_tools.prompt_token_ids}, PARAMS, use_tqdm=False)
    assert len(with_tools.outputs[0].token_ids) == PARAMS.max_tokens
    assert with_tools.outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_tools_in_each_conversation_of_a_batch(llm: LLM) -> None:
    """Several conversations: the tools are rendered into every prompt; an empty list is as
    no tools (as the server's `tools: []`)."""
    other = [{"role": "user", "content": "And in Rome?"}]
    outputs = llm.chat([MESSAGES, other], PARAMS, use_tqdm=False, tools=[WEATHER_TOOL])
    assert len(outputs) == 2
    assert all("get_current_weather" in (o.prompt or "") for o in outputs)
    empty = llm.chat(MESSAGES, PARAMS, use_tqdm=False, tools=[])[0]
    assert empty.prompt == llm.chat(MESSAGES, PARAMS, use_tqdm=False)[0].prompt


@pytest.mark.parametrize(
    ("tools", "words"),
    [
        ([{"type": "function"}], r"tools\[0\]\.function: Field required"),
        ([{"type": "function", "function": {}}], r"tools\[0\]\.function\.name: Field required"),
        ([{"type": "function", "function": {"name": ""}}], r"tools\[0\]\.function\.name"),
        ([WEATHER_TOOL, {"type": "retrieval", "function": {"name": "x"}}], r"tools\[1\]\.type"),
        ([{"function": {"name": "f", "parameters": "not a schema"}}], r"parameters"),
        ([WEATHER_TOOL, "get_current_weather"], r"tools\[1\]"),
        (WEATHER_TOOL, r"tools must be a list of tools, got dict"),
        ("get_current_weather", r"tools must be a list of tools, got str"),
    ],
)
def test_malformed_tools_are_value_errors(llm: LLM, tools: Any, words: str) -> None:
    """A malformed tool list is refused (a ValueError naming `tools`, param "tools"),
    as the server refuses the request, before any request is submitted."""
    with pytest.raises(ValueError, match=words) as info:
        llm.chat([MESSAGES, MESSAGES], PARAMS, use_tqdm=False, tools=tools)
    assert getattr(info.value, "param", None) == "tools"
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=words):
        render_chat(llm.get_tokenizer(), MESSAGES, tools=tools)
    body = {"messages": MESSAGES, "tools": tools}
    with pytest.raises(ValueError, match="tools"):  # pydantic's ValidationError
        ChatCompletionRequest.model_validate(body)


def test_chat_template_kwargs_tools_win(llm: LLM) -> None:
    """chat_template_kwargs["tools"] overrides `tools` (vLLM's order): the template sees the
    kwargs' list."""
    other = {"type": "function", "function": {"name": "lookup_time"}}
    out = llm.chat(
        MESSAGES,
        PARAMS,
        use_tqdm=False,
        tools=[WEATHER_TOOL],
        chat_template_kwargs={"tools": [other]},
    )[0]
    assert out.prompt is not None
    assert "lookup_time" in out.prompt and "get_current_weather" not in out.prompt
