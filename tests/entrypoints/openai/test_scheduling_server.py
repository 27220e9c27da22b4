"""The `priority` request extra of /v1/completions and /v1/chat/completions (vLLM's): taken by
a real engine started with scheduling_policy "priority", a 400 naming it under fcfs."""

from collections.abc import Iterator
from typing import Any

import pytest

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine

from .conftest import REAL_MAX_MODEL_LEN
from .in_process import AppLoop, InProcessApp

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def priority_app(app_loop: AppLoop) -> Iterator[InProcessApp]:
    """An app on its own AsyncLLMEngine (engine core in its own process) with the priority
    policy, one request at a time."""
    args = EngineArgs(
        device="cpu",
        max_model_len=REAL_MAX_MODEL_LEN,
        kv_cache_memory_bytes=8 * 2**20,
        scheduling_policy="priority",
        max_num_seqs=1,
    )
    engine = AsyncLLMEngine.from_engine_args(args, log_stats=False)

    async def shutdown() -> None:  # on its loop: it cancels the engine's tasks
        engine.shutdown()

    try:
        yield InProcessApp(app_loop, engine, "stories", chat_template=CHAT_TEMPLATE)
    finally:
        app_loop.run(shutdown())


@pytest.fixture(scope="module")
def fcfs_app(app_loop: AppLoop, real_engine: AsyncLLMEngine) -> InProcessApp:
    return InProcessApp(app_loop, real_engine, "stories", chat_template=CHAT_TEMPLATE)


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_priority_is_taken_with_the_priority_policy(
    priority_app: InProcessApp, path: str, body: dict[str, Any]
) -> None:
    answers = []
    for priority in (-3, 0, 7):
        response = priority_app.post(path, {**body, "priority": priority})
        assert response.status_code == 200, response.text
        answers.append(response.json()["usage"]["completion_tokens"])
    assert answers == [4, 4, 4]


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
def test_priority_is_a_400_without_the_policy(
    fcfs_app: InProcessApp, path: str, body: dict[str, Any]
) -> None:
    response = fcfs_app.post(path, {**body, "priority": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority"
    assert "priority scheduling is not enabled" in error["message"]
    assert fcfs_app.post(path, {**body, "priority": 0}).status_code == 200
    assert fcfs_app.post(path, {**body, "priority": "high"}).status_code == 400
