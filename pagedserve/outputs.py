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

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Fold the request's next output into this one (vLLM's `RequestOutput.add`):
        `aggregate` (DELTA outputs) appends each completion's new text, tokens and logprobs
        to the one of the same index; otherwise (cumulative outputs, which carry everything)
        the newer completion replaces it. A completion index not seen yet is appended. The
        newer finish and stop reasons, cumulative logprob, finished flag, cached-token count
        and metrics win; prompt logprobs stay the first output's (later DELTA outputs carry
        none). Token and logprob lists grow in place: a DELTA output's lists are its own."""
        self.add_all([next_output], aggregate)

    def add_all(self, next_outputs: list["RequestOutput"], aggregate: bool) -> None:
        """`add` each of `next_outputs` in order, each completion's text joined once (a
        backlog of thousands of outputs merges in linear time)."""
        pieces: dict[int, list[str]] = {}  # completion index -> texts to append
        for next_output in next_outputs:
            for completion in next_output.outputs:
                for i, mine in enumerate(self.outputs):
                    if mine.index != completion.index:
                        continue
                    if aggregate:
                        pieces.setdefault(mine.index, [mine.text]).append(completion.text)
                        mine.token_ids.extend(completion.token_ids)
                        if completion.logprobs is not None:
                            if mine.logprobs is None:
                                mine.logprobs = []
                            mine.logprobs.extend(completion.logprobs)
                        mine.cumulative_logprob = completion.cumulative_logprob
                        mine.finish_reason = completion.finish_reason
                        mine.stop_reason = completion.stop_reason
                    else:
                        self.outputs[i] = completion
                    break
                else:
                    self.outputs.append(completion)
            if not aggregate or not self.prompt_logprobs:
                self.prompt_logprobs = next_output.prompt_logprobs or self.prompt_logprobs
            self.finished = next_output.finished
            self.num_cached_tokens = next_output.num_cached_tokens
            self.metrics = next_output.metrics or self.metrics
        for mine in self.outputs:
            if mine.index in pieces:
                mine.text = "".join(pieces[mine.index])
