"""SamplingParams (and BeamSearchParams, from beam_search_params): how to pick next tokens and
when to stop (vLLM's API)."""

import logging
import math
from dataclasses import dataclass, field
from enum import Enum

import pagedserve.envs as envs
from pagedserve.beam_search_params import BeamSearchParams as BeamSearchParams
from pagedserve.errors import InvalidRequestError
from pagedserve.param_checks import check, is_int, is_number, is_unicode
from pagedserve.structured_outputs_params import (
    StructuredOutputsParams as StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

_GREEDY_EPSILON = 1e-5  # temperatures below this are treated as greedy, as in vLLM
_MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


class _DefaultMaxTokens(int):
    """vLLM's default max_tokens (16), marked as not chosen by the user: the engine lowers it
    to what the context leaves after the prompt, where an explicit value that does not fit
    is an error. An int, so that it reads, compares and prints as 16."""

    __slots__ = ()


DEFAULT_MAX_TOKENS: int = _DefaultMaxTokens(16)


def default_max_tokens(max_tokens: int) -> int:
    """`max_tokens` marked as a default that the user did not choose (the model's
    generation_config.json max_new_tokens): the engine lowers it to what the context leaves
    after the prompt, as it lowers `DEFAULT_MAX_TOKENS`."""
    return _DefaultMaxTokens(max_tokens)


def is_default_max_tokens(max_tokens: int | None) -> bool:
    """Whether `max_tokens` is an unchosen default (`DEFAULT_MAX_TOKENS`, `default_max_tokens`),
    not a user's value."""
    return isinstance(max_tokens, _DefaultMaxTokens)


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
    allowed range. Checks that need the model (token ids inside the vocabulary, `max_logprobs`,
    `truncate_prompt_tokens` <= max_model_len) happen in the engine's InputProcessor.

    n: sequences returned for the prompt. best_of: candidates to choose them from (>= n).
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted once per distinct generated token
        / once per occurrence (OpenAI's definition); prompt tokens do not count.
    repetition_penalty: > 0; every token of the prompt or the output so far has its logit divided
        by it when positive and multiplied by it when negative (1 = off).
    temperature: 0 = greedy. top_p: in (0, 1]. top_k: 0 or -1 = off. min_p: in [0, 1], relative
        to the most likely token.
    seed: makes the request's samples reproducible, whatever else is in the batch.
    stop, stop_token_ids, ignore_eos, include_stop_str_in_output: stop rules.
    bad_words: words never generated (their last token is banned when the output ends with the
        tokens before it, as in vLLM).
    max_tokens: output cap. None: up to max_model_len. Left out: 16, lowered to what
        max_model_len leaves after the prompt (an explicit value that does not fit is an
        error). The engine resolves it: its requests' params hold the int it runs to.
    min_tokens: no EOS or stop token before.
    logprobs: top-k logprobs per generated token, plus the sampled token's (at most the engine's
        `max_logprobs` option). They are log-softmax of the processed logits: after
        allowed_token_ids, bad_words, min_tokens, logit_bias, the penalties and the temperature
        (1 for greedy requests), before the top-k/top-p/min-p cut.
    prompt_logprobs: the same for each prompt token (raw logits; the first token has none).
    logit_bias: token id -> bias added to its logit, clamped to [-100, 100] (OpenAI).
    allowed_token_ids: when given, only these tokens can be generated.
    truncate_prompt_tokens: keep only the last k prompt tokens (-1: the model's max_model_len).
    output_kind: what each RequestOutput carries (cumulative, delta or final only).
    structured_outputs: a constraint the output must satisfy (JSON schema, regex, choice,
        grammar; see StructuredOutputsParams).
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
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine, not by users: EOS ids of the model (tokenizer + generation_config),
    # and the token ids of each bad word (with and without a leading space).
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

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
        # The flags were only ever read for their truth (ignore_eos=1 worked); bools from here
        # on, as annotated: the engine core's decoder (msgspec) checks the annotations.
        for name in _FLAGS:
            setattr(self, name, bool(getattr(self, name)))
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self._validate_numbers()
        self._validate()
        self._normalize_token_maps()

    def _validate_numbers(self) -> None:
        """Types first, so that the range checks below compare numbers."""
        for name in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
        ):
            value = getattr(self, name)
            check(
                is_number(value) and math.isfinite(value),
                name,
                f"must be a finite number, got {value!r}",
            )
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            check(is_int(value), name, f"must be an int, got {value!r}")
        for name in (
            "best_of",
            "seed",
            "max_tokens",
            "logprobs",
            "prompt_logprobs",
            "truncate_prompt_tokens",
        ):
            value = getattr(self, name)
            check(value is None or is_int(value), name, f"must be an int or None, got {value!r}")

    def _validate(self) -> None:
        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            f"must be a RequestOutputKind, got {self.output_kind!r}",
        )
        limit = envs.max_n_sequences()
        check(
            self.n <= limit,
            "n",
            f"must be at most {limit} (PAGEDSERVE_MAX_N_SEQUENCES), got {self.n}",
        )
        if self.best_of is not None:
            check(
                self.best_of <= limit,
                "best_of",
                f"must be at most {limit} (PAGEDSERVE_MAX_N_SEQUENCES), got {self.best_of}",
            )
            check(self.best_of >= self.n, "best_of", f"must be >= n ({self.n}), got {self.best_of}")
            check(
                self.best_of == self.n or self.output_kind != RequestOutputKind.DELTA,
                "best_of",
                f"must equal n ({self.n}) with output_kind=DELTA (streaming)",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        # The sampler divides and multiplies float32 logits by these: a value that rounds to
        # 0 or overflows there would turn banned tokens (-inf) into NaN, then into candidates.
        check(
            _FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX,
            "repetition_penalty",
            f"must be in [{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX:.3g}] (float32), "
            f"got {self.repetition_penalty}",
        )
        check(
            self.temperature <= _FLOAT32_MAX,
            "temperature",
            f"must be at most {_FLOAT32_MAX:.3g} (float32), got {self.temperature}",
        )
        if _GREEDY_EPSILON <= self.temperature < _MIN_TEMPERATURE:
            # As vLLM: dividing logits by a tinier temperature can overflow float32 (below
            # _GREEDY_EPSILON the request is greedy and nothing is divided).
            logger.warning(
                "temperature %s is below %s, which may give NaN or inf logits; using %s",
                self.temperature,
                _MIN_TEMPERATURE,
                _MIN_TEMPERATURE,
            )
            self.temperature = _MIN_TEMPERATURE
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, "top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        check(self.top_k < 2**63, "top_k", f"must fit in 64 bits, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            check(-(2**63) <= self.seed < 2**63, "seed", f"must fit in 64 bits, got {self.seed}")
        if self.max_tokens is not None:
            check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        check(self.min_tokens < 2**63, "min_tokens", f"must fit in 64 bits, got {self.min_tokens}")
        if self.max_tokens is not None:
            check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check(value >= 0, name, f"must be >= 0, got {value}")
        if self.truncate_prompt_tokens is not None:
            check(
                self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1,
                "truncate_prompt_tokens",
                f"must be -1 (max_model_len) or at least 1, got {self.truncate_prompt_tokens}",
            )
        self._validate_token_lists()

    def _validate_token_lists(self) -> None:
        assert isinstance(self.stop, list)
        max_stop = envs.max_stop_strings()
        check(
            len(self.stop) <= max_stop,
            "stop",
            f"must hold at most {max_stop} strings (PAGEDSERVE_MAX_STOP_STRINGS), "
            f"got {len(self.stop)}",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        max_chars, num_chars = envs.max_stop_string_chars(), sum(map(len, self.stop))
        check(
            num_chars <= max_chars,
            "stop",
            f"must hold at most {max_chars} characters in all "
            f"(PAGEDSERVE_MAX_STOP_STRING_CHARS), got {num_chars}",
        )
        check(all(map(is_unicode, self.stop)), "stop", "must be valid Unicode (no lone surrogate)")
        check(
            not self.stop or self.detokenize,
            "stop",
            "needs detokenize=True (stop strings are matched in the text)",
        )
        assert self.stop_token_ids is not None
        check(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be non-negative token ids, got {self.stop_token_ids}",
        )
        if self.bad_words is not None:
            check(
                isinstance(self.bad_words, list | tuple)
                and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                f"must be a list of non-blank strings, got {self.bad_words!r}",
            )
            check(
                all(map(is_unicode, self.bad_words)),
                "bad_words",
                "must be valid Unicode (no lone surrogate)",
            )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            check(
                isinstance(ids, list | tuple) and len(ids) > 0,
                "allowed_token_ids",
                "must be a non-empty list of token ids (None allows every token)",
            )
            check(
                all(is_int(t) and t >= 0 for t in ids),
                "allowed_token_ids",
                f"must be non-negative token ids, got {ids}",
            )

    def _normalize_token_maps(self) -> None:
        """logit_bias keys may arrive as strings (JSON); biases are clamped to [-100, 100]."""
        if self.logit_bias is None:
            return
        check(
            isinstance(self.logit_bias, dict),
            "logit_bias",
            f"must map token ids to biases, got {self.logit_bias!r}",
        )
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            try:
                token_id = int(token)
            except (TypeError, ValueError):
                token_id = -1
            check(token_id >= 0, "logit_bias", f"keys must be token ids, got {token!r}")
            check(
                is_number(value) and not math.isnan(value),
                "logit_bias",
                f"values must be numbers, got {value!r} for token {token_id}",
            )
            bias[token_id] = min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(value)))
        self.logit_bias = bias

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

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


_FLAGS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)
_FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32
_MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to it
_FLOAT32_MAX = 3.4028234663852886e38


def _structured_outputs(value: object) -> StructuredOutputsParams | None:
    """SamplingParams.structured_outputs as a StructuredOutputsParams: one already, None, or a
    mapping of its fields (as the server's `structured_outputs` extra). Raises
    InvalidRequestError naming structured_outputs for any other value or an unknown field."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise InvalidRequestError(
            "SamplingParams.structured_outputs must be a StructuredOutputsParams (or a dict "
            f"of its fields), got {type(value).__name__}",
            "structured_outputs",
        )
    known = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(
            f"SamplingParams.structured_outputs has unknown fields {unknown}; known: "
            f"{sorted(known)}",
            "structured_outputs",
        )
    return StructuredOutputsParams(**value)
