"""The plain-data contract between the scheduler and the workers, one step at a time, and the
handle of a step's output that is still on its way from the device (no torch here)."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

# The logprobs data are messages too (they reach the API server's process in EngineCoreOutput);
# re-exported here, where the workers produce them.
from pagedserve.messages import PromptLogprobsData, SampleLogprobsData
from pagedserve.multimodal import MultiModalFeature
from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Sent once when a request is first scheduled, or again when it resumes after preemption.

    The worker (re)creates its per-request state from it, with an empty block table. It needs
    the prompt's tokens even where the prefix cache spares feeding them: repetition penalties
    count them, and prompt logprobs score them.
    """

    request_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    # The prompt's images (pixels and placeholder ranges), encoded by the worker when a step
    # first feeds their tokens; () for a text-only prompt.
    mm_features: tuple[MultiModalFeature, ...] = ()


# Stands in `ScheduledRequest.token_ids` for the token that the step in flight samples (async
# scheduling); the worker puts that step's sampled token there, on the device.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's work in this step.

    |<-------- num_computed_tokens -------->|<-- token_ids (num_new_tokens) -->|
    The worker appends `new_block_ids` to the request's block table before running, and
    samples a next token only when `sample` (the step reaches the end of the known tokens;
    a partial prefill chunk does not sample).
    """

    request_id: str
    token_ids: list[int]  # the tokens fed to the model this step; the last may be a placeholder
    num_computed_tokens: int  # before this step
    new_block_ids: list[int]
    sample: bool

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class GrammarOutput:
    """The token bitmask of the step's constrained requests (vLLM's GrammarOutput).

    Row i is for `structured_output_request_ids[i]` (each of them samples this step): bit t
    of int32 word t // 32 set = token t allowed. [num_constrained_rows, ceil(vocab_size / 32)]
    int32; the sampler bans the rest of that request's logits row.
    """

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the workers need for one step; requests in batch order."""

    new_requests: list[NewRequestData]
    scheduled_requests: list[ScheduledRequest]
    finished_request_ids: set[str] = field(default_factory=set)  # drop their worker state
    grammar: GrammarOutput | None = None  # None: no constrained request samples this step
    # The bitmask comes after the forward is launched (`Scheduler.deferred_grammar_output`,
    # once the step before has applied its tokens): a constrained request samples this step.
    grammar_deferred: bool = False
    # Block copies the workers do before the step's forward, all swap-outs first (vLLM v0's
    # names; see kv_cache/cpu_blocks.py): (GPU block id, CPU block id) of preempted requests'
    # blocks (preemption_mode "swap") and of evicted cached blocks (the prefix cache's CPU
    # tier), then (CPU block id, GPU block id) of resumed requests and CPU-tier hits.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> its new tokens this step (vLLM's `num_scheduled_tokens`)."""
        return {r.request_id: r.num_new_tokens for r in self.scheduled_requests}

    @property
    def total_num_scheduled_tokens(self) -> int:
        """The step's size: the tokens fed to the model."""
        return sum(r.num_new_tokens for r in self.scheduled_requests)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to run: no request and no block copy."""
        return not (self.scheduled_requests or self.blocks_to_swap_out or self.blocks_to_swap_in)


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """Sampled tokens of the requests whose step ended with `sample`, in batch order, and the
    prompt logprobs of the requests that ask for them (sampled this step or not)."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[SampleLogprobsData | None]  # per sampled request; None when not asked
    prompt_logprobs: dict[str, PromptLogprobsData] = field(default_factory=dict)
    # The step's seconds on the device (CUDA events around its kernels: from the first input
    # copy to the sampled tokens' copy to host); None on a CPU.
    device_seconds: float | None = None


class DeviceEvent(Protocol):
    """What AsyncModelRunnerOutput needs of a `torch.cuda.Event`."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class AsyncModelRunnerOutput:
    """A step's ModelRunnerOutput, which may still be on its way from the device.

    `result()` waits for the step's device->host copy (a CUDA event), then builds the output
    on the host. Mirrors vLLM's AsyncModelRunnerOutput (vllm/v1/outputs.py).
    """

    def __init__(
        self,
        output: ModelRunnerOutput | None,
        build: Callable[[], ModelRunnerOutput] | None = None,
        ready: DeviceEvent | None = None,
    ) -> None:
        self._output = output
        self._build = build
        self._ready = ready

    def done(self) -> bool:
        """Whether `result()` would not wait for the device."""
        return self._output is not None or self._ready is None or self._ready.query()

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._build is not None
            if self._ready is not None:
                self._ready.synchronize()
            self._output = self._build()
            self._build = None
        return self._output
