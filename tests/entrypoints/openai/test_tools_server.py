"""Tool calling against the real server process (tiny random model, Qwen3 tokenizer and
template, xgrammar): tool_choice "required" and a named function always give calls whose
arguments validate against the function's parameters, whole and streamed alike (the
streamed deltas join to the whole answer), and the reasoning parser's split streams as it
answers whole. One server for the module."""

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from .conftest import Server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The constraint starts once the thinking has ended: without thinking, at once.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tool_server(server_factory: Any) -> Iterator[Server]:
    # --disable-any-whitespace: a random model may otherwise emit whitespace until max_tokens.
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--reasoning-parser", "qwen3", "--disable-any-whitespace"]  # fmt: skip
    running: Server = server_factory("qwen3", None, flags)
    try:
        yield running
    finally:
        running.stop()


def joined(chunks: Any) -> dict[str, Any]:
    """The message a stream's chunks join to (by tool call index)."""
    message: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            message["reasoning"] += getattr(delta, "reasoning", None) or ""
            message["content"] += delta.content or ""
            for piece in delta.tool_calls or []:
                call = message["calls"].setdefault(piece.index, {"name": None, "arguments": ""})
                if piece.function.name:
                    assert call["name"] is None and piece.id and piece.type == "function"
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
            message["finish"] = choice.finish_reason or message["finish"]
    return message


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_choice_always_calls(tool_server: Server) -> None:
    client = tool_server.client()
    for seed in range(3):
        response = client.chat.completions.create(
            model=tool_server.model, messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="required", temperature=1.0, seed=seed, max_tokens=300,
            extra_body=NO_THINKING,
        )  # fmt: skip
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_streamed_calls_join_to_the_whole_answer(tool_server: Server, tool_choice: Any) -> None:
    client = tool_server.client()
    kwargs = dict(
        model=tool_server.model, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        temperature=0.0, max_tokens=300, extra_body=NO_THINKING,
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    assert whole.message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    check_calls(calls)
    streamed = joined(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == calls
    # OpenAI's finish_reason: "tool_calls" for "required", "stop" for a named function.
    expected = "tool_calls" if tool_choice == "required" else "stop"
    assert whole.finish_reason == streamed["finish"] == expected
    if tool_choice != "required":
        assert calls[0][0] == "get_time"


def test_reasoning_streams_as_it_answers_whole(tool_server: Server) -> None:
    """Thinking on (the template's default): the random model's output is thinking until a
    </think>; whole and streamed answers split it alike. The tools are in the prompt."""
    client = tool_server.client()
    kwargs = dict(model=tool_server.model, messages=MESSAGES, temperature=0.0, max_tokens=12)
    whole = client.chat.completions.create(**kwargs).choices[0].message  # type: ignore[call-overload]
    streamed = joined(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    reasoning = getattr(whole, "reasoning", None)
    assert reasoning  # the output starts in the thinking
    assert (streamed["reasoning"], streamed["content"]) == (reasoning, whole.content or "")
    tokens = tool_server.tokenize(messages=MESSAGES, tools=TOOLS)
    assert '"name": "get_weather"' in tool_server.detokenize(tokens)
