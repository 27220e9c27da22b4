"""A server on a Hub id: the model is looked up on the Hub once (the engine-core process
loads the folder the server's process resolved), it is served under the id the user gave,
and its generation_config.json sets the defaults of what requests leave out."""

import json
from pathlib import Path

import huggingface_hub.constants
import pytest

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine
from tests.engine.hub_stand_in import HubRepo, folder_files, serve_hub

from .in_process import AppLoop, InProcessApp

REPO = "testorg/stories"
COMMIT = "3" * 40
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def test_server_on_a_hub_id(
    app_loop: AppLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = folder_files(Path(DEFAULT_MODEL))
    files["generation_config.json"] = json.dumps(
        {"temperature": 0, "max_new_tokens": 4, "eos_token_id": 2}
    ).encode()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with serve_hub({REPO: HubRepo(files, COMMIT)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)  # the core process inherits it
        args = EngineArgs(
            model=REPO, device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20
        )
        engine = AsyncLLMEngine(args, log_stats=False)
        lookups = [path for _, path, _ in hub.requests if path.startswith("/api/models/")]

    async def shutdown() -> None:  # on its loop: it cancels the engine's tasks
        engine.shutdown()

    try:
        assert lookups.count(f"/api/models/{REPO}/revision/main") == 1
        assert Path(engine.model_config.model).name == COMMIT
        app = InProcessApp(app_loop, engine, REPO, chat_template=TEMPLATE)
        assert [card["id"] for card in app.get("/v1/models").json()["data"]] == [REPO]
        body = {"model": REPO, "messages": [{"role": "user", "content": "Once upon a time"}]}
        first = app.post("/v1/chat/completions", body).json()
        again = app.post("/v1/chat/completions", body).json()
        assert first["model"] == REPO and first["usage"]["completion_tokens"] == 4
        assert first["choices"][0]["message"] == again["choices"][0]["message"]  # T=0
    finally:
        app_loop.run(shutdown())
