"""Tool calling and reasoning in /v1/chat/completions, in process: the FakeEngine writes a
known model output (a random model cannot be made to call a tool), the real server code
parses it; the openai client reads whole and streamed answers. Also the tools in the
prompt (/tokenize), the request checks (400s) and the start-up checks of the flags."""

import json
import subprocess
import sys
from typing import Any

import jsonschema
import pytest

from pagedserve.entrypoints.openai.chat_output import AUTO_NEEDS_FLAGS, required_tools_schema
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS

from .conftest import REPO, shared_tokenizer
from .in_process import InProcessApp, parse_sse

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
QWEN_OUTPUT = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'


def qwen_app(make: Any, output: str, **app_kwargs: Any) -> InProcessApp:
    """An app on the Qwen3 tokenizer whose fake model writes `output`, then EOS."""
    options = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    app: InProcessApp = make(tokenizer="qwen3", **(options | app_kwargs))
    tokenizer = shared_tokenizer("qwen3")
    app.engine.write(tokenizer.encode(output, add_special_tokens=False) + [tokenizer.eos_token_id])
    return app


def joined_stream(events: list[Any]) -> dict[str, Any]:
    """The message that a stream's deltas join to (as the openai client's helpers join
    them), its finish_reason, and the first delta of each tool call."""
    message: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": {}, "first": {}}
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning"] += delta.get("reasoning") or ""
            for piece in delta.get("tool_calls", []):
                if piece["index"] not in message["tool_calls"]:
                    message["first"][piece["index"]] = piece
                    message["tool_calls"][piece["index"]] = {
                        "id": piece["id"], "type": piece["type"],
                        "function": {"name": piece["function"]["name"], "arguments": ""},
                    }  # fmt: skip
                call = message["tool_calls"][piece["index"]]
                call["function"]["arguments"] += piece["function"].get("arguments", "")
            if choice["finish_reason"] is not None:
                message["finish_reason"] = choice["finish_reason"]
    assert events[-1] == "[DONE]"
    return message


def test_auto_tool_call_with_reasoning(fake_app_factory: Any) -> None:
    """hermes + qwen3 reasoning: the thinking goes to `reasoning`, the text before the call
    to `content`, the call to `tool_calls`; finish_reason "tool_calls". The stream's deltas
    join to the same message, each call's first delta carrying index, id, type and name."""
    app = qwen_app(fake_app_factory, QWEN_OUTPUT, reasoning_parser="qwen3")
    client = app.client()
    response = client.chat.completions.create(
        model=app.model, messages=MESSAGES, tools=TOOLS, max_tokens=200
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.reasoning == "\nThe user wants the weather.\n"  # type: ignore[attr-defined]
    assert message.content == "\n\nLet me check.\n"
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert (call.type, call.function.name, call.function.arguments) == (
        "function", "get_weather", ARGUMENTS,
    )  # fmt: skip
    assert call.id.startswith("chatcmpl-tool-")
    body = {"model": app.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 200}
    events = parse_sse(app.post("/v1/chat/completions", {**body, "stream": True}).text)
    streamed = joined_stream(events)
    assert streamed["reasoning"] == message.reasoning  # type: ignore[attr-defined]
    assert streamed["content"] == message.content
    assert streamed["finish_reason"] == "tool_calls"
    [streamed_call] = streamed["tool_calls"].values()
    assert streamed_call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}
    first = streamed["first"][0]
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    # the arguments follow in later deltas (the first may carry some when outputs merged)
    assert ARGUMENTS.startswith(first["function"]["arguments"])
    assert sum(1 for e in events[:-1] for c in e["choices"] if c["delta"].get("tool_calls")) > 2
    # The official client's stream helper joins the deltas the same way.
    with client.beta.chat.completions.stream(
        model=app.model,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=200,  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == ARGUMENTS  # type: ignore[index]


def test_auto_without_a_call_and_tool_choice_none(fake_app_factory: Any) -> None:
    """An answer without a call is content (finish_reason stays "stop"); with
    tool_choice "none" the parser is off: the call's text stays content."""
    app = qwen_app(fake_app_factory, "It is sunny.")
    response = app.client().chat.completions.create(
        model=app.model, messages=MESSAGES, tools=TOOLS, max_tokens=50
    )
    assert response.choices[0].message.content == "It is sunny."
    assert (
        response.choices[0].finish_reason == "stop" and not response.choices[0].message.tool_calls
    )
    app = qwen_app(fake_app_factory, QWEN_OUTPUT)
    response = app.client().chat.completions.create(
        model=app.model, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert response.choices[0].message.content == QWEN_OUTPUT
    assert not response.choices[0].message.tool_calls


def test_reasoning_without_tools_stream_and_whole(fake_app_factory: Any) -> None:
    app = qwen_app(fake_app_factory, "<think>hmm</think>Hi!", reasoning_parser="deepseek_r1")
    body = {"messages": MESSAGES, "max_tokens": 50}
    whole = app.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (whole["reasoning"], whole["content"]) == ("hmm", "Hi!")
    streamed = joined_stream(
        parse_sse(app.post("/v1/chat/completions", {**body, "stream": True}).text)
    )
    assert (streamed["reasoning"], streamed["content"]) == ("hmm", "Hi!")
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    app = qwen_app(fake_app_factory, "Hi!", reasoning_parser="qwen3")
    whole = app.post("/v1/chat/completions", off).json()["choices"][0]["message"]
    assert (whole["reasoning"], whole["content"]) == (None, "Hi!")


def test_tool_request_errors(fake_app_factory: Any) -> None:
    """vLLM's 400s: "auto" (also implied by tools without tool_choice) on a server without
    --enable-auto-tool-choice; tool_choice without tools; a named function not in tools."""
    app = fake_app_factory(tokenizer="qwen3")
    for extra in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        response = app.post("/v1/chat/completions", {"messages": MESSAGES, **extra})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == AUTO_NEEDS_FLAGS
        assert response.json()["error"]["param"] == "tool_choice"
    cases = [
        ({"tool_choice": "required"}, "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "does not match any"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ]  # fmt: skip
    for extra, words in cases:
        response = app.post("/v1/chat/completions", {"messages": MESSAGES, **extra})
        assert response.status_code == 400 and words in response.json()["error"]["message"]
        assert response.json()["error"]["param"].startswith("tool_choice")


@pytest.mark.parametrize(
    "parameters",
    [{"type": "nope"}, {"type": "object", "properties": 5},
     {"type": "object", "properties": {"a": {"type": "object", "minProperties": "x"}}}],
)  # fmt: skip
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_a_tool_whose_parameters_are_not_a_json_schema_is_a_400_naming_tools(
    fake_app_factory: Any, parameters: dict[str, Any], tool_choice: str
) -> None:
    """The grammar of "required" or a named function is made from the tools' parameters; a
    schema it cannot compile is the `tools` entry's fault, not structured_outputs'."""
    app = fake_app_factory(tokenizer="qwen3")
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    choice: Any = tool_choice
    if tool_choice == "named":
        choice = {"type": "function", "function": {"name": "bad"}}
    body = {"messages": MESSAGES, "tools": [TOOLS[0], bad], "tool_choice": choice}
    response = app.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools.1.function.parameters"
    assert "tools.1.function.parameters" in error["message"]
    assert "structured_outputs" not in error["message"]


def test_tools_and_tool_messages_rendered_by_the_template(fake_app_factory: Any) -> None:
    """The tools reach the template (Qwen3's lists them in its system part); an assistant's
    tool_calls (arguments as OpenAI's JSON text) and the tool's answer render as the
    template writes them (as transformers renders the same conversation with the arguments
    as an object); Llama 3's template (no tool support) still renders the tool's answer."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": ARGUMENTS}}  # fmt: skip
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    qwen = fake_app_factory(tokenizer="qwen3")
    text = qwen.detokenize(qwen.tokenize(messages=conversation, tools=TOOLS))
    assert "<tools>" in text and '"name": "get_weather"' in text and "get_time" in text
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    as_objects = [
        *conversation[:1],
        {"role": "assistant", "content": "", "tool_calls": [
            {**call, "function": {"name": "get_weather", "arguments": json.loads(ARGUMENTS)}}]},
        conversation[2],
    ]  # fmt: skip
    expected = shared_tokenizer("qwen3").apply_chat_template(
        as_objects, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == expected
    plain = qwen.detokenize(qwen.tokenize(messages=MESSAGES))
    assert "<tools>" not in plain  # no tools, no tool section
    llama = fake_app_factory(tokenizer="llama3")
    assert "18 degrees" in llama.detokenize(llama.tokenize(messages=conversation, tools=TOOLS))
    bad = [*MESSAGES, {"role": "assistant", "tool_calls": [
        {**call, "function": {"name": "f", "arguments": "{not json"}}]}]  # fmt: skip
    response = qwen.post("/tokenize", {"messages": bad})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_required_schema_is_vllms() -> None:
    """tool_choice "required" constrains the output to vLLM's schema; a valid output of it
    is a call list the required parser reads (the engine's constraint is the grammar
    engine's work: tested with it, in test_tools_server.py)."""
    request = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    )
    schema = required_tools_schema(request)
    assert schema["type"] == "array" and schema["minItems"] == 1
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time",
            "parameters": {}}]  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"unit": "celsius"}}],
                [{"name": "nope", "parameters": {}}]):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_reasoning_parser_needs_its_markers(fake_app_factory: Any) -> None:
    """--reasoning-parser with a tokenizer that lacks <think>/</think>: a start-up error."""
    with pytest.raises(ValueError, match="lacks"):
        fake_app_factory(tokenizer="llama3", reasoning_parser="deepseek_r1")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tool-call-parser", "nope"], ["invalid choice", *TOOL_PARSERS]),
        (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice requires --tool-call-parser"]),
        (["--reasoning-parser", "nope"], ["invalid choice", "deepseek_r1", "qwen3"]),
    ],
)
def test_bad_flags_fail_at_start_up(flags: list[str], words: list[str]) -> None:
    """Before the model loads, with a line naming the valid choices (vLLM's checks)."""
    command = [sys.executable, "-m", "pagedserve.entrypoints.openai.api_server",
               "--model", "unused", "--port", "0", *flags]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    last_line = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and all(w in last_line for w in words), done.stderr[-2000:]
