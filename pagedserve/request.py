"""Request: one prompt and its generation as the scheduler sees it (no tensors)."""

import enum
import time
from collections.abc import Sequence
from typing import Any

from pagedserve.multimodal import MultiModalFeature
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
}


class FinishReason(enum.Enum):
    """Why a request ended; the values are OpenAI's `finish_reason` strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One prompt and its generation. `num_computed_tokens` counts tokens whose K/V are in the
    cache or being written by the step in flight (prefix-cache hits included)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        sharing_group: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        mm_features: Sequence[MultiModalFeature] = (),
    ) -> None:
        self.request_id = request_id
        # The prompt's images, in prompt order (their placeholder tokens are in the prompt).
        self.mm_features = tuple(mm_features)
        # Order under the "priority" scheduling policy: lower runs first (vLLM's meaning).
        self.priority = priority
        # Salts the prefix-cache hashes (vLLM's cache_salt): only requests with the same salt
        # (or none) share blocks.
        self.cache_salt = cache_salt
        # The user request this one is a sequence of (n > 1): siblings share prompt blocks
        # even with prefix caching off.
        self.sharing_group = sharing_group
        self.sampling_params = sampling_params
        if sampling_params.max_tokens is None:
            raise ValueError(
                "a Request needs a resolved max_tokens (InputProcessor.process sets it), got None"
            )
        self.max_tokens = sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens being sampled by steps in flight (async scheduling): scheduled past, but not
        # in `all_token_ids` yet: at most 2 (the step in flight's and the one just scheduled);
        # 0 between steps when the engine runs one step at a time.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.stop_token_ids = sampling_params.all_stop_token_ids
        # Prompt logprobs need the logits of every prompt position, so no position may be a
        # prefix-cache hit (vLLM's Request.skip_reading_prefix_cache). Its blocks are still
        # written to the cache for the requests after it.
        self.skip_reading_prefix_cache = sampling_params.prompt_logprobs is not None
        # The grammar state of a request with `structured_outputs` (a
        # structured_output.manager.StructuredOutputRequest, set by the StructuredOutputManager
        # when the scheduler admits it; typed Any: this leaf imports nothing of the engine).
        self.structured_output: Any = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens to feed the model, counting in-flight ones (placeholders) as known."""
        return len(self.all_token_ids) + self.num_output_placeholders - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still consuming the prompt (or recomputing after preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def needs_output_tokens(self) -> bool:
        """Its sampling reads its past output tokens on the host (penalties, bad words)."""
        params = self.sampling_params
        return params.uses_penalties or bool(params.bad_words_token_ids)

    def ends_in_flight(self, max_model_len: int) -> bool:
        """The token the step in flight samples for it is its last (length limits), so there
        is nothing to schedule after it."""
        pending = self.num_output_placeholders
        return pending > 0 and (
            self.num_output_tokens + pending >= self.max_tokens
            or self.num_tokens + pending >= max_model_len
        )

    def check_stop(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """The finished status its just-appended `token_id` gives it (a stop token, a length
        limit), setting `stop_reason` for a user stop token; None while it goes on."""
        params = self.sampling_params
        if token_id in self.stop_token_ids and self.num_output_tokens > params.min_tokens:
            if token_id not in params.eos_token_ids or params.ignore_eos:
                self.stop_reason = token_id  # a user stop token, not EOS
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)
