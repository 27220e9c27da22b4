"""Stop-string limits on the server (issue 13, item 12): 100,000 stop strings used to freeze
every client for 79 s; now a 400 naming the limit, on completions and chat, stream or not (in
process, on the fake engine: the real validation, detokenizer and stop strings)."""

from typing import Any

import pytest

from tests.entrypoints.openai.test_errors import assert_error

MANY_STOPS = [f"stop{i}" for i in range(100_000)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_too_many_stop_strings_are_a_400(fake_app: Any, path: str, stream: bool) -> None:
    body: dict[str, Any] = {"max_tokens": 300, "stop": MANY_STOPS, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = "Once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "Once upon a time"}]
    error = assert_error(fake_app.post(path, body), 400, "at most 128", "MAX_STOP_STRINGS")
    assert error["param"] == "stop"


def test_stop_strings_too_long_in_all_are_a_400(fake_app: Any) -> None:
    body = {"prompt": "Hi", "max_tokens": 2, "stop": ["a" * 5000, "b" * 5000]}
    error = assert_error(fake_app.post("/v1/completions", body), 400, "8192 characters")
    assert error["param"] == "stop"


def test_the_most_stop_strings_allowed_still_stop(fake_app: Any) -> None:
    """128 stop strings (the limit), one of which the greedy output contains."""
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    text = fake_app.post("/v1/completions", body).json()["choices"][0]["text"]
    word = text.split()[2]
    stops = [f"zz{i}" for i in range(127)] + [word]
    response = fake_app.post("/v1/completions", {**body, "stop": stops})
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == word
    assert choice["text"] == text[: text.index(word)]
