"""Fixtures: the server's app in process, with a fake engine or the real one; tiny random Llama
models with real tokenizers, and the real server as a subprocess.

Where a test can, it uses the app in process (in_process.py): `fake_app` (a FakeEngine with
the Llama 3 tokenizer: the real tokenizing, validation, detokenizing and stop strings, a
script in place of the model; new for each test, milliseconds to make) for what the server
does with requests, and `real_engine` (one real AsyncLLMEngine on the bundled stories260k,
max_model_len 128, shared by the session) where a real model matters.

The real-process `server` (session-scoped, so it starts once) uses the Llama 3 tokenizer,
whose chat template holds the BOS token, and requires an API key; it is for what only a
process shows (start-up, metrics, uvicorn's disconnects, concurrency); tests that stop the
server or kill its engine core start their own. Every wait has a timeout so that nothing can
hang CI.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import load_tokenizer

from .fake_engine import FakeEngine
from .in_process import AppLoop, InProcessApp, ServerCalls, parse_sse

REPO = Path(__file__).resolve().parents[3]
TOKENIZERS = REPO.parent / "shared" / "tokenizers"
API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 180.0


def build_tiny_model(path: Path, tokenizer_name: str) -> Path:
    """A 2-layer Llama with hidden size 64, random weights and a real tokenizer's vocabulary.
    A large initializer range makes the logits peaked, so greedy choices have no near-ties."""
    tokenizer_dir = TOKENIZERS / tokenizer_name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server(ServerCalls):
    """A running `python -m pagedserve.entrypoints.openai.api_server` and ways to talk to it."""

    def __init__(self, model: Path, log_path: Path, api_key: str | None, args: list[str]):
        self.model = str(model)
        self.api_key = api_key
        self.port = free_port()
        scheme = "https" if "--ssl-certfile" in args else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "pagedserve.entrypoints.openai.api_server",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(16 * 2**20), "--block-size", "16",
            "--uvicorn-log-level", "warning", "--stats-log-interval", "1",
            *(["--api-key", api_key] if api_key else []), *args,
        ]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.log_file = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self.log_file, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends the core with it
        )  # fmt: skip
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                pytest.fail(f"the server exited ({self.process.returncode}):\n{self.log()}")
            try:
                # (a TLS test's certificate is checked by the test itself)
                health = httpx.get(f"{self.url}/health", timeout=1.0, verify=False)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"the server did not become healthy in {STARTUP_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text()[-5000:]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
            timeout=kwargs.pop("timeout", 60.0), **kwargs,
        )  # fmt: skip

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
            timeout=kwargs.pop("timeout", 120.0), **kwargs,
        )  # fmt: skip

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("headers", self.headers)
        kwargs.setdefault("timeout", 60.0)
        return httpx.post(f"{self.url}{path}", json=body, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        kwargs.setdefault("headers", self.headers)
        kwargs.setdefault("timeout", 30.0)
        return httpx.get(f"{self.url}{path}", **kwargs)

    def leave_mid_stream(self, path: str, body: Any, num_events: int = 4) -> None:
        """Open a streaming request, read `num_events` SSE events (checking that it is still
        running), then disconnect."""
        url = f"{self.url}{path}"
        with httpx.stream("POST", url, json=body, headers=self.headers, timeout=30) as response:
            assert response.status_code == 200
            # Keep the iterator referenced: dropping it would close the connection right away.
            lines = response.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data: ")
                if seen == num_events:
                    break
            assert self.metrics()["pagedserve:num_requests_running"] >= 1  # still generating

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{labels}": value}, without the model_name label."""
        response = httpx.get(f"{self.url}/metrics", timeout=30.0)
        assert response.status_code == 200
        values = {}
        for line in response.text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            key, value = line.rsplit(" ", 1)
            key = key.replace(f'model_name="{self.model}"', "").replace("{,", "{")
            key = key.replace(",}", "}").replace("{}", "")
            values[key] = float(value)
        return values

    def wait_metrics(self, predicate: Any, timeout_s: float = 10.0) -> dict[str, float]:
        """Poll /metrics until `predicate(metrics)` holds; fail after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = self.metrics()
            if predicate(values):
                return values
            if time.monotonic() > deadline:
                pytest.fail(f"metrics never matched: {json.dumps(values, indent=1)[:3000]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)
        # the engine core may outlive the server by up to a second: make sure it is gone
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.log_file.close()


_TINY_MODELS: dict[str, Path] = {}  # by tokenizer name: servers only read their model folder


def start_server(
    tmp_factory: pytest.TempPathFactory, tokenizer_name: str, api_key: str | None, args: list[str]
) -> Server:
    if tokenizer_name not in _TINY_MODELS:
        folder = tmp_factory.mktemp(f"tiny-llama-{tokenizer_name}")
        _TINY_MODELS[tokenizer_name] = build_tiny_model(folder / "model", tokenizer_name)
    log_path = tmp_factory.mktemp(f"server-{tokenizer_name}") / "server.log"
    return Server(_TINY_MODELS[tokenizer_name], log_path, api_key, args)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tmp_path_factory, "llama3", API_KEY, [])
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Start another server: `server_factory(tokenizer_name, api_key, args)`; stop it yourself."""

    def start(tokenizer_name: str, api_key: str | None = None, args: list[str] = ()) -> Server:
        return start_server(tmp_path_factory, tokenizer_name, api_key, list(args))

    return start


@pytest.fixture(scope="session")
def sse() -> Any:
    return parse_sse


FAKE_MODEL = "fake-model"
REAL_MAX_MODEL_LEN = 128


@cache
def shared_tokenizer(name: str) -> Any:
    """A tokenizer of ../shared/tokenizers, or "stories260k" (the bundled model's), loaded once
    per session as the engine loads it."""
    return load_tokenizer(DEFAULT_MODEL if name == "stories260k" else str(TOKENIZERS / name))


@pytest.fixture(scope="session")
def app_loop() -> Iterator[AppLoop]:
    """The event loop (in a thread) of every in-process app and engine."""
    loop = AppLoop()
    try:
        yield loop
    finally:
        loop.close()


@pytest.fixture
def fake_app_factory(app_loop: AppLoop) -> Iterator[Callable[..., InProcessApp]]:
    """`make(tokenizer="llama3", api_key=None, engine=dict(FakeEngine options), **build_app
    options)`: an app on a new FakeEngine. After the test, no request may still run: each
    one finished, or was aborted (a client gone, a failure)."""
    made: list[InProcessApp] = []

    def make(
        tokenizer: str = "llama3",
        api_key: str | None = None,
        engine: dict[str, Any] | None = None,
        **app_kwargs: Any,
    ) -> InProcessApp:
        fake = FakeEngine(shared_tokenizer(tokenizer), **(engine or {}))
        app = InProcessApp(app_loop, fake, FAKE_MODEL, api_key, **app_kwargs)
        made.append(app)
        return app

    yield make
    for app in made:
        app_loop.loop.call_soon_threadsafe(app.engine.shutdown)
        assert app.engine.running() == [], "requests left running"


@pytest.fixture
def fake_app(fake_app_factory: Callable[..., InProcessApp]) -> InProcessApp:
    """The app on a new FakeEngine with the Llama 3 tokenizer (and its chat template)."""
    return fake_app_factory()


@pytest.fixture(scope="session")
def real_engine(app_loop: AppLoop) -> Iterator[AsyncLLMEngine]:
    """One real AsyncLLMEngine (its engine core in its own process) on the bundled
    stories260k, max_model_len 128; build apps on it with `InProcessApp(app_loop, ...)`."""
    args = EngineArgs(
        device="cpu", max_model_len=REAL_MAX_MODEL_LEN, kv_cache_memory_bytes=8 * 2**20
    )
    engine = AsyncLLMEngine.from_engine_args(args, log_stats=False)

    async def shutdown() -> None:  # on its loop: it cancels the engine's tasks
        engine.shutdown()

    try:
        yield engine
    finally:
        app_loop.run(shutdown())
