"""The tool parsers (hermes, llama3_json, mistral, pythonic) and the forced-call parsers of
tool_choice "required" / a named function, on outputs the models write: whole (vLLM's
`extract_tool_calls`) and streamed token by token with real tokenizers
(`extract_tool_calls_streaming`), whose pieces must join to the whole result."""

import json
from typing import Any

import pytest

from pagedserve.entrypoints.openai.chat_output import NamedToolParser, RequiredToolParser
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser

from .conftest import shared_tokenizer

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a \\"quoted\\" }{ text", "n": [1, -2.5e3, {"deep": null}], "ok": true}'

# (parser, tokenizer, model output, content, [(name, arguments)]); no calls: all content.
CASES = [
    ("hermes", "qwen3",
     f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", "qwen3",
     f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
     f'</tool_call>\n<tool_call>\n{{"arguments": {NESTED}, "name": "search"}}\n</tool_call>',
     "Let me look.\n", [("get_weather", WEATHER), ("search", NESTED)]),
    ("hermes", "qwen3",  # EOS came before </tool_call>: the whole JSON still counts
     '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", "{}")]),
    ("hermes", "qwen3", "The weather is fine, no <tool_ needed.", "same", []),
    ("llama3_json", "llama3", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", "llama3",
     f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
     f'{{"name": "search", "arguments": {NESTED}}}', None,
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("llama3_json", "llama3", "It is sunny in Paris.", "same", []),
    ("llama3_json", "llama3", '{"answer": 42}', "same", []),  # JSON, but not a call
    ("mistral", "llama3",
     f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
     f'{{"name": "search", "arguments": {NESTED}}}]', None,
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("mistral", "sentencepiece-32k",
     f"Sure.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]now[ARGS]{{}}", "Sure.",
     [("get_weather", WEATHER), ("now", "{}")]),  # the v11 format
    ("mistral", "llama3", "No calls [TOOL_CALL here.", "same", []),
    ("pythonic", "llama3", '[get_weather(city="Paris", unit="celsius"), now()]', None,
     [("get_weather", WEATHER), ("now", "{}")]),
    ("pythonic", "llama3", "[search(q='a \"quoted\" }{ text', n=[1, -2500.0, {'deep': None}],"
     " ok=True)]", None, [("search", NESTED.replace("-2.5e3", "-2500.0"))]),
    ("pythonic", "llama3", "[1, 2, 3] are numbers", "same", []),
    ("pythonic", "llama3", "[f(1)]", "same", []),  # positional arguments: not a call
]  # fmt: skip


def stream_pieces(parser: ToolParser, text: str, tokenizer_name: str) -> tuple[str, list[Any]]:
    """Content and tool-call deltas of `text` streamed one token at a time (decoded as the
    detokenizer does), the last call with finished=True; checks OpenAI's stream shape."""
    tok = shared_tokenizer(tokenizer_name)
    ids = tok.encode(text, add_special_tokens=False)
    previous, content, calls = "", "", []
    steps = [i for i in range(1, len(ids) + 1) if not tok.decode(ids[:i]).endswith("\ufffd")]
    for i in steps:
        current = tok.decode(ids[:i])
        finished = i == len(ids)
        delta = parser.extract_tool_calls_streaming(
            previous, current, current[len(previous) :], finished
        )
        previous = current
        if delta is None:
            continue
        content += delta.content or ""
        for piece in delta.tool_calls:
            if piece.index == len(calls):  # a new call: index, id, type and name come first
                assert piece.id and piece.type == "function" and piece.function is not None
                assert piece.function.name and piece.function.arguments is not None
                calls.append([piece.id, piece.function.name, piece.function.arguments])
            else:
                assert piece.id is None and piece.function is not None
                assert piece.function.name is None and piece.function.arguments
                calls[piece.index][2] += piece.function.arguments
    assert previous == text
    return content, calls


@pytest.mark.parametrize(("name", "tokenizer_name", "output", "content", "expected"), CASES)
def test_whole_and_streamed_outputs(
    name: str, tokenizer_name: str, output: str, content: str | None, expected: list[Any]
) -> None:
    content = output if content == "same" else content
    result = get_tool_parser(name, shared_tokenizer(tokenizer_name)).extract_tool_calls(output)
    assert result.tools_called == bool(expected)
    assert result.content == content
    assert [(c.function.name, c.function.arguments) for c in result.tool_calls] == expected
    for call in result.tool_calls:
        json.loads(call.function.arguments)
        assert len(call.id) == 9 if name == "mistral" else call.id.startswith("chatcmpl-tool-")
    parser = get_tool_parser(name, shared_tokenizer(tokenizer_name))
    streamed_content, streamed_calls = stream_pieces(parser, output, tokenizer_name)
    assert streamed_content == (content or "")
    assert [(n, a) for _, n, a in streamed_calls] == expected


def test_malformed_call_is_content() -> None:
    """A call whose JSON turns out malformed: the whole output is content (vLLM's rule). A
    stream cannot take back the pieces it sent before the fault showed; it sends the whole
    output as content at the end, so nothing the model wrote is lost."""
    output = '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'
    result = get_tool_parser("hermes", None).extract_tool_calls(output)
    assert (result.tools_called, result.content) == (False, output)
    content, _ = stream_pieces(get_tool_parser("hermes", None), output, "qwen3")
    assert content == output


def test_stream_sends_arguments_as_they_are_written() -> None:
    """The name comes first (with arguments ""), the arguments in pieces, before the call
    is complete; a cut-off "<tool_" is held back as content until it is known."""
    parser = get_tool_parser("hermes", shared_tokenizer("qwen3"))
    text = ""
    deltas = []
    for piece in ["Hi <tool_", "call>\n{", '"name": "f", ', '"arguments": {"a"', ": 1}}"]:
        deltas.append(parser.extract_tool_calls_streaming(text, text + piece, piece))
        text += piece
    assert deltas[0] is not None and deltas[0].content == "Hi " and not deltas[0].tool_calls
    assert deltas[1] is None
    first = deltas[2]
    assert first is not None and first.content is None
    assert first.tool_calls[0].function is not None
    assert (first.tool_calls[0].function.name, first.tool_calls[0].function.arguments) == ("f", "")
    arguments = [d.tool_calls[0].function.arguments for d in deltas[3:] if d and d.tool_calls]
    assert arguments == ['{"a"', ": 1}"]


def test_forced_calls() -> None:
    """tool_choice "required": a JSON array of {"name", "parameters"}; a named function: the
    whole output is its arguments. Streamed pieces join to the whole result."""
    output = (
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}, '
        '{"name": "now", "parameters": {}}]'
    )
    calls = RequiredToolParser().extract_tool_calls(output).tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", WEATHER), ("now", "{}"),
    ]  # fmt: skip
    _, streamed = stream_pieces(RequiredToolParser(), output, "qwen3")
    assert [(n, a) for _, n, a in streamed] == [("get_weather", WEATHER), ("now", "{}")]
    cut_off = RequiredToolParser().extract_tool_calls(output[:30])  # max_tokens hit
    assert not cut_off.tools_called and cut_off.content == output[:30]
    named = NamedToolParser("get_weather").extract_tool_calls(WEATHER).tool_calls
    assert [(c.function.name, c.function.arguments) for c in named] == [("get_weather", WEATHER)]
    _, streamed = stream_pieces(NamedToolParser("get_weather"), WEATHER, "qwen3")
    assert [(n, a) for _, n, a in streamed] == [("get_weather", WEATHER)]


def test_registry() -> None:
    assert TOOL_PARSERS == ("hermes", "llama3_json", "mistral", "pythonic")
    with pytest.raises(ValueError, match="valid names: \\['hermes', 'llama3_json'"):
        get_tool_parser("nope", None)
