"""POST /v1/chat/completions: chat template, then generation, whole or as SSE deltas."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.logprob_text import LogprobBytes
from pagedserve.engine.request_stream import RequestStream
from pagedserve.entrypoints.chat_media import ChatPrompt, MediaOptions, load_chat_images
from pagedserve.entrypoints.chat_utils import render_chat
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, RequestOutput

from .chat_output import ChatOutputParser, apply_tool_params, check_tool_request
from .protocol import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    TokenizeChatRequest,
    random_id,
)
from .request_params import default_max_tokens_of, sampling_params
from .serving import (
    DisconnectWatcher,
    Engine,
    OpenAIError,
    add_requests,
    check_model,
    final_outputs,
    guarded_stream,
    merge_streams,
    sse,
    stream_end,
    usage_info,
)
from .serving_beam import beam_search_outputs, beam_search_params, check_beam_search
from .serving_logprobs import chat_logprobs, check_prompt_logprobs, prompt_logprobs_json

logger = logging.getLogger(__name__)

# A request asking for nothing but the text: checks that a reasoning parser can be made.
_PLAIN_REQUEST = ChatCompletionRequest.model_validate({"messages": [{"role": "user"}]})
TEXT_ONLY = MediaOptions()  # a text-only model: image parts are refused


def chat_prompt(
    tokenizer: Any,
    request: ChatCompletionRequest | TokenizeChatRequest,
    chat_template: str | None,
    max_model_len: int | None = None,
    media: MediaOptions = TEXT_ONLY,
) -> ChatPrompt:
    """The prompt text, token ids and images of a chat request (`chat_media.load_chat_images`
    then `chat_utils.render_chat`, shared with the offline `LLM.chat`; their
    InvalidRequestError is a 400), for /v1/chat/completions and /tokenize alike.
    `max_model_len` (None: no check) refuses texts too long to fit before encoding them.
    `media`: whether the model takes images (OpenAI's image_url parts) and from where. A
    template in the request is a 400 (as vLLM without --trust-request-chat-template): a
    template runs code on the server. Runs in a thread: it may fetch http(s) images."""
    if request.chat_template is not None:
        raise OpenAIError(
            400,
            "a chat_template in the request is not accepted (a template runs code on the "
            "server); start the server with --chat-template instead",
            "chat_template",
        )
    messages = [message.model_dump(exclude_none=True) for message in request.messages]
    messages, images = load_chat_images(messages, media)
    text, token_ids = render_chat(
        tokenizer,
        messages,
        media.chat_template(tokenizer, chat_template),
        request.add_generation_prompt,
        request.continue_final_message,
        request.chat_template_kwargs,
        request.add_special_tokens,
        max_model_len,
        [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        image_placeholder=media.image_placeholder,
    )
    return ChatPrompt(text, token_ids, images)


class OpenAIServingChat:
    def __init__(
        self,
        engine: Engine,
        served_model_names: list[str],
        chat_template: str | None,
        default_sampling_params: dict[str, Any] | None = None,
        *,
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        media: MediaOptions = TEXT_ONLY,
    ) -> None:
        """enable_auto_tools, tool_parser: the server's --enable-auto-tool-choice and
        --tool-call-parser; reasoning_parser: --reasoning-parser (None: none); media: the
        model's image support (--limit-mm-per-prompt, --allowed-local-media-path). Raises
        ValueError when the tokenizer lacks the reasoning parser's marker tokens."""
        self.engine = engine
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.media = media
        # The model's generation-config defaults (vLLM's default_sampling_params).
        self.default_sampling_params = default_sampling_params or {}
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.chat_template = chat_template
        self.tokenizer = engine.get_tokenizer()
        if reasoning_parser is not None:  # a tokenizer without its markers: fail at start-up
            ChatOutputParser(self.tokenizer, _PLAIN_REQUEST, reasoning_parser, None, False)

    def _output_parser(self, request: ChatCompletionRequest) -> ChatOutputParser:
        """A new parser of one choice's output (reasoning, tool calls)."""
        return ChatOutputParser(
            self.tokenizer, request, self.reasoning_parser, self.tool_parser,
            self.enable_auto_tools,
        )  # fmt: skip

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Any:
        check_model(request.model, self.served_model_names)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        check_prompt_logprobs(request)
        check_tool_request(request, self.enable_auto_tools, self.tool_parser)
        check_beam_search(request)
        chat = await asyncio.to_thread(  # off the event loop, as for completions
            chat_prompt,
            self.tokenizer,
            request,
            self.chat_template,
            None if request.truncate_prompt_tokens is not None else self.engine.max_model_len,
            self.media,
        )
        if chat.images and request.use_beam_search:
            raise OpenAIError(
                400,
                "use_beam_search does not support images yet (its steps are token-id prompts, "
                "which would drop them); sample without beam search",
                "use_beam_search",
            )
        defaults = self.default_sampling_params
        max_tokens = request.max_completion_tokens
        if max_tokens is None:  # not `or`: max_completion_tokens=0 is an error, not "unset"
            max_tokens = request.max_tokens
        if max_tokens is None:  # the generation config's max_new_tokens, else the context
            max_tokens = default_max_tokens_of(defaults)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(
            request, max_tokens, logprobs, prompt_logprobs=request.prompt_logprobs,
            defaults=defaults,
        )  # fmt: skip
        apply_tool_params(request, params, self.enable_auto_tools and bool(self.tool_parser))
        request_id = random_id("chatcmpl")
        prompt = chat.engine_prompt()
        try:
            if request.use_beam_search:
                beam = beam_search_params(request, max_tokens, defaults)
                [final] = await beam_search_outputs(
                    self.engine, request_id, [prompt], beam, raw_request, request.priority,
                    request.cache_salt, request.truncate_prompt_tokens,
                    request.skip_special_tokens,
                )  # fmt: skip
                return self._response(request, request_id, int(time.time()), final)
            streams = add_requests(
                self.engine, request_id, [prompt], params, request.priority, request.cache_salt
            )
        except InvalidRequestError as e:  # the engine's field names, in chat's words
            if e.param in ("prompt", "multi_modal_data"):
                e.param = "messages"
            elif e.param == "max_tokens" and request.max_completion_tokens is not None:
                e.param = "max_completion_tokens"
            raise
        created = int(time.time())
        watcher = DisconnectWatcher(raw_request, self.engine, streams)
        if request.stream:
            body = guarded_stream(self._stream(request, request_id, created, streams), watcher)
            return StreamingResponse(body, media_type="text/event-stream")
        [final] = await final_outputs(self.engine, streams, watcher)
        return self._response(request, request_id, created, final)

    def _logprobs(
        self,
        request: ChatCompletionRequest,
        completion: CompletionOutput,
        token_bytes: dict[int, LogprobBytes],
    ) -> ChatCompletionLogProbs | None:
        """`token_bytes`: per choice index, its LogprobBytes (kept across stream chunks)."""
        if not request.logprobs or completion.logprobs is None:
            return None
        if completion.index not in token_bytes:
            token_bytes[completion.index] = LogprobBytes(self.tokenizer)
        content = chat_logprobs(
            completion.token_ids,
            completion.logprobs,
            request.top_logprobs or 0,
            token_bytes[completion.index],
        )
        return ChatCompletionLogProbs(content=content)

    def _response(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        output: RequestOutput,
    ) -> ChatCompletionResponse:
        choices = []
        for completion in output.outputs:
            message = ChatResponseMessage(role="assistant", content=completion.text)
            finish_reason = completion.finish_reason
            parser = self._output_parser(request)
            if parser.active:
                reasoning, content, tool_calls = parser.parse(completion.text)
                message = ChatResponseMessage(
                    role="assistant", content=content, reasoning=reasoning, tool_calls=tool_calls
                )
                finish_reason = parser.finish_reason(finish_reason, bool(tool_calls), True)
            choice = ChatCompletionResponseChoice(
                index=completion.index,
                message=message,
                logprobs=self._logprobs(request, completion, {}),
                finish_reason=finish_reason,
                stop_reason=completion.stop_reason,
            )
            choices.append(choice)
        num_completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        usage = usage_info(len(output.prompt_token_ids), num_completion_tokens)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs_json(output.prompt_logprobs),
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
        token_bytes: dict[int, LogprobBytes] = {}
        parsers = [self._output_parser(request) for _ in range(request.n)]
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
                delta: DeltaMessage | None = DeltaMessage(content=completion.text)
                finish_reason = completion.finish_reason
                logprobs = self._logprobs(request, completion, token_bytes)
                parser = parsers[completion.index]
                if parser.active:
                    delta = parser.delta(completion.text, done)
                    tools_called = parser.streamer.tools_called
                    finish_reason = parser.finish_reason(finish_reason, tools_called, False)
                    if delta is None and not done and logprobs is None:
                        continue  # nothing to say yet (a marker being written)
                choice = ChatCompletionStreamChoice(
                    index=completion.index,
                    delta=delta or DeltaMessage(),
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                )
                yield chunk([choice])
        usage = usage_info(num_prompt_tokens, num_completion_tokens) if include_usage else None
        for event in stream_end(
            ChatCompletionStreamResponse, request_id, created, self.model_name, usage
        ):
            yield event
