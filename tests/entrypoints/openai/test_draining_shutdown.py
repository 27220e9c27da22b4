"""A stop (SIGTERM/SIGINT) while a stream runs: the server lets running responses finish for
a drain period, then ends the ones still running with an error event and [DONE]. uvicorn
alone cancelled them: the client's stream stopped mid-body (no error event, no [DONE]) and
the log got a CancelledError traceback."""

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.entrypoints.openai.launch import DrainingServer
from pagedserve.entrypoints.openai.serving import sse_error, to_openai_error
from pagedserve.errors import ServerShuttingDownError


def test_shutting_down_is_a_503_asking_to_retry() -> None:
    error = to_openai_error(ServerShuttingDownError("stop"))
    assert error.status_code == 503 and "shutting down" in str(error)


def test_a_stop_ends_a_running_stream_with_an_error_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    rest = asyncio.run(stream_then_stop())
    assert rest[-1] == "data: [DONE]"
    assert '"code": 503' in rest[-2] and "shutting down" in rest[-2]
    assert "timeout graceful shutdown exceeded" not in caplog.text
    assert "Traceback" not in caplog.text


async def stream_then_stop() -> list[str]:
    """Start a stream on a DrainingServer, ask the server to exit (as uvicorn does on
    SIGTERM/SIGINT), and return the stream's remaining lines."""
    ended = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return

        async def events() -> AsyncIterator[str]:
            yield "data: 1\n\n"
            await ended.wait()  # a generation that runs until the engine fails it
            for event in sse_error(ServerShuttingDownError("stop")):
                yield event

        await StreamingResponse(events(), media_type="text/event-stream")(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="info")
    server = DrainingServer(config, ended.set, drain_s=0.2)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{port}/"
    async with httpx.AsyncClient() as client, client.stream("GET", url) as response:
        lines = response.aiter_lines()
        assert await anext(lines) == "data: 1"
        server.should_exit = True  # what uvicorn does on SIGTERM/SIGINT
        rest = [line async for line in lines if line]
    await asyncio.wait_for(serving, timeout=30)
    sock.close()
    return rest
