"""POST /v1/completions: prompts in, completions out, whole or as server-sent events."""

import functools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.logprob_text import first_token_text
from pagedserve.engine.prompt_bound import check_prompt_chars
from pagedserve.engine.request_stream import RequestStream
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import DEFAULT_MAX_TOKENS

from .off_loop import Cancelled, run_off_loop
from .protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
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
from .serving_logprobs import check_prompt_logprobs, completion_logprobs, prompt_logprobs_json


@dataclass(slots=True)
class _ChoiceState:
    """What a stream has sent of one choice so far."""

    echoed: bool = False
    finished: bool = False
    num_tokens: int = 0
    text_offset: int = 0


@dataclass(slots=True)
class _StreamState:
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    num_prompt_tokens: dict[int, int] = field(default_factory=dict)


class OpenAIServingCompletion:
    def __init__(
        self,
        engine: Engine,
        served_model_names: list[str],
        default_sampling_params: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        # The model's generation-config defaults (vLLM's default_sampling_params).
        self.default_sampling_params = default_sampling_params or {}
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.tokenizer = engine.get_tokenizer()

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Any:
        check_model(request.model, self.served_model_names)
        if request.suffix is not None:
            raise OpenAIError(400, "suffix is not supported", "suffix")
        if request.stream and request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(400, "best_of other than n cannot be streamed", "best_of")
        check_prompt_logprobs(request)
        check_beam_search(request)
        # Tokenizing can take long (a huge prompt): keep it off the event loop, which serves
        # every other request, and stop it when the client leaves.
        prompts = await run_off_loop(raw_request, functools.partial(self._prompts, request))
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = request.logprobs  # echoed prompt tokens get their logprobs too
        # Left out, max_tokens is the default (16) that the engine caps to what the context
        # leaves; sent, even as 16, it must fit (vLLM's get_max_tokens and its check). As in
        # vLLM, whose CompletionRequest defaults max_tokens to 16, the generation config's
        # max_new_tokens applies only to an explicit null.
        defaults = self.default_sampling_params
        if "max_tokens" not in request.model_fields_set:
            max_tokens: int | None = DEFAULT_MAX_TOKENS
        elif request.max_tokens is None:
            max_tokens = default_max_tokens_of(defaults)
        else:
            max_tokens = request.max_tokens
        params = sampling_params(
            request, max_tokens, request.logprobs, request.best_of, prompt_logprobs, defaults
        )
        request_id = random_id("cmpl")
        if request.use_beam_search:
            beam = beam_search_params(request, max_tokens, defaults)
            outputs = await beam_search_outputs(
                self.engine, request_id, prompts, beam, raw_request, request.priority,
                request.cache_salt, request.truncate_prompt_tokens,
                request.skip_special_tokens,
            )  # fmt: skip
            return self._response(request, request_id, int(time.time()), outputs)
        streams = add_requests(
            self.engine, request_id, prompts, params, request.priority, request.cache_salt
        )
        created = int(time.time())
        watcher = DisconnectWatcher(raw_request, self.engine, streams)
        if request.stream:
            body = guarded_stream(self._stream(request, request_id, created, streams), watcher)
            return StreamingResponse(body, media_type="text/event-stream")
        outputs = await final_outputs(self.engine, streams, watcher)
        return self._response(request, request_id, created, outputs)

    def _prompts(
        self, request: CompletionRequest, cancelled: threading.Event | None = None
    ) -> list[PromptType]:
        """Engine prompts of a request, tokenized; stops (Cancelled) once `cancelled` is set."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items: list[Any] = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        prompts: list[PromptType] = []
        for item in items:
            if cancelled is not None and cancelled.is_set():  # the client is gone
                raise Cancelled
            if isinstance(item, str):
                if self.tokenizer is None:
                    prompts.append(item)  # the engine's own error for this case
                else:
                    # An empty text is a prompt where the tokenizer adds BOS; without
                    # tokens, the engine refuses it.
                    if request.truncate_prompt_tokens is None:
                        check_prompt_chars(self.tokenizer, item, self.engine.max_model_len)
                    ids = self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)
                    prompts.append({"prompt": item, "prompt_token_ids": ids})
            else:
                prompts.append({"prompt_token_ids": list(item)})
        return prompts

    def _prompt_text(self, request: CompletionRequest, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        # Decoded as the echoed tokens' logprob texts are, so that those join to it.
        text: str = self.tokenizer.backend_tokenizer.decode(
            output.prompt_token_ids, skip_special_tokens=request.skip_special_tokens
        )
        return text

    def _choice(
        self,
        request: CompletionRequest,
        output: RequestOutput,
        completion: CompletionOutput,
        index: int,
        state: _ChoiceState,
    ) -> CompletionStreamChoice:
        """One choice (or one stream delta of it); `state` carries echo and offsets across."""
        text = completion.text
        echo_ids: list[int] = []
        if request.echo and not state.echoed:
            text = self._prompt_text(request, output) + text
            echo_ids = output.prompt_token_ids
            state.echoed = True
        logprobs = None
        if request.logprobs is not None:

            def token_text(token_id: int) -> str:  # the first prompt token: it has no entry
                return first_token_text(self.tokenizer, token_id, request.skip_special_tokens)

            prompt_logprobs = output.prompt_logprobs if echo_ids else None
            logprobs, state.text_offset = completion_logprobs(
                echo_ids, prompt_logprobs, request.logprobs, token_text, state.text_offset
            )
            generated, state.text_offset = completion_logprobs(
                completion.token_ids,
                completion.logprobs,
                request.logprobs,
                token_text,
                state.text_offset,
            )
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(generated, name))
        state.num_tokens += len(completion.token_ids)
        return CompletionStreamChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _response(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        outputs: list[RequestOutput],
    ) -> CompletionResponse:
        choices = []
        num_prompt_tokens = num_completion_tokens = 0
        for i, output in enumerate(outputs):
            num_prompt_tokens += len(output.prompt_token_ids)
            prompt_logprobs = prompt_logprobs_json(output.prompt_logprobs)
            for completion in output.outputs:
                state = _ChoiceState()
                index = i * request.n + completion.index
                choice = self._choice(request, output, completion, index, state)
                choices.append(
                    CompletionResponseChoice(**dict(choice), prompt_logprobs=prompt_logprobs)
                )
                num_completion_tokens += state.num_tokens
        usage = usage_info(num_prompt_tokens, num_completion_tokens)
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        state = _StreamState()
        async for i, output in merge_streams(self.engine, streams):
            state.num_prompt_tokens[i] = len(output.prompt_token_ids)
            for completion in output.outputs:
                index = i * request.n + completion.index
                choice_state = state.choices.setdefault(index, _ChoiceState())
                if choice_state.finished:
                    continue  # a DELTA output repeats finished sequences
                choice_state.finished = completion.finish_reason is not None
                if not (
                    completion.text
                    or completion.token_ids
                    or choice_state.finished
                    or (request.echo and not choice_state.echoed)
                ):
                    continue
                choice = self._choice(request, output, completion, index, choice_state)
                chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[choice]
                )
                yield sse(chunk, include_usage)
        usage = None
        if include_usage:
            num_prompt_tokens = sum(state.num_prompt_tokens.values())
            usage = usage_info(num_prompt_tokens, sum(c.num_tokens for c in state.choices.values()))
        for event in stream_end(
            CompletionStreamResponse, request_id, created, self.model_name, usage
        ):
            yield event
