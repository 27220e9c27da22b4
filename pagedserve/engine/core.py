"""EngineCore: the scheduler, the KV cache manager and the executor, stepping together.

It sees only token ids. Tokenizing, detokenizing and stop strings happen in the caller
(`LLMEngine` in-process, or the API server's process talking to it over IPC).
"""

import functools
import gc
import logging
import time
from collections import deque
from typing import Any

from pagedserve import envs
from pagedserve.config import EngineConfig, cuda_index
from pagedserve.executor.factory import create_executor
from pagedserve.kv_cache.manager import KVCacheManager, check_fits_cache, max_blocks_held
from pagedserve.messages import EngineCoreOutput, SchedulerStats
from pagedserve.request import Request, RequestStatus
from pagedserve.roofline import ModelCost, model_cost, step_cost
from pagedserve.scheduler import Scheduler
from pagedserve.step import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput
from pagedserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long a step that scheduled nothing waits for a grammar compile (s): new input waits
# at most this long then, and a compile that ends wakes the engine at once.
_GRAMMAR_WAIT_S = 0.02


class EngineCore:
    """Owns the device work. `step()` schedules, runs the model and applies the stop rules."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Seconds of each start-up phase, in order (logged at the end of start-up).
        self.startup_seconds: dict[str, float] = {}
        clock = time.perf_counter()
        self.executor = create_executor(config)
        clock = self._phase("model load", clock)
        block_size = config.cache_config.block_size
        max_model_len = config.model_config.max_model_len
        num_blocks = self.executor.determine_num_blocks()
        clock = self._phase("memory profiling", clock)
        # The window every attention layer uses (None: some layer sees every key). With one,
        # a request holds only the blocks of its window and step, and block 0 is the null block.
        self.sliding_window = self.executor.kv_sliding_window()
        max_step_tokens = config.scheduler_config.max_num_batched_tokens
        blocks_per_max_request = max_blocks_held(
            max_model_len, block_size, self.sliding_window, max_step_tokens
        )
        num_usable_blocks = num_blocks - (self.sliding_window is not None)
        if num_usable_blocks < blocks_per_max_request:
            raise ValueError(
                f"the KV cache holds {num_usable_blocks} blocks ({num_usable_blocks * block_size} "
                f"tokens) but one request of max_model_len ({max_model_len}) tokens needs "
                f"{blocks_per_max_request}; give more memory (kv_cache_memory_bytes, "
                f"gpu_memory_utilization) or lower max_model_len"
            )
        self.executor.initialize_cache(num_blocks)
        clock = self._phase("KV cache, CUDA graphs and warm-up", clock)
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); maximum concurrency for "
            "%d-token requests: %.2fx%s",
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_blocks * self.executor.block_bytes / 2**20,
            max_model_len,
            num_usable_blocks / blocks_per_max_request,
            "" if self.sliding_window is None else f" (sliding window {self.sliding_window})",
        )
        # The same CPU block counts as each worker's (`runner_setup.initialize_kv_cache`).
        num_swap_blocks, num_offload_blocks = config.cpu_block_counts(self.executor.block_bytes)
        self.kv_cache = KVCacheManager(
            num_blocks,
            block_size,
            config.cache_config.enable_prefix_caching,
            sliding_window=self.sliding_window,
            num_swap_blocks=num_swap_blocks,
            num_offload_blocks=num_offload_blocks,
        )
        self.structured_output_manager = _structured_output_manager(config)
        self.scheduler = Scheduler(
            config.scheduler_config, self.kv_cache, max_model_len, self.structured_output_manager
        )
        async_scheduling = config.scheduler_config.async_scheduling
        # Default: on where the device runs asynchronously to the host.
        self.async_scheduling = (
            self.executor.device_type == "cuda" if async_scheduling is None else async_scheduling
        )
        # Pipeline parallelism: up to pipeline_parallel_size steps on the ranks at once (the
        # batch queue, vLLM's max_concurrent_batches), each of requests whose last token is
        # back; it overlaps the host with the device in place of async scheduling.
        self.max_concurrent_batches: int = getattr(self.executor, "max_concurrent_batches", 1)
        self._batch_queue: deque[tuple[SchedulerOutput, AsyncModelRunnerOutput, float]] = deque()
        if self.max_concurrent_batches > 1:
            self.async_scheduling = False
            self.scheduler.skip_in_flight = True
            logger.info(
                "pipeline parallelism: up to %d steps in flight (batch queue; async scheduling "
                "does not apply)",
                self.max_concurrent_batches,
            )
        else:
            logger.info("async scheduling: %s", "on" if self.async_scheduling else "off")
        # Structured outputs under async scheduling: a step's bitmask is filled while the
        # device runs its forward (after the step before has applied its tokens), where the
        # executor can split a step so (one rank, in this process).
        self.scheduler.defer_grammar = self.async_scheduling and getattr(
            self.executor, "supports_deferred_grammar", False
        )
        if self.scheduler.defer_grammar:
            if envs.grammar_process():
                self.structured_output_manager.use_grammar_process(
                    self.executor.host_array_pinning()  # type: ignore[attr-defined]
                )
            else:
                allocate = self.executor.bitmask_allocator()  # type: ignore[attr-defined]
                if allocate is not None:
                    self.structured_output_manager.use_bitmask_buffers(allocate)
        # The roofline cost (bytes, FLOPs), token count and device seconds of the forwards
        # whose tokens the last `step()` applied, one rank's; and the device's name (None: a
        # CPU) for its peaks.
        model = config.model_config
        self.model_cost: ModelCost | None
        try:
            self.model_cost = model_cost(
                model.hf_config,
                model.dtype,
                config.cache_config.kv_cache_dtype,
                model.quantization,
                model.max_model_len,
                config.parallel_config.tensor_parallel_size,
            )
        except (AttributeError, TypeError, ValueError, ZeroDivisionError) as e:
            # A figure for the metrics must never stop the engine (configs of the
            # transformers backend name their sizes in many ways).
            logger.info("no MBU/MFU figures: the model's config does not give its sizes (%s)", e)
            self.model_cost = None
        self.step_cost = (0.0, 0.0)
        self.step_tokens = 0
        self.step_seconds = 0.0
        # A forward's seconds: on a GPU its device_seconds (CUDA events); on a CPU, the host's
        # seconds in the calls that launched it and in waiting for its outputs: a CPU runs the
        # forward inside its launch call, so the time from its launch to its outputs (with
        # async scheduling, the previous forward's apply in between) is not its own.
        self._launch_seconds = 0.0  # of the step in flight
        self.device_name = _device_name(config, self.executor.device_type)
        # Async scheduling: the step launched last, whose tokens are not applied yet.
        self._in_flight: tuple[SchedulerOutput, AsyncModelRunnerOutput] | None = None
        # Everything start-up made (modules, weights' Python objects, graphs) lives as long as
        # the engine: keep it out of the garbage collector's scans, which otherwise pause
        # the step loop (vLLM does the same).
        gc.collect()
        gc.freeze()
        self._phase("scheduler and the rest", clock)
        logger.info(
            "engine start-up in %.1f s: %s",
            sum(self.startup_seconds.values()),
            ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.startup_seconds.items()),
        )

    def _phase(self, name: str, since: float) -> float:
        """Record start-up phase `name` as the seconds since `since` (perf_counter); return
        now, the next phase's start."""
        now = time.perf_counter()
        self.startup_seconds[name] = now - since
        return now

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises InvalidRequestError if it could never fit the cache."""
        check_fits_cache(
            request.num_prompt_tokens,
            request.max_tokens,
            self.num_blocks,
            self.config.cache_config.block_size,
            self.sliding_window,
            self.config.scheduler_config.max_num_batched_tokens,
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish these requests as aborted and free their blocks; unknown ids are skipped."""
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish these requests with `status` (a finished one: a stop string matched on the
        caller's side is FINISHED_STOPPED) and free their blocks."""
        self.scheduler.finish_requests(request_ids, status)

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache's blocks that no request holds (KVCacheManager's)."""
        self.kv_cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or bool(self._batch_queue)
        )

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step and model forward; return the tokens it produced.

        With async scheduling, a step launches step N+1 first and then returns the tokens of
        step N, so the host's scheduling and input preparation for N+1 overlap the device's
        work on N. Stop conditions are then applied one step late: a request that stops at N
        may already be in N+1, whose token for it is dropped.

        With pipeline parallelism the batch queue replaces both (`_step_batch_queue`).
        """
        self.step_cost = (0.0, 0.0)
        self.step_tokens = 0
        self.step_seconds = 0.0
        if self.max_concurrent_batches > 1:
            return self._step_batch_queue()
        if not self.async_scheduling:
            return self._step_sync() + self.scheduler.take_pending_outputs()
        outputs = self.scheduler.take_pending_outputs()
        if self._in_flight is not None and not self.scheduler.can_schedule_ahead:
            outputs += self._finish_in_flight()  # (not `=`: that dropped the pending ones)
        self._send_grammar_tokens(wait=False)
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.finished_request_ids:  # let workers drop finished state
                self.executor.execute_model(scheduler_output)
            if self._in_flight is None and not outputs:
                self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
            return outputs + self._finish_in_flight()
        started = time.perf_counter()
        if not scheduler_output.grammar_deferred:
            launched = self.executor.execute_model_async(scheduler_output)
            launch_seconds = time.perf_counter() - started
            outputs += self._finish_in_flight()
        else:
            self._send_grammar_tokens(wait=False)  # a second chance, before the launch
            pending = self.executor.launch_forward(scheduler_output)  # type: ignore[attr-defined]
            launch_seconds = time.perf_counter() - started
            outputs += self._finish_in_flight()  # the tokens the bitmask depends on
            if isinstance(pending, AsyncModelRunnerOutput):  # nothing samples after all
                launched = pending
            else:
                grammar = self.scheduler.deferred_grammar_output(scheduler_output)
                started = time.perf_counter()
                launched = self.executor.sample_tokens(pending, grammar)  # type: ignore[attr-defined]
                launch_seconds += time.perf_counter() - started
        self._in_flight = (scheduler_output, launched)
        self._launch_seconds = launch_seconds
        return outputs

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight and apply its tokens."""
        if self._in_flight is None:
            return []
        self._send_grammar_tokens(wait=True)
        scheduler_output, launched = self._in_flight
        self._in_flight = None
        started = time.perf_counter()
        runner_output = launched.result()
        host_seconds = self._launch_seconds + time.perf_counter() - started
        self._add_step_cost(scheduler_output, runner_output, host_seconds)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _send_grammar_tokens(self, wait: bool) -> None:
        """With the grammar process: send it the sampled tokens of the step in flight as soon
        as they are on the host (without waiting for the device unless `wait`), so that it
        accepts them and fills the next step's rows while this thread schedules and
        launches (StructuredOutputManager.send_step_tokens)."""
        manager = self.structured_output_manager
        if self._in_flight is None or not manager.awaiting_tokens:
            return
        launched = self._in_flight[1]
        if wait or launched.done():
            output = launched.result()
            manager.send_step_tokens(output.request_ids, output.sampled_token_ids)

    def _step_batch_queue(self) -> list[EngineCoreOutput]:
        """Pipeline parallelism's step (vLLM's step_with_batch_queue): submit a step while
        fewer than `max_concurrent_batches` are on the ranks, and return at once when one was
        submitted and there is room for another; else wait for the oldest and apply its
        tokens. So stage 0 runs step N+1 while stage 1 runs N."""
        outputs = self.scheduler.take_pending_outputs()
        submitted = False
        if len(self._batch_queue) < self.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                started = time.perf_counter()
                handle = self.executor.submit_model(scheduler_output)  # type: ignore[attr-defined]
                launch_seconds = time.perf_counter() - started
                self._batch_queue.append((scheduler_output, handle, launch_seconds))
                submitted = True
            elif scheduler_output.finished_request_ids:  # let workers drop finished state
                self.executor.execute_model(scheduler_output)  # after the steps in flight
        if submitted and len(self._batch_queue) < self.max_concurrent_batches:
            return outputs
        if not self._batch_queue:
            if not outputs:
                self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
            return outputs
        scheduler_output, handle, launch_seconds = self._batch_queue.popleft()
        started = time.perf_counter()
        runner_output = handle.result()
        host_seconds = launch_seconds + time.perf_counter() - started
        self._add_step_cost(scheduler_output, runner_output, host_seconds)
        return outputs + self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_sync(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            if scheduler_output.finished_request_ids:  # let workers drop finished state
                self.executor.execute_model(scheduler_output)
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
            return []
        started = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        self._add_step_cost(scheduler_output, runner_output, time.perf_counter() - started)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _add_step_cost(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput, host_seconds: float
    ) -> None:
        """Count a forward whose outputs just came in into `step_tokens`, `step_seconds` (its
        device_seconds, timed by CUDA events; without them (a CPU), `host_seconds`: the
        seconds the host spent launching it and waiting for its outputs) and its roofline
        cost into `step_cost` (nothing without a `model_cost`)."""
        device_seconds = output.device_seconds
        self.step_seconds += host_seconds if device_seconds is None else device_seconds
        self.step_tokens += scheduler_output.total_num_scheduled_tokens
        if self.model_cost is None:
            return
        step_bytes, flops = step_cost(
            self.model_cost,
            (
                (r.num_new_tokens, r.num_computed_tokens + r.num_new_tokens)
                for r in scheduler_output.scheduled_requests
            ),
        )
        self.step_cost = (self.step_cost[0] + step_bytes, self.step_cost[1] + flops)

    def stats(self) -> SchedulerStats:
        """The scheduler's state now (queue lengths, KV cache usage, cumulative counters)."""
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prefix_cache_queries=self.kv_cache.num_query_tokens,
            prefix_cache_hits=self.kv_cache.num_hit_tokens,
            num_swap_outs_total=self.scheduler.num_swap_outs_total,
            num_swap_ins_total=self.scheduler.num_swap_ins_total,
            cpu_prefix_cache_hits=self.kv_cache.num_cpu_hit_tokens,
        )

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()


def _structured_output_manager(config: EngineConfig) -> StructuredOutputManager:
    """The grammar engine of structured outputs. It loads the tokenizer (in its compile
    thread) only when the first constrained request arrives; the grammar process of a GPU
    engine loads it at start, in the background (`use_grammar_process`)."""
    model_config = config.model_config
    # picklable: the grammar process loads it too
    load = functools.partial(load_tokenizer, model_config.tokenizer, model_config.trust_remote_code)
    return StructuredOutputManager(
        load,
        int(model_config.hf_text_config.vocab_size),
        list(model_config.eos_token_ids),
        config.structured_outputs_config.reasoning_parser,
        disable_any_whitespace=config.structured_outputs_config.disable_any_whitespace,
    )


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    """The model's Hugging Face tokenizer from its local folder (the grammar engine's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        path, local_files_only=True, trust_remote_code=trust_remote_code
    )


def _device_name(config: EngineConfig, device_type: str) -> str | None:
    """The CUDA device's name (torch.cuda.get_device_name()) for its roofline peaks; None
    on a CPU."""
    if device_type != "cuda":
        return None
    import torch

    return str(torch.cuda.get_device_name(cuda_index(config.device_config.device)))
