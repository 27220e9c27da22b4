"""Operations endpoints as vLLM has them (issue 21): `/ping`, `/load`, several API keys. In
process, on the fake engine."""

import asyncio
from collections.abc import Callable

import pytest

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
