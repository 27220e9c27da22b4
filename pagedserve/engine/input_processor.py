"""InputProcessor: tokenize and validate a prompt, resolving its sampling parameters."""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.mm_processor import MultiModalProcessor
from pagedserve.engine.prompt_bound import check_prompt_chars
from pagedserve.errors import InvalidRequestError
from pagedserve.model_config import DEFAULT_MAX_LOGPROBS
from pagedserve.multimodal import MultiModalFeature
from pagedserve.sampling_params import SamplingParams, is_default_max_tokens
from pagedserve.structured_output.backend_xgrammar import validate_structured_outputs

# A prompt as vLLM accepts it: text, {"prompt": text}, or {"prompt_token_ids": [...]}; a
# dict may carry a "cache_salt" (vLLM's TextPrompt / TokensPrompt field) and, for a
# vision-language model, "multi_modal_data": {"image": PIL image or a list of them}.
PromptType = str | Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    # Resolved: max_tokens an int (never None), the model's EOS ids and bad words' ids filled in
    sampling_params: SamplingParams
    cache_salt: str | None = None  # the prompt's: only requests with the same salt share blocks
    mm_features: tuple[MultiModalFeature, ...] = ()  # the prompt's images, in prompt order


class InputProcessor:
    """Turns user prompts into token ids and checks them against the model's limits."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        scheduling_policy: str = "fcfs",
        mm_processor: MultiModalProcessor | None = None,
    ) -> None:
        """max_logprobs: most logprobs or prompt_logprobs a request may ask for (-1: the
        vocabulary size). scheduling_policy: the engine's (SchedulerConfig), which decides
        whether a request may have a priority (`check_priority`). mm_processor: a
        vision-language model's (None: prompts with multi_modal_data are refused)."""
        self.scheduling_policy = scheduling_policy
        self.mm_processor = mm_processor
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        ids = list(eos_token_ids)
        eos = None if tokenizer is None else tokenizer.eos_token_id
        if eos is not None and eos not in ids:
            ids.append(eos)
        self.eos_token_ids = tuple(ids)

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and check a prompt, and resolve its sampling parameters: max_tokens
        becomes the int the request runs to (`resolve_max_tokens`).

        Raises InvalidRequestError (a ValueError) for a prompt with no tokens (an empty text
        is one token where the tokenizer adds BOS), token ids outside the vocabulary (prompt
        or sampling parameters), a prompt (+ an explicit max_tokens) longer than
        max_model_len, more logprobs than max_logprobs, a "cache_salt" that is not a
        non-empty string (as vLLM's server), or "multi_modal_data" that this model cannot
        take (a text-only model, no text prompt, truncation, a bad image)."""
        cache_salt = _cache_salt(prompt)
        mm_features: tuple[MultiModalFeature, ...] = ()
        text: str | None
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            text, token_ids, mm_features = self._process_multimodal(prompt, params)
        else:
            # A prompt to be truncated may be as long as it likes.
            text, token_ids = self._tokenize(prompt, params.truncate_prompt_tokens is None)
        if not token_ids:
            raise InvalidRequestError(
                "the prompt is empty: it has no tokens (an empty text has none where the "
                "tokenizer adds no BOS); give at least one token",
                "prompt",
            )
        token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                "prompt",
            )
        num_prompt_tokens = len(token_ids)
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({num_prompt_tokens} tokens) is too long: it must be shorter than "
                f"max_model_len ({self.max_model_len}) to leave room for one output token",
                "prompt",
            )
        max_tokens = self.resolve_max_tokens(params, num_prompt_tokens)
        self._check_sampling_params(params)
        resolved = dataclasses.replace(
            params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
        )
        return ProcessedPrompt(text, token_ids, resolved, cache_salt, mm_features)

    def _process_multimodal(
        self, prompt: Mapping[str, Any], params: SamplingParams
    ) -> tuple[str, list[int], tuple[MultiModalFeature, ...]]:
        """A text prompt with images: the model's processor expands each image placeholder
        (e.g. LLaVA's "<image>") to the image's tokens."""
        if self.mm_processor is None:
            raise InvalidRequestError(
                "multi_modal_data was given but this model is text-only: it takes no images; "
                "send the prompt without multi_modal_data, or serve a vision-language model "
                "(LlavaForConditionalGeneration)",
                "multi_modal_data",
            )
        text = prompt.get("prompt")
        if not isinstance(text, str) or "prompt_token_ids" in prompt:
            raise InvalidRequestError(
                "multi_modal_data needs a text 'prompt' holding the image placeholders (the "
                "processor expands them to the image tokens); prompt_token_ids with images are "
                "not supported",
                "multi_modal_data",
            )
        if params.truncate_prompt_tokens is not None:
            raise InvalidRequestError(
                "truncate_prompt_tokens is not supported with multi_modal_data (truncation "
                "could cut an image's tokens)",
                "truncate_prompt_tokens",
            )
        self._check_text(text)  # the processor tokenizes it, with the images
        token_ids, features = self.mm_processor.process(text, prompt["multi_modal_data"])
        return text, token_ids, features

    def check_priority(self, priority: int) -> None:
        """Check a request's priority (vLLM's: lower is handled earlier; any int64). Raises
        InvalidRequestError (param "priority") when it is not an int, is out of range, or is
        non-zero while the engine's scheduling policy is not "priority" (as vLLM's "Got
        priority ... but Priority scheduling is not enabled")."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(
                f"priority must be an int, got {type(priority).__name__}", "priority"
            )
        if not -(2**63) <= priority < 2**63:
            raise InvalidRequestError(
                f"priority ({priority}) must be in [-2**63, 2**63)", "priority"
            )
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"got priority {priority} but priority scheduling is not enabled: start the "
                f"engine with scheduling_policy='priority' (--scheduling-policy priority) or "
                f"leave priority at 0",
                "priority",
            )

    def resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """The output tokens a request may generate: what the context leaves after the prompt
        for max_tokens=None; the default (16, left out) capped to that, as vLLM's
        `get_max_tokens` caps it; an explicit value as given. Raises InvalidRequestError when
        an explicit value does not fit, or min_tokens is more than what is left."""
        room = self.max_model_len - num_prompt_tokens
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif is_default_max_tokens(max_tokens):
            max_tokens = min(max_tokens, room)
        elif num_prompt_tokens + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({self.max_model_len}); "
                f"shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({params.min_tokens}) is more than the prompt "
                f"({num_prompt_tokens} tokens) leaves of max_model_len ({self.max_model_len}): "
                f"{room} tokens; shorten the prompt or lower min_tokens",
                "min_tokens",
            )
        return int(max_tokens)  # a plain int: the marker of the default has done its work

    def _truncate(self, token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """Keep the last `truncate_prompt_tokens` tokens (-1: max_model_len), as vLLM."""
        if truncate_prompt_tokens is None:
            return token_ids
        num_kept = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if num_kept > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({num_kept}) is larger than max_model_len "
                f"({self.max_model_len}); lower it",
                "truncate_prompt_tokens",
            )
        return token_ids[-num_kept:]

    def _check_sampling_params(self, params: SamplingParams) -> None:
        """The checks that need the model: token ids inside the vocabulary, max_logprobs."""
        if params.structured_outputs is not None:
            self._check_structured_outputs(params)
        token_id_lists = {
            "stop_token_ids": params.stop_token_ids or [],
            "logit_bias": list(params.logit_bias or {}),
            "allowed_token_ids": params.allowed_token_ids or [],
        }
        for name, token_ids in token_id_lists.items():
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} contains token id {bad[0]}, outside the vocabulary "
                    f"[0, {self.vocab_size})",
                    name,
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name} ({value}) is more than max_logprobs ({self.max_logprobs}); ask for "
                    f"fewer, or start the engine with a larger max_logprobs",
                    name,
                )

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """The constraint must parse (xgrammar), so that a bad one is refused here, never in
        the engine loop. The server checks it first under the request's own field name
        (response_format, guided_json, ...); the check is cached, so it is parsed once."""
        assert params.structured_outputs is not None
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs needs the tokenizer (the grammar is compiled against the "
                "vocabulary); this engine has none (skip_tokenizer_init)",
                "structured_outputs",
            )
        validate_structured_outputs(params.structured_outputs, "structured_outputs")

    def _bad_words_token_ids(self, bad_words: list[str] | None) -> list[list[int]] | None:
        """Token ids of each bad word, alone and after a space when that tokenizes to other
        tokens of the same count (vLLM's `update_from_tokenizer`)."""
        if not bad_words:
            return None
        if self.tokenizer is None:
            raise InvalidRequestError(
                "bad_words needs a tokenizer; this engine has none", "bad_words"
            )
        words: list[list[int]] = []
        for word in bad_words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if not plain:
                continue
            words.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        bad = [t for word in words for t in word if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"bad_words tokenize to token id {bad[0]}, outside the model's vocabulary "
                f"[0, {self.vocab_size})",
                "bad_words",
            )
        return words

    def _tokenize(
        self, prompt: PromptType, check_length: bool = True
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, check_length)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                token_ids = prompt["prompt_token_ids"]
                if not isinstance(token_ids, list | tuple) or not all(
                    isinstance(t, int) for t in token_ids
                ):
                    raise InvalidRequestError("prompt_token_ids must be a list of ints", "prompt")
                # Plain ints (True is 1, as the engine always read it): the engine core's
                # decoder (msgspec) takes no bool or other type for an int.
                return prompt.get("prompt"), [int(t) for t in token_ids]
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"], check_length)
        raise InvalidRequestError(
            "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}",
            "prompt",
        )

    def _encode(self, text: str, check_length: bool = True) -> list[int]:
        self._check_text(text, check_length)
        return list(self.tokenizer.encode(text))

    def _check_text(self, text: str, check_length: bool = True) -> None:
        """A text prompt's checks before tokenizing: a tokenizer exists, valid Unicode, and
        (`check_length`) not so many characters that it could not fit. Raises
        InvalidRequestError."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this engine has no tokenizer; pass prompt_token_ids", "prompt"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(
                f"the prompt is not valid Unicode: a lone surrogate at character {e.start}",
                "prompt",
            ) from None
        if check_length:
            check_prompt_chars(self.tokenizer, text, self.max_model_len)


def _cache_salt(prompt: PromptType) -> str | None:
    """A prompt's "cache_salt" (None when it has none). Raises InvalidRequestError for one
    that is not a non-empty string of valid Unicode (vLLM's "Parameter 'cache_salt' must be
    a non-empty string if provided.")."""
    if not isinstance(prompt, Mapping) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise InvalidRequestError(
            f"Parameter 'cache_salt' must be a non-empty string if provided, got {salt!r}",
            "cache_salt",
        )
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"cache_salt is not valid Unicode: a lone surrogate at character {e.start}",
            "cache_salt",
        ) from None
    return salt
