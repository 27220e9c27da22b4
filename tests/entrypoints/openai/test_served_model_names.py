"""Several --served-model-name values (vLLM's): /v1/models lists each, a request may name any
of them, responses carry the first, and another name is a 404 naming `model`."""

from collections.abc import Iterator

import httpx
import pytest

from pagedserve.entrypoints.openai.api_server import build_app

from .conftest import shared_tokenizer
from .fake_engine import FakeEngine
from .in_process import BASE_URL, AppLoop, InProcessApp, LoopTransport

NAMES = ["org/model", "alias"]


@pytest.fixture
def app(app_loop: AppLoop) -> Iterator[InProcessApp]:
    engine = FakeEngine(shared_tokenizer("llama3"))
    app = InProcessApp(app_loop, engine, NAMES[0])
    app.app = build_app(engine, NAMES, model_root="/models/org-model")
    app.http = httpx.Client(transport=LoopTransport(app_loop, app.app), base_url=BASE_URL)
    yield app
    app_loop.loop.call_soon_threadsafe(engine.shutdown)


def test_every_served_name_is_listed_and_accepted(app: InProcessApp) -> None:
    cards = app.get("/v1/models").json()["data"]
    assert [(c["id"], c["root"]) for c in cards] == [(n, "/models/org-model") for n in NAMES]
    for name in NAMES:
        body = {"model": name, "prompt": "Hi", "max_tokens": 2}
        response = app.post("/v1/completions", body)
        assert response.status_code == 200 and response.json()["model"] == NAMES[0]
        chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert app.post("/v1/chat/completions", chat).json()["model"] == NAMES[0]
        assert app.post("/tokenize", {"model": name, "prompt": "Hi"}).status_code == 200
    response = app.post("/v1/completions", {"model": "other", "prompt": "Hi"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
