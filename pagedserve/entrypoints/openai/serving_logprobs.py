"""Logprobs in the OpenAI formats (completions, chat) and vLLM's `prompt_logprobs`.

Token texts come from the engine in context (engine/logprob_text.py): they join to the text.
"""

from collections.abc import Callable, Sequence

from pagedserve.engine.logprob_text import LogprobBytes
from pagedserve.outputs import Logprob, PromptLogprobs

from .protocol import (
    ChatCompletionLogProb,
    CompletionLogProbs,
    PromptLogprob,
    SamplingFields,
    TopLogprob,
)
from .serving import OpenAIError

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _clamp(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _by_rank(position: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: item[1].rank or 0)


def completion_logprobs(
    token_ids: list[int],
    logprobs: Sequence[dict[int, Logprob] | None] | None,
    num_top: int,
    token_text: Callable[[int], str],
    text_offset: int,
) -> tuple[CompletionLogProbs, int]:
    """OpenAI completions logprobs of some tokens; a position without logprobs (the first
    prompt token, or all of them when `logprobs` is None) gets None, and its text from
    `token_text(token_id)`. Token texts are the in-context ones (logprob_text.py), so that they
    join to the returned text and `text_offset` indexes it. Returns them and the text offset
    after the last token."""
    result = CompletionLogProbs()
    for i, token_id in enumerate(token_ids):
        position = logprobs[i] if logprobs is not None else None
        if position is None or token_id not in position:
            text = token_text(token_id)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            sampled = position[token_id]
            text = sampled.decoded_token or ""
            result.token_logprobs.append(_clamp(sampled.logprob))
            top = {text: _clamp(sampled.logprob)}
            for top_id, top_logprob in _by_rank(position):
                if top_id != token_id and (top_logprob.rank or 0) <= num_top:
                    top.setdefault(top_logprob.decoded_token or "", _clamp(top_logprob.logprob))
            result.top_logprobs.append(top)
        result.tokens.append(text)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result, text_offset


def chat_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]],
    num_top: int,
    token_bytes: LogprobBytes,
) -> list[ChatCompletionLogProb]:
    """OpenAI chat logprobs (`choices[].logprobs.content`) of generated tokens. `token_bytes`
    follows the sequence across calls (stream chunks): a token may hold part of a character
    whose other bytes came in an earlier chunk."""
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=True):
        data = token_bytes.position(token_id, position)
        top = [
            TopLogprob(
                token=t.decoded_token or "",
                logprob=_clamp(t.logprob),
                bytes=list(data[top_id]),
            )
            for top_id, t in _by_rank(position)
            if t.rank is not None and t.rank <= num_top
        ][:num_top]
        sampled = position[token_id]
        content.append(
            ChatCompletionLogProb(
                token=sampled.decoded_token or "",
                logprob=_clamp(sampled.logprob),
                bytes=list(data[token_id]),
                top_logprobs=top,
            )
        )
    return content


def prompt_logprobs_json(
    prompt_logprobs: PromptLogprobs | None,
) -> list[dict[int, PromptLogprob] | None] | None:
    """`prompt_logprobs` as vLLM's server returns them: None for the first prompt token, then
    per position {token id: {"logprob", "rank", "decoded_token"}}, -inf clamped to -9999."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            token_id: PromptLogprob(
                logprob=_clamp(logprob.logprob),
                rank=logprob.rank,
                decoded_token=logprob.decoded_token,
            )
            for token_id, logprob in position.items()
        }
        for position in prompt_logprobs
    ]


def check_prompt_logprobs(request: SamplingFields) -> None:
    """400 for prompt_logprobs with stream=true: vLLM refuses them there too (its streamed
    chunks have no field for them), rather than computing them and dropping them."""
    if request.stream and request.prompt_logprobs is not None:
        raise OpenAIError(
            400, "prompt_logprobs are not available when stream=true", "prompt_logprobs"
        )
