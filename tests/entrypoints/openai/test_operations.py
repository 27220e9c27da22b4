"""Operations endpoints as vLLM has them (issue 21): `/ping`, `/load`, several API keys. In
process, on the fake engine."""

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from pagedserve.entrypoints.openai.api_server import build_app

from .conftest import shared_tokenizer
from .fake_engine import FakeEngine
from .in_process import InProcessApp


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health_without_a_key(
    fake_app_factory: Callable[..., InProcessApp], method: str
) -> None:
    app = fake_app_factory(api_key="secret")
    response = app.request(method, "/ping", headers={})
    assert response.status_code == 200 and response.content == b""


def test_any_of_several_api_keys_is_accepted(
    fake_app_factory: Callable[..., InProcessApp],
) -> None:
    app = fake_app_factory(api_key=["first", "second"])
    for key, status in [("first", 200), ("second", 200), ("third", 401), ("firs", 401)]:
        response = app.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == status, key


@pytest.mark.parametrize("api_key", ["", [""]])
def test_an_empty_api_key_leaves_the_api_open(
    fake_app_factory: Callable[..., InProcessApp], api_key: Any
) -> None:
    app = fake_app_factory(api_key=api_key)
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer x"}):
        assert app.get("/v1/models", headers=headers).status_code == 200, headers


def test_load_counts_generation_requests_until_their_last_chunk(
    fake_app: InProcessApp,
) -> None:
    engine = fake_app.engine
    engine.hold_after = 3  # each request writes 3 tokens, then runs until aborted
    body = {"model": fake_app.model, "prompt": "Hello", "max_tokens": 50, "stream": True}

    async def scenario() -> tuple[int, int, int]:
        async with fake_app.async_http() as client:
            idle = (await client.get("/load")).json()["server_load"]
            stream = asyncio.create_task(client.post("/v1/completions", json=body))
            chat = {"model": fake_app.model, "max_tokens": 50,
                    "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
            whole = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
            while len(engine.added) < 2 or not engine.held():
                await asyncio.sleep(0.01)
            busy = (await client.get("/load")).json()["server_load"]
            engine.hold_after = None  # let both finish
            engine._wakeup()
            await stream
            await whole
            after = (await client.get("/load")).json()["server_load"]
            return idle, busy, after

    assert fake_app.run(scenario()) == (0, 2, 0)


PREFLIGHT = {
    "Origin": "http://page.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_a_browser_preflight_is_answered_without_the_api_key(
    fake_app_factory: Callable[..., InProcessApp],
) -> None:
    app = fake_app_factory(api_key="secret")
    response = app.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] in ("*", "http://page.example")
    assert "POST" in response.headers["access-control-allow-methods"]
    # The page can read the answers, a 401 included.
    denied = app.get("/v1/models", headers={"Origin": "http://page.example"})
    assert denied.status_code == 401 and "access-control-allow-origin" in denied.headers


def test_allowed_origins_restrict_which_pages_may_call(
    fake_app_factory: Callable[..., InProcessApp],
) -> None:
    from pagedserve.entrypoints.openai.operations import CorsOptions

    app = fake_app_factory(cors=CorsOptions(allowed_origins=["http://ok.example"]))
    refused = app.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert refused.status_code == 400
    allowed = app.request(
        "OPTIONS", "/v1/completions", headers={**PREFLIGHT, "Origin": "http://ok.example"}
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://ok.example"
    other = app.get("/v1/models", headers={"Origin": "http://other.example"})
    assert "access-control-allow-origin" not in other.headers


def test_tls_and_a_root_path_with_the_openai_client(
    server_factory: Callable[..., Any], tmp_path: Path
) -> None:
    """`--ssl-keyfile/--ssl-certfile` (a self-signed certificate the client trusts) and
    `--root-path /llm` (the prefix a proxy strips before forwarding, as uvicorn's and vLLM's
    root_path: requests arrive without it; the OpenAPI document names it)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    running = server_factory(
        "llama3",
        None,
        ["--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert_file), "--root-path", "/llm"],
    )
    try:
        assert running.url.startswith("https://")
        http = httpx.Client(verify=str(ca_file), timeout=60.0)
        client = openai.OpenAI(
            base_url=f"{running.url}/v1", api_key="none", max_retries=0, http_client=http
        )
        assert [m.id for m in client.models.list().data] == [running.model]
        completion = client.completions.create(
            model=running.model, prompt="Hello", max_tokens=3, temperature=0
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        response = http.get(f"{running.url}/openapi.json")
        assert response.status_code == 200, running.log()
        openapi = response.json()
        assert {"url": "/llm"} in openapi.get("servers", [])
        with pytest.raises(httpx.TransportError):  # plain http gets no answer on the TLS port
            httpx.get(running.url.replace("https", "http") + "/health", timeout=5.0)
    finally:
        running.stop()


def test_a_root_path_is_served_with_or_without_the_prefix() -> None:
    """`--root-path /llm` under uvicorn (which puts the prefix in the ASGI path): a proxy that
    strips it and one that does not both reach the routes, and the API-key middleware sees
    the route's path (/health stays open; /v1 needs the key), and so do the HTTP metrics."""
    engine = FakeEngine(shared_tokenizer("llama3"))
    registry = CollectorRegistry()
    app = build_app(engine, ["m"], api_key="secret", root_path="/llm", registry=registry)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, root_path="/llm", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        key = {"Authorization": "Bearer secret"}
        for prefix in ("", "/llm"):
            assert httpx.get(f"{base}{prefix}/health").status_code == 200, prefix
            models = httpx.get(f"{base}{prefix}/v1/models", headers=key)
            assert models.status_code == 200, (prefix, models.text)
            assert [m["id"] for m in models.json()["data"]] == ["m"]
            assert httpx.get(f"{base}{prefix}/v1/models").status_code == 401, prefix
            body = {"model": "m", "prompt": "Hello", "max_tokens": 2}
            completion = httpx.post(f"{base}{prefix}/v1/completions", json=body, headers=key)
            assert completion.status_code == 200, (prefix, completion.text)
        assert httpx.get(f"{base}/llmx/v1/models", headers=key).status_code == 404
        openapi = httpx.get(f"{base}/llm/openapi.json", headers=key).json()
        assert {"url": "/llm"} in openapi.get("servers", [])
        counts = {  # by route template, with or without the prefix; no route: "none"
            ("/v1/models", "GET", "2xx"): 2,
            ("/v1/models", "GET", "4xx"): 2,
            ("/v1/completions", "POST", "2xx"): 2,
            ("none", "GET", "4xx"): 1,
        }
        deadline = time.monotonic() + 10  # (counted once each answer has been sent)
        while True:
            found = {
                (handler, method, status): registry.get_sample_value(
                    "http_requests_total", {"handler": handler, "method": method, "status": status}
                )
                for handler, method, status in counts
            }
            if found == counts or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert found == counts
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()


def test_the_server_loop_is_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`event_loop_factory`: uvloop's loop where uvloop imports (a dependency off Windows),
    asyncio's own (None) where it does not; the server's Runner runs coroutines on it."""
    import sys

    from pagedserve.entrypoints.openai.api_server import event_loop_factory

    uvloop = pytest.importorskip("uvloop")
    factory = event_loop_factory()
    assert factory is uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        assert runner.run(asyncio.sleep(0, "ok")) == "ok"
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now fails
    assert event_loop_factory() is None
