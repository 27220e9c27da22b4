"""`bench serve`'s HTTP client: streamed requests on one aiohttp session (vLLM's
benchmark_serving client), timed per chunk.

aiohttp, not httpx: whenever a request starts or ends, httpcore 1.0's pool
(`_assign_requests_to_connections`) counts all connections once per idle connection,
O(connections^2) on the event loop; at 256 streams that blocked the loop ~5 ms each time and
the client, not the server, set the TTFT and throughput: against
benchmarks/mock_openai_server.py (51k tok/s offered), 3.9k tok/s and a 3 s median TTFT, 230 us
of client CPU per token; on aiohttp 28k-39k tok/s, 0.1 s, 15 us.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.entrypoints.bench.datasets import SampleRequest
from pagedserve.entrypoints.bench.serve_metrics import RequestOutput

try:
    import aiohttp
except ImportError:  # the `bench` extra
    aiohttp = None  # type: ignore[assignment]

AIOHTTP_MISSING = "pagedserve bench serve needs aiohttp: pip install 'pagedserve[bench]'"
# What a failed connection to the server raises (`bench serve` turns it into one line).
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    (aiohttp.ClientError, OSError) if aiohttp is not None else (OSError,)
)


def check_aiohttp() -> None:
    """Raise ImportError, saying what to install, when aiohttp (the `bench` extra) is missing."""
    if aiohttp is None:
        raise ImportError(AIOHTTP_MISSING)


def open_session(
    api_key: str | None, timeout_s: float, max_concurrency: int | None
) -> "aiohttp.ClientSession":
    """One session (one connection pool, one TLS context) for the whole run, as vLLM's client:
    at most `max_concurrency` connections (unlimited when None: the run's semaphore caps
    them), `timeout_s` per request. Call inside the running event loop.
    Raises ImportError (saying what to install) without aiohttp."""
    check_aiohttp()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # An idle connection is dropped after 4 s, before a server's own keep-alive timeout closes
    # it (uvicorn's default: 5 s): reusing one the server closed fails that request.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=4.0)
    return aiohttp.ClientSession(
        connector=connector,
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    )


async def get_json(url: str, api_key: str | None, timeout_s: float) -> Any:
    """GET `url` as JSON on a session of its own, closed after it. Raises
    aiohttp.ClientResponseError on an HTTP error status. Not the run's session: the tokenizer
    loads next, blocking the event loop past the server's keep-alive timeout, so the server's
    close of the idle connection went unseen and the first request, reusing it, failed
    ("Can not write request body")."""
    async with (
        open_session(api_key, timeout_s, 1) as session,
        session.get(url) as response,
    ):
        response.raise_for_status()
        return await response.json(content_type=None)


async def arrivals(
    requests: list[SampleRequest], request_rate: float, burstiness: float, seed: int
) -> AsyncIterator[int]:
    """vLLM's arrivals, as indices into `requests`: gaps drawn from a gamma distribution of
    shape `burstiness` and mean 1 / `request_rate` s (Poisson at burstiness 1); all at once
    at rate inf."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for i in range(len(requests)):
        yield i
        if request_rate != float("inf"):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (request_rate * burstiness)))


def request_payload(endpoint: str, body: dict[str, Any], request: SampleRequest) -> bytes:
    """The JSON body of one request: `body` plus its prompt (or chat message) and max_tokens."""
    payload = dict(body, max_tokens=request.expected_output_len)
    if endpoint.endswith("chat/completions"):
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    return json.dumps(payload, ensure_ascii=False).encode()


async def send_request(session: "aiohttp.ClientSession", url: str, payload: bytes) -> RequestOutput:
    """Stream one request (`payload`: its JSON body, from `request_payload`); time its first
    chunk with text (TTFT), the gaps between chunks with text (ITL) and its end (E2EL), as
    vLLM's client. Any failure is returned in `.error` (never raised), so one bad request
    neither stops the run nor goes unreported."""
    output = RequestOutput(start=time.perf_counter())
    last, chunks, texts = output.start, 0, []
    try:
        async with session.post(
            url, data=payload, headers={"Content-Type": "application/json"}
        ) as response:
            if response.status != 200:
                text = (await response.read())[:300].decode(errors="replace")
                output.error = f"HTTP {response.status}: {text}"
                return output
            async for line in sse_lines(response.content.iter_any()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    output.error = f"error event: {data['error']}"
                    return output
                if data.get("usage"):
                    output.output_tokens = data["usage"]["completion_tokens"]
                text = "".join(_text(choice) for choice in data.get("choices") or ())
                if not text:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    output.ttft = now - output.start
                else:
                    output.itl.append(now - last)
                last, chunks = now, chunks + 1
                texts.append(text)
        output.latency = time.perf_counter() - output.start
        output.output_tokens = output.output_tokens or chunks
        output.generated_text = "".join(texts)
        output.success = chunks > 0
        output.error = "" if chunks else "the stream ended with no text"
    except Exception as e:  # noqa: BLE001 (vLLM's client too: a failed request, not a crash)
        output.error = f"{type(e).__name__}: {e}" if str(e) else repr(e)
    return output


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a server-sent event stream, decoded: split at CRLF, LF or CR only (the SSE
    spec's line ends; bytes.splitlines splits at exactly these). str.splitlines (httpx's
    `aiter_lines`) also splits at U+2028, U+0085 and other Unicode breaks that JSON leaves
    raw inside strings, which broke a data line in two (a JSONDecodeError in a GPU run).
    A line is decoded whole, so a UTF-8 character torn across chunks stays intact."""
    buffer = b""
    async for chunk in chunks:
        if not chunk:
            continue
        buffer = buffer + chunk if buffer else chunk
        lines = buffer.splitlines(keepends=True)
        # An unfinished last line, or one ending in CR (maybe half a CRLF), waits.
        buffer = b"" if lines[-1].endswith(b"\n") else lines.pop()
        for line in lines:
            yield line.rstrip(b"\r\n").decode()
    if buffer:
        yield buffer.rstrip(b"\r\n").decode()


def _text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")


async def benchmark(
    session: "aiohttp.ClientSession",
    url: str,
    body: dict[str, Any],
    requests: list[SampleRequest],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
) -> tuple[list[RequestOutput], float]:
    """Send `requests` (each `body` plus its prompt and max_tokens) to `url` at the arrival
    rate, at most `max_concurrency` at once: (outputs in request order, seconds of the run).
    The JSON bodies are built before the clock starts."""
    payloads = [request_payload(url, body, request) for request in requests]
    semaphore = asyncio.Semaphore(max_concurrency or max(len(requests), 1))

    async def limited(i: int) -> RequestOutput:
        async with semaphore:
            return await send_request(session, url, payloads[i])

    start = time.perf_counter()
    tasks = []
    async for i in arrivals(requests, request_rate, burstiness, seed):
        tasks.append(asyncio.create_task(limited(i)))
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start
