"""SamplingParams: how to pick each next token and when to stop (vLLM's API)."""

from dataclasses import dataclass, field
from enum import Enum

from pagedserve.errors import InvalidRequestError

_GREEDY_EPSILON = 1e-5  # temperatures below this are treated as greedy, as in vLLM


class RequestOutputKind(Enum):
    """What each RequestOutput of a request carries (vLLM's `output_kind`)."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass(slots=True)
class SamplingParams:
    """Sampling parameters of one request, named and validated as in vLLM's `SamplingParams`.

    Source: vllm/sampling_params.py (the public fields and their meaning). Validation happens at
    construction and raises `ValueError` (an `InvalidRequestError`) naming the field and the
    allowed range. `temperature == 0` means greedy decoding.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine, not by users: EOS ids of the model (tokenizer + generation_config).
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n}), got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value >= 0, name, f"must be >= 0, got {value}")
        assert isinstance(self.stop, list)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        assert self.stop_token_ids is not None
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"must be non-negative token ids, got {self.stop_token_ids}")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an int, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)
        return self.stop

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end the request: `stop_token_ids`, plus EOS unless `ignore_eos`."""
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"SamplingParams.{name} {message}")
