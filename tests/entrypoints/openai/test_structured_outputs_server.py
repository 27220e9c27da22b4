"""Structured outputs through the server: the request fields (response_format, the
structured_outputs extra, guided_*) on chat and completions, their 400s, and the official
client's `chat.completions.parse` against a real server process."""

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import pydantic
import pytest

from .conftest import Server
from .in_process import InProcessApp


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool
    degrees: int = pydantic.Field(ge=-40, le=50)


@pytest.fixture(scope="module")
def qwen3_server(server_factory: Any) -> Iterator[Server]:
    # A random model writes JSON whitespace until max_tokens unless told not to (vLLM's flag).
    running = server_factory("qwen3", None, ["--disable-any-whitespace"])
    try:
        yield running
    finally:
        running.stop()


def test_openai_client_parse(qwen3_server: Server) -> None:
    client = qwen3_server.client()
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=qwen3_server.model,
            messages=[{"role": "user", "content": "Weather in a city?"}],
            response_format=Weather,
            max_tokens=64,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Weather)


def test_parse_through_the_grammar_process(server_factory: Any, qwen3_server: Server) -> None:
    """With async scheduling the engine-core process runs the matchers in a grammar process
    of its own: the same parse, stream and non-stream, gives the same outputs as without."""
    running = server_factory("qwen3", None, ["--disable-any-whitespace", "--async-scheduling"])
    try:
        for seed in range(3):
            texts = []
            for server in (running, qwen3_server):
                completion = server.client().chat.completions.parse(
                    model=server.model,
                    messages=[{"role": "user", "content": "Weather in a city?"}],
                    response_format=Weather,
                    max_tokens=64,
                    seed=seed,
                )
                assert isinstance(completion.choices[0].message.parsed, Weather)
                texts.append(completion.choices[0].message.content)
            assert texts[0] == texts[1]
    finally:
        running.stop()


def test_fields_on_chat_and_completions_stream_and_not(qwen3_server: Server) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "seed": 1}
    completion = {"prompt": "hi", "max_tokens": 40, "seed": 1}
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
         lambda t: isinstance(json.loads(t), list)),
        ({"guided_grammar": 'root ::= "a" "b"*'}, lambda t: re.fullmatch("ab*", t)),
    ]  # fmt: skip
    for extra, check in cases:
        for path, body, text_of in (
            ("/v1/chat/completions", chat, lambda c: c["message"]["content"]),
            ("/v1/completions", completion, lambda c: c["text"]),
        ):
            response = qwen3_server.post(path, {**body, **extra})
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            if choice["finish_reason"] == "stop":  # json_object may run long on a random model
                assert check(text_of(choice)), (extra, choice)
            streamed = qwen3_server.post(path, {**body, **extra, "stream": True})
            assert streamed.status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
            "objekt",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "type"),
        ({"guided_json": {"type": "integer", "minimum": "z"}}, "guided_json", "number"),
        ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "not defined"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"structured_outputs": {"regex": "[", "choice": ["a"]}}, "structured_outputs", "one"),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "regex"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": False},
                }
            },
            "response_format",
            "schema is false",
        ),
        ({"structured_outputs": {"json": False}}, "structured_outputs", "json is false"),
        (
            {"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern",
            "whitespace_pattern is not supported",
        ),
        (
            {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"},
            "guided_whitespace_pattern",
            "guided_whitespace_pattern is not supported",
        ),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
        ({"guided_json": False}, "guided_json", "json is false"),
        ({"structured_outputs": '{"json": {}}'}, "structured_outputs", "must be an object"),
        ({"structured_outputs": [{"json": {}}]}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs", "JSON schema"),
        ({"structured_outputs": {"json": {}, "json_object": 1}}, "structured_outputs", "one"),
        (
            {"structured_outputs": {"json": {}, "disable_fallback": "no"}},
            "structured_outputs",
            "boolean",
        ),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "backend"),
    ],  # fmt: skip
)
def test_invalid_constraints_are_400_naming_the_field(
    fake_app: InProcessApp, path: str, extra: dict[str, Any], param: str, words: str
) -> None:
    body: dict[str, Any] = {"max_tokens": 4, **extra}
    if path == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    response = fake_app.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert fake_app.engine.running() == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_true_json_schema_is_any_json(fake_app: InProcessApp, path: str) -> None:
    """JSON Schema's `true` accepts any value: the request is taken (as the empty schema)."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}
    body: dict[str, Any] = {"max_tokens": 2, "response_format": schema}
    if path == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    response = fake_app.post(path, body)
    assert response.status_code == 200, response.text
