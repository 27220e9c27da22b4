"""`bench serve`'s reading of a server-sent event stream: lines end at CRLF, LF or CR only,
so a generated text with U+2028 or U+0085 (left raw by JSON) stays inside its data line."""

import asyncio
import json
import time
from collections.abc import AsyncIterator

from pagedserve.entrypoints.bench.datasets import SampleRequest
from pagedserve.entrypoints.bench.serve_client import (
    open_session,
    request_payload,
    send_request,
    sse_lines,
)
from pagedserve.entrypoints.bench.serve_metrics import RequestOutput


async def _chunks(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def lines_of(parts: list[bytes]) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in sse_lines(_chunks(parts))]

    return asyncio.run(collect())


def test_line_ends_are_crlf_lf_and_cr_only() -> None:
    text = "data: a\u2028b\x85c\r\n\r\ndata: d\ne\rf".encode()
    expected = ["data: a\u2028b\x85c", "", "data: d", "e", "f"]
    assert lines_of([text]) == expected
    # The same split into every pair of chunks: a CRLF and UTF-8 characters torn in two.
    for cut in range(len(text) + 1):
        assert lines_of([text[:cut], text[cut:]]) == expected, cut
    assert lines_of([b"x\r"]) == ["x"] and lines_of([]) == []


async def serve_once(body: bytes, status: str = "200 OK") -> tuple[asyncio.Server, int]:
    """A one-response HTTP/1.1 server on a free port: reads a request, answers `body`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = [int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                  if k.lower() == b"content-length"]  # fmt: skip
        await reader.readexactly(length[0] if length else 0)
        writer.write(f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\n".encode())
        writer.write(b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def stream_of(body: bytes, status: str = "200 OK") -> RequestOutput:
    """send_request's output for a server that answers `body`."""

    async def run() -> RequestOutput:
        server, port = await serve_once(body, status)
        async with server, open_session(None, 30.0, None) as session:
            request = SampleRequest(prompt="Hi", prompt_len=1, expected_output_len=3)
            payload = request_payload("/v1/completions", {"model": "m"}, request)
            return await send_request(session, f"http://127.0.0.1:{port}/v1/completions", payload)

    return asyncio.run(run())


def test_a_streamed_token_with_a_unicode_line_separator() -> None:
    """A completion stream whose second token is U+2028 (JSON: raw, not escaped): three
    chunks of text, none lost to a broken line."""
    texts = ["Hello", "\u2028", " world"]
    events = [json.dumps({"choices": [{"text": t}]}, ensure_ascii=False) for t in texts]
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 3}})
    body = "".join(f"data: {e}\n\n" for e in [*events, usage]) + "data: [DONE]\n\n"
    output = stream_of(body.encode())
    assert output.error == "" and output.success
    assert output.generated_text == "Hello\u2028 world"
    assert output.output_tokens == 3 and len(output.itl) == 2


def test_failed_streams_carry_their_error() -> None:
    """An HTTP error, an error event after the headers, a stream with no text and a broken
    JSON line each fail with a reason (once silent: one failed request, no text printed)."""
    output = stream_of(b'{"error": {"message": "prompt too long"}}', "400 Bad Request")
    assert not output.success and output.error.startswith("HTTP 400") and "too long" in output.error
    output = stream_of(b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n')
    assert not output.success and "engine died" in output.error
    output = stream_of(b"data: [DONE]\n\n")
    assert not output.success and output.error == "the stream ended with no text"
    output = stream_of(b"data: {not json\n\n")
    assert not output.success and output.error.startswith("JSONDecodeError")


def test_first_request_after_a_blocked_loop_and_a_closed_keep_alive() -> None:
    """bench serve GETs /v1/models, then loads the tokenizer (the event loop blocked) past the
    server's keep-alive timeout; the server closed that idle connection unseen, and the first
    request, reusing it, failed ("Can not write request body"). The GET now has its own session."""
    from pagedserve.entrypoints.bench.serve_client import get_json

    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 1}})
    stream = f'data: {{"choices": [{{"text": "x"}}]}}\n\ndata: {usage}\n\ndata: [DONE]\n\n'

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive requests until idle 0.1 s (uvicorn: 5 s), then close
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.1)
            except (TimeoutError, asyncio.IncompleteReadError):
                break
            length = [int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                      if k.lower() == b"content-length"]  # fmt: skip
            await reader.readexactly(length[0] if length else 0)
            body = b'{"data": [{"id": "m"}]}' if head.startswith(b"GET") else stream.encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    async def run() -> RequestOutput:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, open_session(None, 30.0, None) as session:
            assert (await get_json(f"{url}/v1/models", None, 30.0))["data"][0]["id"] == "m"
            time.sleep(0.5)  # the tokenizer's load: the loop sees no close meanwhile
            request = SampleRequest(prompt="Hi", prompt_len=1, expected_output_len=1)
            payload = request_payload("/v1/completions", {"model": "m"}, request)
            return await send_request(session, f"{url}/v1/completions", payload)

    output = asyncio.run(run())
    assert output.error == "" and output.success and output.generated_text == "x"
