"""`pagedserve run-batch` (vLLM's `vllm run-batch`): an OpenAI batch file (JSON lines) run
through the server's own app in process, with no HTTP server."""

import argparse
import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any

from pagedserve.entrypoints.openai.serving import error_body

logger = logging.getLogger(__name__)

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")


def check_paths(input_file: str, output_file: str) -> None:
    """Raise ValueError (naming the path) for a URL, a missing input file or an output file
    whose folder does not exist: before the model loads."""
    for flag, path in (("--input-file", input_file), ("--output-file", output_file)):
        if "://" in path:
            raise ValueError(
                f"{flag} {path!r} is a URL; run-batch reads and writes local files only "
                "(download or upload it separately)"
            )
    if not Path(input_file).is_file():
        raise ValueError(f"--input-file {input_file!r} is not a file")
    folder = Path(output_file).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--output-file {output_file!r}: folder {str(folder)!r} does not exist")


def _result(
    custom_id: Any, status: int, body: dict[str, Any] | None, error: dict[str, Any] | None
) -> dict[str, Any]:
    """One output line (vLLM's BatchRequestOutput)."""
    return {
        "id": f"pagedserve-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": f"pagedserve-batch-{uuid.uuid4().hex}",
            "body": body,
        },
        "error": error,
    }


def _bad_line(custom_id: Any, message: str, param: str | None = None) -> dict[str, Any]:
    return _result(custom_id, 400, None, error_body(400, message, param))


def parse_line(line: str) -> tuple[Any, str, dict[str, Any]] | dict[str, Any]:
    """A batch input line as (custom_id, url, body), or the error entry that answers it."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return _bad_line(None, f"the line is not valid JSON: {e}")
    if not isinstance(request, dict):
        return _bad_line(None, "the line must be a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str):
        return _bad_line(custom_id, "custom_id must be a string", "custom_id")
    if request.get("method") != "POST":
        return _bad_line(custom_id, f"method must be POST, got {request.get('method')!r}", "method")
    url = request.get("url")
    if url not in SUPPORTED_URLS:
        supported = ", ".join(SUPPORTED_URLS)
        return _bad_line(custom_id, f"url {url!r} is not supported; use one of {supported}", "url")
    body = request.get("body")
    if not isinstance(body, dict):
        return _bad_line(custom_id, "body must be a JSON object", "body")
    if body.get("stream"):  # vLLM's message
        return _bad_line(custom_id, "Request must not be sent in stream mode", "body.stream")
    return custom_id, url, body


async def call_app(app: Any, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST `body` as JSON to the ASGI `app` at `path`; the status and the response body.
    The client stays connected until the response is complete."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode())],
    }  # fmt: skip
    done = asyncio.Event()
    sent_body = False
    status = 500
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": data, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return status, b"".join(chunks)


async def run_line(app: Any, line: str) -> dict[str, Any]:
    """The output entry of one input line, called on the FastAPI app of `pagedserve serve`
    (as ASGI) so that validation, defaults, outputs and errors are the server's: a success
    has the response in `response.body` and `error` null; a failure has `response.body` null
    and the server's error body (`{"error": {"message", "type", "param", "code"}}`) in
    `error`; a line that is no batch request gets such a 400 entry (the others still run)."""
    parsed = parse_line(line)
    if isinstance(parsed, dict):
        return parsed
    custom_id, url, body = parsed
    status, content = await call_app(app, url, body)
    try:
        answer = json.loads(content)
    except ValueError:
        answer = error_body(status, content.decode(errors="replace"))
    if status == 200:
        return _result(custom_id, status, answer, None)
    return _result(custom_id, status, None, answer)


async def run_batch(app: Any, lines: list[str], max_in_flight: int) -> list[dict[str, Any]]:
    """Run every line on `app`, at most `max_in_flight` at once; the entries in input order."""
    limit = asyncio.Semaphore(max_in_flight)

    async def bounded(line: str) -> dict[str, Any]:
        async with limit:
            return await run_line(app, line)

    return list(await asyncio.gather(*(bounded(line) for line in lines)))


def read_lines(path: str) -> list[str]:
    """The input file's non-blank lines, stripped (as vLLM reads them)."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def main(args: argparse.Namespace) -> int:
    """Load the engine, run the batch file, write the results; SystemExit on a bad flag."""
    from pagedserve.engine.arg_utils import engine_args_from_namespace
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.entrypoints.chat_media import MediaOptions

    from .api_server import build_app
    from .cli_args import resolve_server_args
    from .launch import read_chat_template

    args.api_key = []  # no key in process (resolve_server_args reads none from the env)
    args = resolve_server_args(args)
    try:
        check_paths(args.input_file, args.output_file)
        lines = read_lines(args.input_file)
        chat_template = read_chat_template(args.chat_template)
        engine = AsyncLLMEngine.from_engine_args(engine_args_from_namespace(args), log_stats=False)
    except (ValueError, NotImplementedError, OSError) as e:
        raise SystemExit(f"pagedserve run-batch: error: {e}") from None
    try:
        media = MediaOptions.of_model(
            engine.config.model_config, engine.input_processor.mm_processor
        )  # a LLaVA batch's chat requests may hold images, as the server's
        app = build_app(
            engine, args.served_model_name, chat_template=chat_template, model_root=args.model,
            media=media,
        )  # fmt: skip
        # as vLLM; each data-parallel engine core runs max_num_seqs of its own
        config = engine.config
        max_in_flight = (
            2 * config.scheduler_config.max_num_seqs * config.parallel_config.data_parallel_size
        )

        async def run() -> list[dict[str, Any]]:
            engine.start()
            try:
                return await run_batch(app, lines, max_in_flight)
            finally:
                engine.shutdown()  # on the loop: it cancels the engine's tasks

        results = asyncio.run(run())
    except ValueError as e:  # e.g. a reasoning parser whose markers the tokenizer lacks
        raise SystemExit(f"pagedserve run-batch: error: {e}") from None
    finally:
        engine.shutdown()  # idempotent; here for a failure before the loop ran
    with open(args.output_file, "w", encoding="utf-8") as f:
        for result in results:
            f.write(json.dumps(result) + "\n")
    failed = sum(result["error"] is not None for result in results)
    logger.info("wrote %d results (%d failed) to %s", len(results), failed, args.output_file)
    return 0
