"""POST /v1/chat/completions: chat template, then generation, whole or as SSE deltas."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.async_engine import RequestStream
from pagedserve.engine.input_processor import check_prompt_chars
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, RequestOutput

from .protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from .serving import (
    SSE_DONE,
    DisconnectWatcher,
    Engine,
    OpenAIError,
    add_requests,
    chat_logprobs,
    check_model,
    guarded_stream,
    merge_streams,
    sampling_params,
    sse,
)

logger = logging.getLogger(__name__)


def chat_template_error(exc: Exception) -> OpenAIError:
    """The 400 of a chat template that failed on a request's messages. Only a template's own
    `raise_exception("...")` (a plain jinja2 TemplateError) is worded for users, so only its
    message is passed on; any other error (a missing field, a type error, a bad keyword in
    chat_template_kwargs) names internal functions and variables: it goes to the log."""
    import jinja2

    if type(exc) is jinja2.TemplateError:
        return OpenAIError(400, f"the chat template refused these messages: {exc}", "messages")
    logger.info("chat template failed: %r", exc)
    return OpenAIError(
        400,
        "the chat template could not render these messages; check their roles and content, "
        "and chat_template_kwargs",
        "messages",
    )


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> tuple[str, list[int]]:
    """The prompt text and token ids of a conversation.

    `max_model_len` (None: no check) refuses texts too long to fit before encoding them.
    The text is encoded without adding special tokens: the template already holds any BOS
    (encoding it again would double it), so the ids equal `apply_chat_template(...,
    tokenize=True)`. With `continue_final_message` the last (assistant) message is left open
    and no generation prompt is added.
    """
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise OpenAIError(
            400,
            "this model's tokenizer has no chat template; start the server with "
            "--chat-template FILE, or use /v1/completions",
            "messages",
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise OpenAIError(
            400,
            "continue_final_message needs the last message to be from the assistant, "
            f"got {messages[-1].role!r}",
            "continue_final_message",
        )
    conversation = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # the template refused these messages
        raise chat_template_error(e) from e
    if max_model_len is not None:  # refuse megabytes before tokenizing them
        check_prompt_chars(tokenizer, text, max_model_len, "messages")
    return text, list(tokenizer.encode(text, add_special_tokens=False))


class OpenAIServingChat:
    def __init__(
        self, engine: Engine, served_model_names: list[str], chat_template: str | None
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.chat_template = chat_template
        self.tokenizer = engine.get_tokenizer()

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        check_model(request.model, self.served_model_names)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if request.chat_template is not None:  # vLLM without --trust-request-chat-template
            raise OpenAIError(
                400,
                "a chat_template in the request is not accepted (a template runs code on the "
                "server); start the server with --chat-template instead",
                "chat_template",
            )
        text, token_ids = await asyncio.to_thread(  # off the event loop, as for completions
            render_chat,
            self.tokenizer,
            request.messages,
            self.chat_template,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            None if request.truncate_prompt_tokens is not None else self.engine.max_model_len,
        )
        max_tokens = request.max_completion_tokens
        if max_tokens is None:  # not `or`: max_completion_tokens=0 is an error, not "unset"
            max_tokens = request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, max_tokens, logprobs)
        request_id = random_id("chatcmpl")
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        try:
            streams = add_requests(self.engine, request_id, [prompt], params)
        except InvalidRequestError as e:  # the engine's field names, in chat's words
            if e.param == "prompt":
                e.param = "messages"
            elif e.param == "max_tokens" and request.max_completion_tokens is not None:
                e.param = "max_completion_tokens"
            raise
        created = int(time.time())
        watcher = DisconnectWatcher(raw_request, self.engine, streams)
        if request.stream:
            body = guarded_stream(self._stream(request, request_id, created, streams), watcher)
            return StreamingResponse(body, media_type="text/event-stream")
        final = None
        try:
            async for _, output in merge_streams(self.engine, streams):
                final = output
        finally:
            watcher.stop()
        if final is None or not final.finished:
            raise OpenAIError(499, "the client disconnected")  # nobody reads this
        return self._response(request, request_id, created, final)

    def _logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs or completion.logprobs is None:
            return None
        content = chat_logprobs(
            completion.token_ids, completion.logprobs, request.top_logprobs or 0
        )
        return ChatCompletionLogProbs(content=content)

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        output: RequestOutput,
    ) -> ChatCompletionResponse:
        choices = [
            ChatCompletionResponseChoice(
                index=completion.index,
                message=ChatResponseMessage(role="assistant", content=completion.text),
                logprobs=self._logprobs(request, completion),
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            )
            for completion in output.outputs
        ]
        num_prompt_tokens = len(output.prompt_token_ids)
        num_completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        usage = UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
        )
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        """Role first (one chunk per choice), then content deltas, finish_reason last."""
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices
            )
            return sse(response, include_usage)

        for index in range(request.n):
            role = DeltaMessage(role="assistant", content="")
            yield chunk([ChatCompletionStreamChoice(index=index, delta=role)])
        num_prompt_tokens = 0
        num_completion_tokens = 0
        finished: set[int] = set()
        async for _, output in merge_streams(self.engine, streams):
            num_prompt_tokens = len(output.prompt_token_ids)
            for completion in output.outputs:
                if completion.index in finished:
                    continue  # a DELTA output repeats finished sequences
                num_completion_tokens += len(completion.token_ids)
                done = completion.finish_reason is not None
                if done:
                    finished.add(completion.index)
                if not (completion.text or completion.token_ids or done):
                    continue
                choice = ChatCompletionStreamChoice(
                    index=completion.index,
                    delta=DeltaMessage(content=completion.text),
                    logprobs=self._logprobs(request, completion),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
                yield chunk([choice])
        if include_usage:
            usage = UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=num_completion_tokens,
                total_tokens=num_prompt_tokens + num_completion_tokens,
            )
            final = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=[], usage=usage
            )
            yield sse(final)
        yield SSE_DONE
