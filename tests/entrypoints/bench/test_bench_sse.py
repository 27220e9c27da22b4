"""`bench serve`'s reading of a server-sent event stream: lines end at CRLF, LF or CR only,
so a generated text with U+2028 or U+0085 (left raw by JSON) stays inside its data line."""

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from pagedserve.entrypoints.bench.datasets import SampleRequest
from pagedserve.entrypoints.bench.serve import send_request, sse_lines


async def _chunks(parts: list[str]) -> AsyncIterator[str]:
    for part in parts:
        yield part


def lines_of(parts: list[str]) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in sse_lines(_chunks(parts))]

    return asyncio.run(collect())


def test_line_ends_are_crlf_lf_and_cr_only() -> None:
    text = "data: a\u2028b\x85c\r\n\r\ndata: d\ne\rf"
    expected = ["data: a\u2028b\x85c", "", "data: d", "e", "f"]
    assert lines_of([text]) == expected
    # The same split into every pair of chunks, a CRLF torn in two included.
    for cut in range(len(text) + 1):
        assert lines_of([text[:cut], text[cut:]]) == expected, cut
    assert lines_of(["x\r"]) == ["x"] and lines_of([]) == []


def test_a_streamed_token_with_a_unicode_line_separator() -> None:
    """A completion stream whose second token is U+2028 (JSON: raw, not escaped): three
    chunks of text, none lost to a broken line."""
    texts = ["Hello", "\u2028", " world"]
    events = [json.dumps({"choices": [{"text": t}]}, ensure_ascii=False) for t in texts]
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 3}})
    body = "".join(f"data: {e}\n\n" for e in [*events, usage]) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, content=body.encode(), headers={"content-type": "text/event-stream"}
        )

    async def run() -> object:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            request = SampleRequest(prompt="Hi", prompt_len=1, expected_output_len=3)
            return await send_request(client, "/v1/completions", {"model": "m"}, request)

    output = asyncio.run(run())
    assert output.error == "" and output.success  # type: ignore[attr-defined]
    assert output.generated_text == "Hello\u2028 world"  # type: ignore[attr-defined]
    assert output.output_tokens == 3 and len(output.itl) == 2  # type: ignore[attr-defined]
