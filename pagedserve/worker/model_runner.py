"""ModelRunner: loads the model, owns the KV cache tensors and runs one step on a device."""

import logging
from collections.abc import Callable

import torch

from pagedserve.attention.backend import get_attention_backend
from pagedserve.config import EngineConfig
from pagedserve.distributed.comm import tensor_model_parallel_broadcast
from pagedserve.layers.attention import Attention
from pagedserve.models.loader import load_model
from pagedserve.step import (
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobsData,
    SampleLogprobsData,
    SchedulerOutput,
)
from pagedserve.worker.cuda_graph import CudaGraphRunner
from pagedserve.worker.dummy_steps import profiling_step, warm_up_steps
from pagedserve.worker.input_batch import CachedRequestState, ModelInput, build_model_input
from pagedserve.worker.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from pagedserve.worker.sampling_metadata import SamplingMetadata, SamplingStateManager

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_CPU_DEFAULT_KV_FRACTION = 0.25  # of available RAM
_CPU_DEFAULT_KV_CAP = 2 << 30  # bytes


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: object, device: torch.device) -> torch.dtype:
    """ "auto" takes the checkpoint's dtype, except half precision on CPU, which runs float32."""
    if name != "auto":
        return _DTYPES[name]
    config_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(config_dtype, str):
        config_dtype = _DTYPES.get(config_dtype)
    if not isinstance(config_dtype, torch.dtype) or config_dtype not in _DTYPES.values():
        config_dtype = torch.float32
    if device.type == "cpu" and config_dtype != torch.float32:
        return torch.float32
    return config_dtype


class AsyncModelRunnerOutput:
    """A step's ModelRunnerOutput, which may still be on its way from the device.

    `result()` waits for the step's device->host copy (a CUDA event), then builds the output
    on the host. Mirrors vLLM's AsyncModelRunnerOutput.
    """

    def __init__(
        self,
        output: ModelRunnerOutput | None,
        build: Callable[[], ModelRunnerOutput] | None = None,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        self._output = output
        self._build = build
        self._ready = ready

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._build is not None
            if self._ready is not None:
                self._ready.synchronize()
            self._output = self._build()
            self._build = None
        return self._output


class ModelRunner:
    """Runs the model for a SchedulerOutput and returns the sampled tokens.

    Keeps each running request's state (block table, prompt, sampling state); the scheduler
    sends only what changed each step.
    """

    def __init__(self, config: EngineConfig, device: torch.device | None = None) -> None:
        """device: this rank's device (a tensor-parallel worker passes its own); default:
        `config.device_config.device` resolved."""
        self.config = config
        self.device = device or resolve_device(config.device_config.device)
        self.block_size = config.cache_config.block_size
        self.model_dtype = torch.float32
        self.model: torch.nn.Module | None = None
        self.attention_layers: list[Attention] = []
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.sampling_states = SamplingStateManager(_vocab_size(config), self.device)
        self.cuda_graphs: CudaGraphRunner | None = None
        # The last step's sampled tokens on the device ([num_sampled] int64) and each sampled
        # request's row in them: the source of the next step's placeholder tokens.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        self.backend = get_attention_backend(config.device_config.attention_backend, self.device)

    def load_model(self) -> None:
        model_config = self.config.model_config
        self.model_dtype = resolve_dtype(model_config.dtype, model_config.hf_config, self.device)
        torch.manual_seed(model_config.seed)
        self.model = load_model(
            model_config.model,
            model_config.hf_config,
            self.model_dtype,
            self.device,
            model_config.load_format,
        )
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attention_layers:
            layer.backend = self.backend

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers."""
        element_size = torch.tensor([], dtype=self.model_dtype).element_size()
        return sum(
            2 * self.block_size * layer.num_kv_heads * layer.head_dim * element_size
            for layer in self.attention_layers
        )

    def determine_num_blocks(self) -> int:
        """Blocks the KV cache can hold: the override, else the memory given, else sized from
        the device (GPU: profiled; CPU: a quarter of free RAM, capped at 2 GiB and at what
        `max_num_seqs` requests of `max_model_len` tokens can use)."""
        cache_config = self.config.cache_config
        if cache_config.num_gpu_blocks_override is not None:
            return cache_config.num_gpu_blocks_override
        if cache_config.kv_cache_memory_bytes is not None:
            return cache_config.kv_cache_memory_bytes // self.block_bytes
        if self.device.type == "cuda":
            return self._profile_num_blocks()
        available = _available_ram_bytes()
        budget = min(int(available * _CPU_DEFAULT_KV_FRACTION), _CPU_DEFAULT_KV_CAP)
        max_useful = self.config.scheduler_config.max_num_seqs * -(
            -self.config.model_config.max_model_len // self.block_size
        )
        return max(min(budget // self.block_bytes, max_useful), 1)

    def _profile_num_blocks(self) -> int:
        """Run the largest step once, measure peak memory, give the rest to KV blocks."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.scheduler_config.max_num_batched_tokens
        max_model_len = self.config.model_config.max_model_len
        seq_len = min(num_tokens, max_model_len)
        num_reqs = max(num_tokens // seq_len, 1)
        num_profile_blocks = num_reqs * -(-seq_len // self.block_size)
        self._allocate_kv_cache(num_profile_blocks)
        fake = profiling_step(num_reqs, seq_len, self.block_size)
        self.execute_model(fake)
        self.execute_model(SchedulerOutput([], [], {r.request_id for r in fake.new_requests}))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - num_profile_blocks * self.block_bytes
        self.kv_caches = []
        for layer in self.attention_layers:
            layer.kv_cache = None
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        kv_bytes = int(total * self.config.cache_config.gpu_memory_utilization) - peak
        logger.info(
            "profiling: peak %.2f GiB without KV cache; %.2f GiB for KV blocks",
            peak / 2**30,
            kv_bytes / 2**30,
        )
        return max(kv_bytes // self.block_bytes, 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then capture CUDA graphs for decode batches when they apply
        (CUDA device, a graph-capturable backend, and not `enforce_eager`)."""
        self._allocate_kv_cache(num_blocks)
        if (
            self.device.type == "cuda"
            and not self.config.device_config.enforce_eager
            and self.backend.name == "triton"
        ):
            assert self.model is not None
            self.cuda_graphs = CudaGraphRunner(
                self.model,
                self.config.scheduler_config.max_num_seqs,
                self.config.model_config.max_model_len,
                self.block_size,
                self.device,
            )
            self.cuda_graphs.capture()
        if self.device.type == "cuda":
            self.warm_up(num_blocks)

    def warm_up(self, num_blocks: int) -> None:
        """Run a few throw-away steps of the shapes the engine meets (a prefill, a prefill
        beside decodes, long decodes that split the KV range) so that Triton compiles their
        kernel variants now rather than inside the first requests. The steps write K/V into
        free blocks, which nothing reads before it is written again."""
        long_len = min(self.config.model_config.max_model_len - 2, 600)
        blocks_per_request = -(-(long_len + 2) // self.block_size)
        if long_len < 2 or 3 * blocks_per_request > num_blocks:
            return
        for step in warm_up_steps(long_len, self.block_size, blocks_per_request):
            self.execute_model(step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer, zeroed
        (the torch backend reads padded slots under a mask; zeros keep them finite). Raises
        ValueError, naming the options that set the size, when it does not fit (on the CPU:
        more than the RAM available now, which zeroed pages would otherwise take later)."""
        num_bytes = num_blocks * self.block_bytes
        what = (
            f"a KV cache of {num_blocks} blocks ({num_bytes / 2**30:.2f} GiB) does not fit on "
            f"{self.device}; lower kv_cache_memory_bytes, num_gpu_blocks_override or "
            f"gpu_memory_utilization"
        )
        available = _known_available_ram_bytes()
        if self.device.type == "cpu" and available is not None and num_bytes > available:
            raise ValueError(f"{what} ({available / 2**30:.2f} GiB RAM available)")
        try:
            self._allocate_kv_tensors(num_blocks)
        except torch.OutOfMemoryError as e:
            raise ValueError(f"{what}: {e}") from None
        except RuntimeError as e:
            if "alloc" not in str(e).lower():
                raise
            raise ValueError(f"{what}: {e}") from None

    def _allocate_kv_tensors(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attention_layers:
            cache = torch.zeros(
                2,
                num_blocks,
                self.block_size,
                layer.num_kv_heads,
                layer.head_dim,
                dtype=self.model_dtype,
                device=self.device,
            )
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.execute_model_async(scheduler_output).result()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step: the forward, the sampler, and the copy of the sampled tokens to
        pinned host memory, without waiting for the device. The next step may then be launched
        before this one's tokens reach the host: its placeholder tokens
        (`PLACEHOLDER_TOKEN_ID`) are taken from this step's sampled tokens on the device."""
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return AsyncModelRunnerOutput(ModelRunnerOutput([], [], []))
        model_input = build_model_input(scheduler_output, self.states, self.block_size, self.device)
        if model_input.placeholder_request_ids:
            self._fill_placeholders(model_input)
        assert self.model is not None
        attn_metadata = model_input.attn_metadata
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(
            attn_metadata.num_reqs, attn_metadata.max_query_len
        ):
            hidden_states = self.cuda_graphs.run(
                model_input.input_ids, model_input.positions, attn_metadata
            )
        else:
            hidden_states = self.model(model_input.input_ids, model_input.positions, attn_metadata)
        prompt_logprobs = self._prompt_logprobs(hidden_states, scheduler_output, model_input)
        if not model_input.sampled_request_ids:
            return AsyncModelRunnerOutput(ModelRunnerOutput([], [], [], prompt_logprobs))
        logits = self._compute_logits(hidden_states[model_input.logits_indices])
        metadata = self._sampling_metadata(model_input)
        sampler_output = self.sampler.forward(logits, metadata)
        # Every rank feeds rank 0's tokens at the next step's placeholders (random draws
        # are not guaranteed equal across ranks).
        tensor_model_parallel_broadcast(sampler_output.sampled_token_ids)
        self._prev_sampled = sampler_output.sampled_token_ids
        self._prev_rows = {r: i for i, r in enumerate(model_input.sampled_request_ids)}
        host_output, ready = _copy_to_host(sampler_output)
        return AsyncModelRunnerOutput(
            None,
            lambda: _to_runner_output(model_input, host_output, metadata, prompt_logprobs),
            ready,
        )

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
            self.sampling_states.remove_request(request_id)
        for new in scheduler_output.new_requests:
            self.states[new.request_id] = self._new_state(new)
        copies: list[tuple[int, int]] = []
        for scheduled in scheduler_output.scheduled_requests:
            block_ids = self.states[scheduled.request_id].block_ids
            if scheduled.block_copy is not None:  # copy-on-write of a shared partial block
                index, source, copy = scheduled.block_copy
                block_ids[index] = copy
                copies.append((source, copy))
            block_ids.extend(scheduled.new_block_ids)
            for sibling_id in scheduled.fork_request_ids:
                self.states[sibling_id].block_ids = list(block_ids)
        if copies:
            self._copy_blocks(copies)
        self.sampling_states.record_fed_tokens(scheduler_output.scheduled_requests)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (K and V, every layer) from source to destination ids."""
        sources = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        destinations = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        for cache in self.kv_caches:  # [2, num_blocks, block_size, num_kv_heads, head_dim]
            cache.index_copy_(1, destinations, cache.index_select(1, sources))

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        """A request resumed after preemption starts a new block table but keeps its sampling
        state (token counts, seed), which `add_request` leaves as it is."""
        self.sampling_states.add_request(new.request_id, new.sampling_params, new.prompt_token_ids)
        return CachedRequestState(
            new.request_id, new.num_prompt_tokens, new.sampling_params, new.prompt_token_ids
        )

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
    return int(config.model_config.hf_config.vocab_size)


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
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
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


def _available_ram_bytes() -> int:
    """MemAvailable (Linux), else a guess of 8 GiB: for sizing the default CPU KV cache."""
    known = _known_available_ram_bytes()
    return 8 << 30 if known is None else known


def _known_available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
