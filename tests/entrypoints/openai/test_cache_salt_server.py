"""The `cache_salt` request field of /v1/completions and /v1/chat/completions (vLLM's): on the
real server, a salted request hits only blocks cached under its own salt (/metrics' prefix
cache hits); a salt that is not a non-empty string is a 400 naming it."""

from typing import Any

import pytest

from .conftest import API_KEY

HITS = "pagedserve:prefix_cache_hits_total"
PROMPT = "A salted prompt, long enough to fill several blocks of the cache. " * 6


def num_hits(server: Any, path: str, body: dict[str, Any]) -> float:
    """Prefix-cache hit tokens of one request (the metric's increase)."""
    before = server.metrics()[HITS]
    response = server.post(path, body)
    assert response.status_code == 200, response.text
    return float(server.metrics()[HITS] - before)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "chat: " + PROMPT}], "max_tokens": 1},
        ),
    ],
)
def test_only_the_same_salt_hits(server: Any, path: str, body: dict[str, Any]) -> None:
    assert num_hits(server, path, {**body, "cache_salt": "tenant-a"}) == 0
    assert num_hits(server, path, {**body, "cache_salt": "tenant-b"}) == 0
    assert num_hits(server, path, body) == 0  # no salt: none of the salted blocks
    assert num_hits(server, path, {**body, "cache_salt": "tenant-a"}) > 0
    assert num_hits(server, path, {**body, "cache_salt": None}) > 0  # null is no salt


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 5])
def test_a_bad_salt_is_a_400(fake_app: Any, path: str, salt: object) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "cache_salt": salt}
    if path == "/v1/completions":
        body["prompt"] = ["Hello", "there"]  # two prompts: none is left running
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    response = fake_app.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and "cache_salt" in error["param"], error
    assert fake_app.post(path, {**body, "cache_salt": "ok"}).status_code == 200


def test_reset_prefix_cache_endpoint(server: Any, fake_app_factory: Any) -> None:
    """POST /reset_prefix_cache (vLLM's): 200 with an empty body; the next request finds no
    earlier prefix (the reset reaches the engine core before it), and the one after hits."""
    body = {"prompt": "reset: " + PROMPT, "max_tokens": 1}
    num_hits(server, "/v1/completions", body)
    assert num_hits(server, "/v1/completions", body) > 0
    response = server.post("/reset_prefix_cache", None)
    assert response.status_code == 200 and response.content == b""
    assert num_hits(server, "/v1/completions", body) == 0
    assert num_hits(server, "/v1/completions", body) > 0
    # It needs the API key as the other routes do (only probes and /metrics are open).
    fake_app = fake_app_factory(api_key=API_KEY)
    assert fake_app.post("/reset_prefix_cache", None, headers={}).status_code == 401
    assert fake_app.engine.num_prefix_cache_resets == 0
    assert fake_app.post("/reset_prefix_cache", None).status_code == 200
    assert fake_app.engine.num_prefix_cache_resets == 1
