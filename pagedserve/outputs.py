"""RequestOutput and CompletionOutput: what callers get back, named as in vLLM."""

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position (vLLM's `Logprob`).

    `rank` is 1 for the most likely token; `decoded_token` is the token's text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# Like SampleLogprobs for the prompt; the first position has no logprob (None).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """Output of one request so far (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
