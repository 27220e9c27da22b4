"""Pydantic models of the OpenAI API (completions, chat, models, errors) plus vLLM's extras."""

import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from .protocol_tools import ChatCompletionToolsParam, DeltaToolCall, ToolCall, ToolChoice


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are ignored, as OpenAI and vLLM do; known ones are validated strictly.
    model_config = ConfigDict(extra="ignore")


def _check_unicode(value: Any) -> Any:
    """JSON can spell a lone surrogate ("\\ud800"), which neither the tokenizer nor the
    engine-core messages can encode: refuse it here (a 400 naming the field), not later."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    elif isinstance(value, list | tuple):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    return value


class RequestModel(OpenAIModel):
    """A request body (or a part of one): every string in it must be valid Unicode."""

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return _check_unicode(value)


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(RequestModel):
    """Fields that completions and chat share: OpenAI's, then vLLM's extras."""

    # Fields of request_params._UNSUPPORTED (check_unsupported) that this kind implements.
    implemented_fields: ClassVar[tuple[str, ...]] = ()

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored
    # OpenAI fields pagedserve does not implement: a 400 naming the one given unless it
    # has its no-op value (request_params._UNSUPPORTED), never silently ignored.
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prediction: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's request extras: lower priority values are scheduled first (non-zero needs
    # --scheduling-policy priority)
    priority: int = 0
    # isolates the request's prefix-cache blocks: only requests with the same salt share them
    cache_salt: str | None = None
    # Structured outputs (structured_fields.py turns them into one StructuredOutputsParams)
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: Any = None  # removed by vLLM: a 400 naming it
    # Parsed in every request; a request kind that does not implement one (tools in
    # /v1/completions, the deprecated functions, logits processors) answers a 400 naming it
    # instead of an answer made without it (check_unsupported).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    logits_processors: Any = None
    # Beam search (vLLM's extras; serving_beam.py): n is the beam width.
    use_beam_search: bool = False
    length_penalty: float | None = None
    # vLLM request extras pagedserve does not implement: a 400 naming the one given (unless
    # it has its no-op value), never silently ignored.
    request_id: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    prompt_embeds: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None
    documents: Any = None
    echo: Any = None  # vLLM's in chat (prepend the last message); completions implement it


class CompletionRequest(SamplingFields):
    implemented_fields: ClassVar[tuple[str, ...]] = ("echo",)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """One token at one prompt position, as vLLM serializes its `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs` field: None for the first prompt token, then token id -> logprob.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionStreamChoice(OpenAIModel):
    """A choice of a streamed chunk (no prompt_logprobs: as in vLLM, they are refused with
    stream=true)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponseChoice(CompletionStreamChoice):
    prompt_logprobs: PromptLogprobsField = None  # vLLM: per choice in completions


class CompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: Sequence[CompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionResponse(CompletionStreamResponse):
    choices: Sequence[CompletionResponseChoice]


class ChatMessage(RequestModel):
    """One message. `content` parts are checked by `chat_utils.normalize_messages` (text parts
    only; another part type is a 400 naming it), which the offline `LLM.chat` shares, as are
    an assistant's `tool_calls` ({"id", "type": "function", "function": {"name",
    "arguments": JSON text}}). A "tool" message answers the call `tool_call_id`. `reasoning`
    (vLLM's name; `reasoning_content` is its older one) is an assistant's earlier thinking."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    implemented_fields: ClassVar[tuple[str, ...]] = ("tools", "tool_choice")
    messages: list[ChatMessage] = Field(min_length=1)
    # Tool calling (chat_output.py): None means "auto" with tools, "none" without (OpenAI).
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # vLLM's: False leaves the reasoning out of the answer
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: add the tokenizer's special tokens (BOS) on top of those the template holds
    add_special_tokens: bool = False


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIModel):
    content: list[ChatCompletionLogProb] | None = None


def _drop_empty(data: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if key not in keys or value}


class ChatResponseMessage(OpenAIModel):
    """The answer. `reasoning` (vLLM's field; null without --reasoning-parser) is the
    thinking; `tool_calls` is left out when there are none, as vLLM does."""

    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Any:
        return _drop_empty(handler(self), ("tool_calls",))


class ChatCompletionResponseChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField = None  # vLLM: per response in chat


class DeltaMessage(OpenAIModel):
    """One chunk's piece of the message, with only the fields it has (as OpenAI and vLLM,
    whose chunks exclude unset fields): `role` in a choice's first chunk only, no null
    `content`, `reasoning` and `tool_calls` only when non-empty; a chunk with nothing new
    (e.g. the finish) has `"delta": {}`."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> Any:
        data = _drop_empty(handler(self), ("reasoning", "tool_calls"))
        return {key: value for key, value in data.items() if value is not None}


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionToolsParam] | None = None  # rendered by the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
