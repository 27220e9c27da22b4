"""A request's sampling fields as the engine's SamplingParams (vLLM's `to_sampling_params`),
and the 400s for the fields a kind of request does not implement."""

from typing import Any

from pagedserve.sampling_params import RequestOutputKind, SamplingParams, default_max_tokens

from .protocol import SamplingFields
from .serving import OpenAIError
from .structured_fields import structured_outputs_of


def _logit_bias(request: SamplingFields) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if request.logit_bias is None:
        return None
    try:
        return {int(token_id): bias for token_id, bias in request.logit_bias.items()}
    except ValueError:
        raise OpenAIError(400, "logit_bias keys must be token ids", "logit_bias") from None


# The fields some kind of request does not implement (a kind that does lists them in its
# `implemented_fields`): why, and the values that ask for nothing (clients send them by
# default), None where no list is given.
_UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": (
        "is not supported in /v1/completions (tool calling is in /v1/chat/completions)",
        (None, []),
    ),
    "tool_choice": (
        "is not supported in /v1/completions (tool calling is in /v1/chat/completions)",
        (None, "none", "auto"),
    ),
    "functions": ("(OpenAI's deprecated form of tools) is not implemented; use tools", (None, [])),
    "function_call": (
        "(OpenAI's deprecated form of tool_choice) is not implemented; use tool_choice",
        (None, "none", "auto"),
    ),
    "logits_processors": (
        "is not implemented by pagedserve yet (custom logits processors)",
        (None, []),
    ),
    "request_id": (
        "(vLLM's caller-chosen request id) is not implemented by pagedserve yet",
        (None,),
    ),
    "return_tokens_as_token_ids": ("is not implemented by pagedserve yet", (None, False)),
    "return_token_ids": ("is not implemented by pagedserve yet", (None, False)),
    "prompt_embeds": (
        "is not implemented by pagedserve yet (prompts are text or token ids)",
        (None,),
    ),
    "kv_transfer_params": (
        "is not implemented by pagedserve (no disaggregated prefill)",
        (None, {}),
    ),
    "vllm_xargs": ("is not implemented by pagedserve (no custom extensions)", (None, {})),
    "mm_processor_kwargs": (
        "is not implemented by pagedserve yet (no multimodal models)",
        (None, {}),
    ),
    "media_io_kwargs": ("is not implemented by pagedserve yet (no multimodal models)", (None, {})),
    "documents": (
        "is not implemented by pagedserve yet (RAG documents for the chat template)",
        (None, []),
    ),
    # OpenAI's chat fields (the completions endpoint takes them the same way)
    "store": ("(stored completions) is not implemented by pagedserve", (None, False)),
    "metadata": ("(stored completions' tags) is not implemented by pagedserve", (None, {})),
    "service_tier": (
        "is not implemented by pagedserve (one tier; auto and default are accepted)",
        (None, "auto", "default"),
    ),
    "prediction": (
        "(predicted outputs, speculative decoding) is not implemented by pagedserve yet",
        (None,),
    ),
    "modalities": (
        "asks for output other than text, which pagedserve does not make",
        (None, ["text"]),
    ),
    "audio": ("(audio output) is not implemented by pagedserve", (None,)),
    "web_search_options": ("is not implemented by pagedserve (no web search)", (None,)),
    "reasoning_effort": (
        "is not implemented by pagedserve yet; pass your chat template's own variable in "
        "chat_template_kwargs (e.g. enable_thinking for Qwen3)",
        (None,),
    ),
    "echo": (
        "(vLLM's: prepend the last message to the answer) is not implemented in "
        "/v1/chat/completions yet",
        (None, False),
    ),
}


def check_unsupported(request: SamplingFields) -> None:
    """400 for the _UNSUPPORTED fields that this kind of request does not implement (tools in
    /v1/completions, the deprecated functions, custom logits processors): serving such a
    request without them would return output that silently breaks the asked-for format."""
    for name, (why, no_ops) in _UNSUPPORTED.items():
        if name in request.implemented_fields:
            continue
        if name == "tools" and request.tool_choice == "none":
            continue  # tools the model must not call: a plain answer, as vLLM gives
        if getattr(request, name) not in no_ops:
            raise OpenAIError(400, f"{name} {why}; remove it from the request", name)


def check_stream_options(request: SamplingFields) -> None:
    """400 for `stream_options` without `stream: true` (vLLM and OpenAI refuse it too: the
    options would be silently ignored)."""
    if request.stream_options is not None and not request.stream:
        raise OpenAIError(
            400, "stream_options can only be given when stream is true", "stream_options"
        )


def sampling_params(
    request: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    best_of: int | None = None,
    prompt_logprobs: int | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """SamplingParams of a request (raises InvalidRequestError naming the bad field, and
    OpenAIError 400 for a feature we do not implement or `stream_options` without `stream`).

    `defaults`: the model's generation-config defaults (`ModelConfig.get_diff_sampling_param`)
    of temperature, top_p, top_k, min_p and repetition_penalty, used where the request
    leaves the field out (or null), as vLLM's `to_sampling_params(default_sampling_params)`;
    vLLM's neutral values where neither sets it."""
    check_unsupported(request)
    check_stream_options(request)
    defaults = defaults or {}

    def pick(name: str, neutral: Any) -> Any:
        value = getattr(request, name)
        return defaults.get(name, neutral) if value is None else value

    return SamplingParams(
        n=request.n,
        best_of=best_of,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=pick("repetition_penalty", 1.0),
        logit_bias=_logit_bias(request),
        bad_words=request.bad_words,
        allowed_token_ids=request.allowed_token_ids,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        prompt_logprobs=prompt_logprobs,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0),
        min_p=pick("min_p", 0.0),
        seed=request.seed,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        structured_outputs=structured_outputs_of(request),
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
    )


def default_max_tokens_of(defaults: dict[str, Any]) -> int | None:
    """max_tokens of a request that leaves it to the server: the generation config's
    max_new_tokens, lowered to what the context leaves (as vLLM's get_max_tokens), else
    None (all the context leaves)."""
    value = defaults.get("max_tokens")
    return None if value is None else default_max_tokens(value)
