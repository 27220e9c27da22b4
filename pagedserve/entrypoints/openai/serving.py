"""What the completion and chat handlers share: the engine protocol, errors, sending requests,
SSE framing and disconnect handling (sampling parameters: request_params.py; logprob formats:
serving_logprobs.py)."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Protocol

from fastapi import Request

from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.request_stream import RequestStream
from pagedserve.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    ServerShuttingDownError,
)
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

from .protocol import (
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
)

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What the server needs of an engine (AsyncLLMEngine, or a fake one in tests)."""

    @property
    def max_model_len(self) -> int: ...
    def get_tokenizer(self) -> Any: ...
    def start(self) -> None: ...
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> RequestStream: ...
    def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]: ...
    def abort_request(self, request_id: str) -> None: ...
    async def check_health(self) -> None: ...
    async def reset_prefix_cache(self) -> None: ...


class OpenAIError(Exception):
    """An error with its HTTP status, OpenAI `type` and the offending `param`."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.param = param


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    default = "InternalServerError" if status_code >= 500 else "BadRequestError"
    error_type = _ERROR_TYPES.get(status_code, default)
    info = ErrorInfo(message=message, type=error_type, param=param, code=status_code)
    return ErrorResponse(error=info).model_dump()


def to_openai_error(exc: Exception) -> OpenAIError:
    """Map engine errors to HTTP: bad input 400, overload 429, dead engine 503, else 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, str(exc), exc.param)
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(429, str(exc))
    if isinstance(exc, EngineDeadError):
        # The cause (a traceback, with the server's file paths) goes to the server log only.
        return OpenAIError(
            503,
            "the engine core has failed and cannot serve requests; restart the server (the "
            "server log has the cause)",
        )
    if isinstance(exc, ServerShuttingDownError):
        return OpenAIError(503, "the server is shutting down; send the request again")
    # A bug: the exception text may hold paths, prompts or other requests' state. The server
    # log gets it (with its traceback, where the error is caught); the client a plain line.
    return OpenAIError(500, "internal server error; the server log has the details")


def check_model(model: str | None, served_model_names: list[str]) -> None:
    if model is not None and model not in served_model_names:
        raise OpenAIError(
            404,
            f"The model `{model}` does not exist; this server serves {served_model_names}",
            "model",
        )


def add_requests(
    engine: Engine,
    request_id: str,
    prompts: list[PromptType],
    params: SamplingParams,
    priority: int = 0,
    cache_salt: str | None = None,
) -> list[RequestStream]:
    """Send one engine request per prompt, each with `priority` and `cache_salt` (vLLM's
    request fields; the engine checks them: InvalidRequestError naming the field); if one is
    refused, abort those already sent."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            if cache_salt is not None:
                prompt = {**(prompt if isinstance(prompt, Mapping) else {"prompt": prompt})}
                prompt["cache_salt"] = cache_salt
            streams.append(engine.add_request(f"{request_id}-{i}", prompt, params, priority))
    except BaseException:
        for stream in streams:
            engine.abort_request(stream.request_id)
        raise
    return streams


class DisconnectWatcher:
    """Until stopped, a client disconnect aborts the requests at once (freeing their KV
    blocks), even while they wait in the queue and nothing is being sent. Started before a
    streaming response is returned, so that a client gone before the body starts is seen."""

    def __init__(self, raw_request: Request, engine: Engine, streams: list[RequestStream]):
        self.engine = engine
        self.streams = streams
        self.task = asyncio.create_task(self._watch(raw_request))

    async def _watch(self, raw_request: Request) -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass
        self.abort_unfinished()

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            if not stream.finished:
                self.engine.abort_request(stream.request_id)

    def stop(self) -> None:
        """Stop watching; abort what has not finished (the response is over either way)."""
        self.task.cancel()
        self.abort_unfinished()


async def merge_streams(
    engine: Engine, streams: list[RequestStream]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        async for output in engine.iterate(streams[0]):
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def drain(index: int, stream: RequestStream) -> None:
        try:
            async for output in engine.iterate(stream):
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(drain(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def final_outputs(
    engine: Engine, streams: list[RequestStream], watcher: DisconnectWatcher
) -> list[RequestOutput]:
    """The final output of each of `streams` (FINAL_ONLY requests), in their order, for a
    whole (not streamed) response; stops `watcher` however it ends. Raises OpenAIError 499
    when a request ended unfinished or aborted: the client left, nobody reads the answer."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in merge_streams(engine, streams):
            finals[index] = output
    finally:
        watcher.stop()
    outputs = list(finals.values())
    # An abort (the client left) ends a request with a final output too: never answer it.
    aborted = any(c.finish_reason == "abort" for o in outputs for c in o.outputs)
    if len(finals) < len(streams) or not all(o.finished for o in outputs) or aborted:
        raise OpenAIError(499, "the client disconnected")  # nobody reads this
    return [finals[i] for i in range(len(finals))]


def usage_info(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    """OpenAI's `usage` of a response (tokens of the prompts, of the returned choices)."""
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def stream_end(
    chunk_class: type[CompletionStreamResponse] | type[ChatCompletionStreamResponse],
    request_id: str,
    created: int,
    model: str,
    usage: UsageInfo | None,
) -> Iterator[str]:
    """The last events of a stream: with `usage` (the client asked for
    `stream_options.include_usage`) a chunk of no choices that carries it, as OpenAI sends;
    then [DONE]."""
    if usage is not None:
        chunk = chunk_class(id=request_id, created=created, model=model, choices=[], usage=usage)
        yield sse(chunk)
    yield SSE_DONE


def sse(payload: Any, include_usage: bool = True) -> str:
    """One server-sent event of a pydantic model or a dict. Chunks carry `usage` (null until
    the last) only when the client asked for `stream_options.include_usage`, as OpenAI does."""
    if hasattr(payload, "model_dump_json"):
        exclude = None if include_usage else {"usage"}
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: Exception) -> Iterator[str]:
    """How a stream that already sent its headers reports an error, then ends."""
    error = to_openai_error(exc)
    if error.status_code == 500:
        logger.error("stream failed", exc_info=exc)
    yield sse(error_body(error.status_code, str(error), error.param))
    yield SSE_DONE


async def guarded_stream(
    events: AsyncIterator[str], watcher: DisconnectWatcher
) -> AsyncIterator[str]:
    """SSE body: the events, an error event if generation fails, and always, however the
    stream ends (finished, failed, client gone), stop watching and abort what is unfinished."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        for event in sse_error(e):
            yield event
    finally:
        watcher.stop()
