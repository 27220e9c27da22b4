"""A fast mock of an OpenAI-compatible server's streamed `/v1/completions`, to measure a
benchmark client (`pagedserve bench serve`) alone: how many streamed tokens per second it
can take before its own time, not the server's, sets the numbers.

Like an engine, one clock ticks every `--token-interval-ms`; each tick writes one SSE chunk
(one token, pre-encoded bytes) to every stream in flight, so N streams are offered
N / interval tokens per s. A stream ends after `max_tokens` chunks with the usage chunk and
[DONE], in our server's format (pagedserve/entrypoints/openai/serving_completion.py:
chunked transfer encoding, `data: {...}\\n\\n` events). Per-chunk work is one
`transport.write` of a prebuilt bytes object: a raw asyncio HTTP/1.1 server, no framework.

  python benchmarks/mock_openai_server.py --port 8011 --token-interval-ms 5 &
  pagedserve bench serve --port 8011 --tokenizer pagedserve/assets/stories260k \\
      --num-prompts 768 --max-concurrency 256 --random-input-len 1024 \\
      --random-output-len 128 --ignore-eos

`--fail-every K` answers every K-th completion request with an error event in its stream
(as our server reports an error after the headers), to test that clients report it.
"""

import argparse
import asyncio
import json
import time
from typing import Any

MODEL = "mock"


def _event(payload: dict[str, Any]) -> bytes:
    """One SSE event as one HTTP chunk (chunked transfer encoding)."""
    data = f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
    return b"%x\r\n%s\r\n" % (len(data), data)


def _completion_chunk(text: str | None, finish: str | None, usage: Any = None) -> dict[str, Any]:
    choices = (
        []
        if text is None
        else [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        ]
    )
    return {
        "id": "cmpl-mock",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": choices,
        "usage": usage,
    }


TOKEN = _event(_completion_chunk(" tok", None))
LAST_TOKEN = _event(_completion_chunk(" tok", "length"))
DONE = b"%x\r\n%s\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")
ERROR = _event({"error": {"message": "mock failure", "type": "InternalServerError", "code": 500}})
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL}]}
).encode()


class Stream:
    """One streamed completion: its connection and tokens still to send."""

    def __init__(self, transport: asyncio.Transport, tokens: int, prompt_tokens: int) -> None:
        self.transport, self.left, self.sent, self.prompt_tokens = (
            transport,
            tokens,
            0,
            prompt_tokens,
        )


class MockServer:
    """The request parser (one asyncio.Protocol per connection) and the token clock."""

    def __init__(self, interval_s: float, fail_every: int) -> None:
        self.interval_s, self.fail_every = interval_s, fail_every
        self.streams: list[Stream] = []
        self.requests = self.tokens_sent = 0
        self.wake = asyncio.Event()

    async def clock(self) -> None:
        """Every tick, one token to each stream; idle until a stream starts."""
        next_tick = time.perf_counter()
        while True:
            if not self.streams:
                self.wake.clear()
                await self.wake.wait()
                next_tick = time.perf_counter()
            next_tick += self.interval_s
            await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
            alive = []
            for s in self.streams:
                if s.transport.is_closing():
                    continue
                s.left -= 1
                s.sent += 1
                self.tokens_sent += 1
                if s.left > 0:
                    s.transport.write(TOKEN)
                    alive.append(s)
                    continue
                usage = {
                    "prompt_tokens": s.prompt_tokens,
                    "completion_tokens": s.sent,
                    "total_tokens": s.prompt_tokens + s.sent,
                }
                s.transport.write(
                    LAST_TOKEN + _event(_completion_chunk(None, None, usage)) + DONE + b"0\r\n\r\n"
                )
            self.streams = alive

    def start(self, transport: asyncio.Transport, path: str, body: bytes) -> None:
        if path.startswith("/v1/models"):
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            )
            transport.write(head % len(MODELS) + MODELS)
            return
        if not path.startswith("/v1/completions"):
            transport.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            return
        request = json.loads(body)
        self.requests += 1
        transport.write(STREAM_HEAD)
        if self.fail_every and self.requests % self.fail_every == 0:
            transport.write(ERROR + DONE + b"0\r\n\r\n")
            return
        prompt = request.get("prompt", "")
        self.streams.append(Stream(transport, int(request.get("max_tokens") or 16), len(prompt)))
        self.wake.set()


class Connection(asyncio.Protocol):
    """HTTP/1.1 keep-alive requests with a content-length body, in order."""

    def __init__(self, server: MockServer) -> None:
        self.server, self.buffer = server, b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self.server.start(self.transport, head[0].split(" ")[1], body)


async def serve(host: str, port: int, interval_s: float, fail_every: int) -> None:
    """Serve until cancelled; prints the tokens sent and the process CPU time every 10 s."""
    server = MockServer(interval_s, fail_every)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: Connection(server), host, port, backlog=4096)
    clock = asyncio.create_task(server.clock())
    print(
        f"mock OpenAI server on http://{host}:{port}, a token every {interval_s * 1e3:g} ms",
        flush=True,
    )
    try:
        last_tokens, last_cpu = 0, time.process_time()
        while True:
            await asyncio.sleep(10.0)
            cpu = time.process_time()
            if server.tokens_sent != last_tokens:
                rate = (server.tokens_sent - last_tokens) / 10
                share = 100 * (cpu - last_cpu) / 10
                line = f"streams {len(server.streams)}, tokens/s {rate:.0f}, CPU {share:.0f}%"
                print(line, flush=True)
            last_tokens, last_cpu = server.tokens_sent, cpu
    finally:
        clock.cancel()
        listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--token-interval-ms", type=float, default=5.0, help="ms between tokens")
    parser.add_argument("--fail-every", type=int, default=0, help="every K-th request fails")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.token_interval_ms / 1e3, args.fail_every))


if __name__ == "__main__":
    main()
