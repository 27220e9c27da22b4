"""ModelRunner: runs one step on a device: per-request state, inputs, forward, sampling.

Start-up (model loading, KV cache sizing and allocation, CUDA graphs, warm-up) is
`runner_setup`'s; the runner holds what it builds (`model`, `kv_caches`, `cuda_graphs`).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.attention.backend import get_attention_backend
from pagedserve.config import EngineConfig
from pagedserve.distributed.comm import tensor_model_parallel_broadcast
from pagedserve.distributed.parallel_state import is_first_pp_rank, is_last_pp_rank
from pagedserve.layers.attention import Attention
from pagedserve.messages import PromptLogprobsData, SampleLogprobsData
from pagedserve.models.pp_utils import IntermediateTensors
from pagedserve.step import (
    AsyncModelRunnerOutput,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.worker.cpu_kv_cache import CpuKVCache
from pagedserve.worker.cuda_graph import CudaGraphRunner
from pagedserve.worker.encoder_cache import build_inputs_embeds
from pagedserve.worker.grammar_bitmask import apply_grammar_bitmask
from pagedserve.worker.input_batch import CachedRequestState, ModelInput, build_model_input
from pagedserve.worker.pp_stage import receive_intermediate, send_to_next_stage
from pagedserve.worker.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from pagedserve.worker.sampling_metadata import SamplingStateManager
from pagedserve.worker.sampling_tensors import SamplingMetadata


@dataclass(frozen=True, slots=True)
class PendingSample:
    """A launched forward whose sampling waits for the step's grammar bitmask."""

    model_input: ModelInput
    logits: torch.Tensor  # [num_sampled_rows, vocab_size] float32, on the device
    prompt_logprobs: dict[str, PromptLogprobsData]
    started: "torch.cuda.Event | None" = None  # before the step's first kernel (None: a CPU)


class ModelRunner:
    """Runs the model for a SchedulerOutput and returns the sampled tokens.

    Keeps each running request's state (block table, prompt, sampling state); the scheduler
    sends only what changed each step.
    """

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        """device: this rank's device (the Worker's). The model and the KV cache come later
        (`runner_setup.load_model`, `runner_setup.initialize_kv_cache`)."""
        self.config = config
        self.device = device
        self.block_size = config.cache_config.block_size
        self.model_dtype = torch.float32
        self.kv_cache_dtype = torch.float32  # the model's, or fp8 (`--kv-cache-dtype`)
        self.model: torch.nn.Module | None = None
        self.attention_layers: list[Attention] = []
        self.kv_caches: list[torch.Tensor] = []
        # Swap space and the prefix cache's CPU tier (`runner_setup.initialize_kv_cache`).
        self.cpu_kv_cache: CpuKVCache | None = None
        self.states: dict[str, CachedRequestState] = {}
        # The requests in `states` with images: a step may need `inputs_embeds` only then.
        self._image_request_ids: set[str] = set()
        self.sampler = Sampler()
        self.sampling_states = SamplingStateManager(_vocab_size(config), self.device)
        self.cuda_graphs: CudaGraphRunner | None = None
        # The last step's sampled tokens on the device ([num_sampled] int64) and each sampled
        # request's row in them: the source of the next step's placeholder tokens.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.backend = get_attention_backend(config.device_config.attention_backend, self.device)
        # Pipeline parallelism: this rank's stage (`pp_stage`); both True on one stage.
        self.is_first_stage = is_first_pp_rank()
        self.is_last_stage = is_last_pp_rank()

    @property
    def uses_mrope(self) -> bool:
        """Whether the model takes M-RoPE positions [3, num_tokens] (Qwen2.5-VL)."""
        return bool(getattr(self.model, "uses_mrope", False))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.execute_model_async(scheduler_output).result()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step: the forward, the sampler, and the copy of the sampled tokens to
        pinned host memory, without waiting for the device. The next step may then be launched
        before this one's tokens reach the host: its placeholder tokens
        (`PLACEHOLDER_TOKEN_ID`) are taken from this step's sampled tokens on the device."""
        forward = self.launch_forward(scheduler_output)
        if isinstance(forward, AsyncModelRunnerOutput):
            return forward
        return self.sample_tokens(forward, scheduler_output.grammar)

    @torch.inference_mode()
    def launch_forward(
        self, scheduler_output: SchedulerOutput
    ) -> "PendingSample | AsyncModelRunnerOutput":
        """The first half of `execute_model_async`: launch the forward and the logits. Returns
        what `sample_tokens` finishes, or the step's output when nothing samples. A step with
        a deferred grammar (`SchedulerOutput.grammar_deferred`) goes this way: its bitmask is
        filled on the host while the device runs this forward (vLLM's split of execute_model
        and sample_tokens). The step's block copies (swaps) come first."""
        self._update_states(scheduler_output)
        if scheduler_output.blocks_to_swap_out or scheduler_output.blocks_to_swap_in:
            if self.cpu_kv_cache is None:
                raise RuntimeError("a step copies KV blocks to or from a CPU KV cache that "
                                   "this worker did not allocate")  # fmt: skip
            self.cpu_kv_cache.swap(
                self.kv_caches,
                scheduler_output.blocks_to_swap_out,
                scheduler_output.blocks_to_swap_in,
            )
        if not scheduler_output.scheduled_requests:
            return AsyncModelRunnerOutput(ModelRunnerOutput([], [], []))
        started = _timing_event(self.device)
        model_input = build_model_input(
            scheduler_output, self.states, self.block_size, self.device, self.uses_mrope
        )
        if model_input.placeholder_request_ids:
            self._fill_placeholders(model_input)
        assert self.model is not None
        attn_metadata = model_input.attn_metadata
        inputs_embeds = None
        if self._image_request_ids:
            inputs_embeds = build_inputs_embeds(
                self.model,
                scheduler_output.scheduled_requests,
                self.states,
                model_input.input_ids,
                attn_metadata.query_start_loc_cpu.tolist(),
            )
        if not (self.is_first_stage and self.is_last_stage):
            return self._run_stage(model_input, scheduler_output, started)
        if inputs_embeds is not None:  # a step that feeds image tokens (a prefill)
            hidden_states = self.model(
                model_input.input_ids,
                model_input.positions,
                attn_metadata,
                inputs_embeds=inputs_embeds,
            )
        elif self.cuda_graphs is not None and self.cuda_graphs.can_run(
            attn_metadata.num_reqs, attn_metadata.max_query_len
        ):
            hidden_states = self.cuda_graphs.run(
                model_input.input_ids, model_input.positions, attn_metadata
            )
        else:
            hidden_states = self.model(model_input.input_ids, model_input.positions, attn_metadata)
        return self._finish_forward(hidden_states, scheduler_output, model_input, started)

    def _finish_forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size], final norm applied
        scheduler_output: SchedulerOutput,
        model_input: ModelInput,
        started: "torch.cuda.Event | None",
    ) -> "PendingSample | AsyncModelRunnerOutput":
        """The prompt logprobs and the logits of the sampled rows (on the last stage)."""
        prompt_logprobs = self._prompt_logprobs(hidden_states, scheduler_output, model_input)
        if not model_input.sampled_request_ids:  # prompt chunks only
            output = ModelRunnerOutput([], [], [], prompt_logprobs)
            if started is None:
                return AsyncModelRunnerOutput(output)
            ended = _timing_event(self.device)
            return AsyncModelRunnerOutput(None, lambda: _timed(output, started, ended), ended)
        logits = self._compute_logits(hidden_states[model_input.logits_indices])
        return PendingSample(model_input, logits, prompt_logprobs, started)

    def _run_stage(
        self,
        model_input: ModelInput,
        scheduler_output: SchedulerOutput,
        started: "torch.cuda.Event | None",
    ) -> "PendingSample | AsyncModelRunnerOutput":
        """This pipeline stage's forward (pipeline_parallel_size > 1; no CUDA graphs, no
        image inputs): receive the previous stage's output unless first, run this stage's
        layers, then send the result on (`pp_stage.finish_inner_stage`) or, on the last
        stage, go on to the logits as one stage does."""
        assert self.model is not None
        intermediate = None
        if not self.is_first_stage:
            intermediate = receive_intermediate(
                model_input.input_ids.shape[0],
                int(self.config.model_config.hf_text_config.hidden_size),
                self.model_dtype,
                self.device,
            )
        out = self.model(
            model_input.input_ids,
            model_input.positions,
            model_input.attn_metadata,
            intermediate_tensors=intermediate,
        )
        if not self.is_last_stage:
            assert isinstance(out, IntermediateTensors)
            return send_to_next_stage(out)
        return self._finish_forward(out, scheduler_output, model_input, started)

    @torch.inference_mode()
    def sample_tokens(
        self, pending: "PendingSample", grammar: GrammarOutput | None
    ) -> AsyncModelRunnerOutput:
        """The second half of `execute_model_async`: apply the grammar bitmask (structured
        outputs: before any other logits processing), sample, and start the copy to host."""
        model_input, logits = pending.model_input, pending.logits
        if grammar is not None:
            apply_grammar_bitmask(logits, grammar, model_input.sampled_request_ids)
        metadata = self._sampling_metadata(model_input)
        sampler_output = self.sampler.forward(logits, metadata)
        # Every rank (of the last pipeline stage: the only one that samples) feeds its tp
        # rank 0's tokens at the next step's placeholders (random draws are not guaranteed
        # equal across ranks).
        tensor_model_parallel_broadcast(sampler_output.sampled_token_ids)
        self._prev_sampled = sampler_output.sampled_token_ids
        self._prev_rows = {r: i for i, r in enumerate(model_input.sampled_request_ids)}
        host_output, ready = _copy_to_host(sampler_output)
        prompt_logprobs, started = pending.prompt_logprobs, pending.started

        def build() -> ModelRunnerOutput:
            output = _to_runner_output(model_input, host_output, metadata, prompt_logprobs)
            return _timed(output, started, ready)

        return AsyncModelRunnerOutput(None, build, ready)

    def _fill_placeholders(self, model_input: ModelInput) -> None:
        """Put the tokens the previous step sampled where this step feeds placeholders."""
        rows = [self._prev_rows.get(r, -1) for r in model_input.placeholder_request_ids]
        if self._prev_sampled is None or min(rows) < 0:
            raise RuntimeError(
                "a step feeds a placeholder token that the previous step did not sample"
            )
        rows_t = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        positions = model_input.placeholder_positions.to(self.device, non_blocking=True)
        model_input.input_ids[positions] = self._prev_sampled[rows_t]

    def _compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_rows, hidden_size]
    ) -> torch.Tensor:  # [num_rows, vocab_size] float32
        assert self.model is not None
        compute: Callable[[torch.Tensor], torch.Tensor] = self.model.compute_logits  # type: ignore[assignment]
        return compute(hidden_states)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
            self._image_request_ids.discard(request_id)
            self.sampling_states.remove_request(request_id)
        for new in scheduler_output.new_requests:
            self.states[new.request_id] = self._new_state(new)
        for scheduled in scheduler_output.scheduled_requests:
            self.states[scheduled.request_id].block_ids.extend(scheduled.new_block_ids)
        self.sampling_states.record_fed_tokens(scheduler_output.scheduled_requests)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        """A request resumed after preemption starts a new block table but keeps its sampling
        state (token counts, seed), which `add_request` leaves as it is."""
        self.sampling_states.add_request(new.request_id, new.sampling_params, new.prompt_token_ids)
        if new.mm_features:
            self._image_request_ids.add(new.request_id)
        state = CachedRequestState(
            new.request_id,
            new.num_prompt_tokens,
            new.sampling_params,
            new.prompt_token_ids,
            mm_features=new.mm_features,
        )
        if self.uses_mrope:  # once per request: its prompt's 3-D positions and their delta
            model: Any = self.model
            positions, delta = model.get_mrope_input_positions(
                new.prompt_token_ids, new.mm_features
            )
            state.mrope_positions, state.mrope_position_delta = positions, delta
        return state

    def _sampling_metadata(self, model_input: ModelInput) -> SamplingMetadata:
        return self.sampling_states.build_metadata(
            model_input.sampled_request_ids, model_input.sampled_seq_lens
        )

    def _prompt_logprobs(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        scheduler_output: SchedulerOutput,
        model_input: ModelInput,
    ) -> dict[str, PromptLogprobsData]:
        """Logprobs of the prompt tokens this step scores, for the requests that ask: the
        hidden state at position j scores prompt token j + 1."""
        if self.sampling_states.num_prompt_logprob_requests == 0:
            return {}
        assert self.model is not None
        starts = model_input.attn_metadata.query_start_loc_cpu.tolist()
        result = {}
        for i, scheduled in enumerate(scheduler_output.scheduled_requests):
            state = self.states[scheduled.request_id]
            num_logprobs = state.sampling_params.prompt_logprobs
            first = scheduled.num_computed_tokens
            end = min(first + scheduled.num_new_tokens, state.num_prompt_tokens - 1)
            if num_logprobs is None or end <= first:
                continue
            result[scheduled.request_id] = compute_prompt_logprobs(
                self._compute_logits,
                hidden_states[starts[i] : starts[i] + end - first],
                state.prompt_token_ids[first + 1 : end + 1],
                num_logprobs,
                first + 1,
            )
        return result


def _vocab_size(config: EngineConfig) -> int:
    return int(config.model_config.hf_text_config.vocab_size)


def _timing_event(device: torch.device) -> "torch.cuda.Event | None":
    """A CUDA event with timing, recorded now on the current stream; None on a CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


def _timed(
    output: ModelRunnerOutput,
    started: "torch.cuda.Event | None",
    ended: "torch.cuda.Event | None",
) -> ModelRunnerOutput:
    """`output` with its `device_seconds` (both events done: called after `ended` synced)."""
    if started is None or ended is None:
        return output
    seconds = started.elapsed_time(ended) / 1e3
    return dataclasses.replace(output, device_seconds=seconds)


def _copy_to_host(out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """Start copying the sampler's tensors to pinned host memory, behind the step's kernels
    on the current stream; the event marks the copy's end. On the CPU, nothing to do."""
    if out.sampled_token_ids.device.type != "cuda":
        return out, None

    def to_host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    host_out = SamplerOutput(
        sampled_token_ids=to_host(out.sampled_token_ids),  # type: ignore[arg-type]
        logprob_token_ids=to_host(out.logprob_token_ids),
        logprobs=to_host(out.logprobs),
        sampled_ranks=to_host(out.sampled_ranks),
    )
    ready = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    ready.record()  # (with timing: the step's end for ModelRunnerOutput.device_seconds)
    return host_out, ready


def _to_runner_output(
    model_input: ModelInput,
    out: SamplerOutput,
    metadata: SamplingMetadata,
    prompt_logprobs: dict[str, PromptLogprobsData],
) -> ModelRunnerOutput:
    sampled = out.sampled_token_ids.tolist()
    logprobs: list[SampleLogprobsData | None] = [None] * len(sampled)
    if out.logprobs is not None:
        assert out.logprob_token_ids is not None and out.sampled_ranks is not None
        token_ids, values = out.logprob_token_ids.tolist(), out.logprobs.tolist()
        ranks = out.sampled_ranks.tolist()
        wanted = [(row, n) for row, n in enumerate(metadata.num_logprobs) if n is not None]
        for i, (row, num) in enumerate(wanted):  # the order of metadata.logprob_rows
            logprobs[row] = SampleLogprobsData(
                token_ids[i][: 1 + num], values[i][: 1 + num], ranks[i]
            )
    return ModelRunnerOutput(model_input.sampled_request_ids, sampled, logprobs, prompt_logprobs)
