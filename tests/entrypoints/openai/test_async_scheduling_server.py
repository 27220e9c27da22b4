"""The server with `--async-scheduling` (the GPU default; forced here on the CPU) answers
exactly as the one-step-at-a-time server does, a client that leaves mid-stream frees
everything, and SIGINT (Ctrl-C) stops it cleanly (last: it ends the server)."""

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import Server, start_server
from .test_engine_death import assert_clean_stop
from .test_lifecycle_metrics import ABORTED, idle

PROMPTS = ["Once upon a time", "The little dog", "Tell me a story about a cat who"]


@pytest.fixture(scope="module")
def async_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Same tokenizer and seed as the session `server`: the same random weights.
    running = start_server(tmp_path_factory, "llama3", None, ["--async-scheduling"])
    try:
        yield running
    finally:
        running.stop()


def answers(server: Server) -> list[Any]:
    client = server.client()
    results: list[Any] = []
    for prompt in PROMPTS:
        greedy = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=24, temperature=0, logprobs=2
        )
        results.append([(c.text, c.finish_reason, c.logprobs.tokens) for c in greedy.choices])
        seeded = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=16, temperature=0.9, seed=11, n=2
        )
        results.append(sorted((c.index, c.text) for c in seeded.choices))
        stream = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=16, temperature=0, stream=True,
            stop=[" the"],
        )  # fmt: skip
        results.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    return results


def test_answers_equal_the_synchronous_server(server: Server, async_server: Server) -> None:
    for running, state in ((async_server, "on"), (server, "off")):
        running.log_file.flush()
        assert f"async scheduling: {state}" in running.log_path.read_text()
    assert answers(async_server) == answers(server)


def test_disconnect_mid_stream_frees_everything(async_server: Server) -> None:
    async_server.wait_metrics(idle)
    before = async_server.metrics()
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    async_server.leave_mid_stream("/v1/completions", body)
    after = async_server.wait_metrics(idle, timeout_s=5.0)
    assert after[ABORTED] == before[ABORTED] + 1


def test_sigint_to_the_process_group_is_a_clean_stop(async_server: Server) -> None:
    """Ctrl-C in a terminal (test_engine_death.py sends SIGTERM to another server). Last in
    this module: the server is gone after it."""
    assert_clean_stop(async_server, signal.SIGINT)
