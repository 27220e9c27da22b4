"""AsyncLLMEngine: asyncio front end of an engine core running in its own process."""

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pagedserve.config import ModelConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_client import EngineCoreClient, wait_readable
from pagedserve.engine.data_parallel import CoreLoads, start_cores, start_options
from pagedserve.engine.hub import is_local
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.llm_engine import (
    build_processors,
    log_generation_defaults,
    register_request,
)
from pagedserve.engine.request_stream import RequestStream as RequestStream
from pagedserve.engine.server_config import server_config
from pagedserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    PagedServeError,
    RequestFailedError,
)
from pagedserve.messages import EngineCoreOutputs
from pagedserve.metrics import EngineMetrics, engine_metrics
from pagedserve.outputs import RequestOutput
from pagedserve.roofline import device_peaks
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """vLLM's `AsyncLLMEngine` API: `generate` (an async iterator of RequestOutputs) and `abort`.

    This process tokenizes, validates, detokenizes and applies stop strings (InputProcessor,
    OutputProcessor); the scheduler and the model run in the engine-core process
    (`EngineCoreClient`), or with `data_parallel_size` N in N of them (`cores`; `core` is the
    first), each request on the least loaded one (`data_parallel.CoreLoads`) for its whole
    life. Background tasks receive the cores' outputs and fan them out to per-request queues.
    If a core dies, every pending and new request fails with EngineDeadError (the engine is
    dead, as vLLM's data-parallel engine). Methods must be called from one event loop.

    `metrics` (default: new EngineMetrics labelled `served_model_name`, else the model's name)
    counts what it does for /metrics and the periodic stats line; with data parallelism there
    is one per core (`engine_metrics`, labelled engine="0", "1", ... in `metrics.registry`;
    `metrics` is core 0's), and passing `metrics` is a ValueError.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        *,
        log_requests: bool = False,
        log_stats: bool = True,
        log_stats_interval_s: float = 10.0,
        metrics: EngineMetrics | None = None,
        served_model_name: str | None = None,
    ) -> None:
        self.engine_args = engine_args
        # A local model's core starts first: its imports and model loading then overlap this
        # process's own (config, tokenizer), which took as long again on an 8B start-up. A
        # Hub id is resolved (and downloaded) here first, once, and the core reads the folder.
        # (Data-parallel cores need the config first, for their devices.)
        early = is_local(engine_args.model, engine_args.tokenizer)
        early = early and engine_args.data_parallel_size == 1
        early_core = EngineCoreClient(engine_args, wait=False) if early else None
        try:
            self.config = server_config(engine_args)
            processors = build_processors(self.config)
            dp_size = self.config.parallel_config.data_parallel_size
            if metrics is not None and dp_size > 1:
                raise ValueError(
                    f"AsyncLLMEngine makes the metrics of its {dp_size} data-parallel engine "
                    f"cores itself (data_parallel_size > 1); pass no metrics"
                )
            envs, self._ray_cluster = start_options(self.config)
        except BaseException:  # a bad option: the core would fail the same way
            if early_core is not None:
                early_core.shutdown()
            raise
        model_config = self.config.model_config
        self.tokenizer, self.input_processor, self.output_processor = processors
        self.log_requests = log_requests
        self.log_stats = log_stats
        self.log_stats_interval_s = log_stats_interval_s
        name = served_model_name or model_config.model_name
        self.engine_metrics = (
            [metrics]
            if metrics is not None
            else engine_metrics(name, model_config.max_model_len, dp_size)
        )
        self.metrics = self.engine_metrics[0]
        self.streams: dict[str, RequestStream] = {}
        self._core_of: dict[str, int] = {}  # request id -> index of the core running it
        self._loads = CoreLoads(dp_size)
        self.dead_error: EngineDeadError | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Engine-core ids are "<request id>@<n>": unique, so that a request id can be reused
        # at once after an abort while the old request's outputs are still on their way.
        self._core_ids = itertools.count()
        log_generation_defaults(model_config)
        # The cores build their config from the folders resolved here: a Hub id is looked up
        # (and downloaded) once, in this process.
        self.cores: list[EngineCoreClient] = [early_core] if early_core is not None else []
        try:
            if early_core is None:
                self.cores += start_cores(engine_args.resolved(self.config), envs)
            for core in self.cores:
                core.wait_ready()
        except BaseException:
            self._stop_cores()
            raise
        self.core = self.cores[0]
        for core, core_metrics in zip(self.cores, self.engine_metrics, strict=True):
            core_metrics.peaks = device_peaks(core.device_name)
        # Requests are checked against the smallest KV cache: any core may run them.
        self._num_blocks = min(core.num_blocks for core in self.cores)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> "AsyncLLMEngine":
        return cls(engine_args, **kwargs)

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len

    @property
    def model_config(self) -> ModelConfig:
        """The model's config (vLLM's `AsyncLLM.model_config`)."""
        return self.config.model_config

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def start(self) -> None:
        """Start the background tasks on the running loop (done by the first request too)."""
        if self._tasks or self.dead_error is not None:
            return
        self._tasks = []
        for index in range(len(self.cores)):
            self._tasks += [
                asyncio.create_task(self._receive_outputs(index), name=f"engine-outputs-{index}"),
                asyncio.create_task(self._watch_core(index), name=f"engine-watchdog-{index}"),
            ]
        if self.log_stats:
            self._tasks.append(asyncio.create_task(self._log_stats(), name="engine-stats"))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes (kind: `sampling_params.output_kind`).

        Raises InvalidRequestError for bad input and EngineDeadError if the core dies or the
        engine shuts down. `abort(request_id)` ends it with a final output whose unfinished
        completions have finish_reason "abort". Closing (`aclose`) or cancelling the iterator
        early aborts the request and frees its KV blocks before that call returns.
        """
        stream = self.add_request(request_id, prompt, sampling_params, priority)
        # aclosing: the inner generator's cleanup (the abort) runs now, not when it is
        # garbage-collected some loop iterations later.
        async with contextlib.aclosing(self.iterate(stream)) as outputs:
            async for output in outputs:
                yield output

    async def iterate(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        """Yield a stream's outputs; abort the request if the caller stops early."""
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort_request(stream.request_id)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        """Validate a request and send it to the core; returns its output stream. `priority`
        as in `LLMEngine.add_request`. Raises InvalidRequestError (nothing is sent) or
        EngineDeadError."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if request_id in self.streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.start()
        index = self._loads.pick()
        core = self.cores[index]
        processed, children = register_request(
            self.input_processor,
            self.output_processor,
            request_id,
            prompt,
            params,
            self._num_blocks,
            self.config.cache_config.block_size,
            core_request_id=f"{request_id}@{next(self._core_ids)}",
            sliding_window=core.sliding_window,
            max_step_tokens=self.config.scheduler_config.max_num_batched_tokens,
            priority=priority,
        )
        try:
            core.send_add(children)
        except BaseException:
            self.output_processor.abort_request(request_id)
            raise
        self._core_of[request_id] = index
        self._loads.added(index)
        num_prompt_tokens = len(processed.prompt_token_ids)
        max_tokens = processed.sampling_params.max_tokens
        assert max_tokens is not None  # resolved by the input processor
        stream = RequestStream(request_id, processed.sampling_params.output_kind)
        self.streams[request_id] = stream
        self.engine_metrics[index].record_arrival(
            request_id,
            [child.request_id for child in children],
            num_prompt_tokens,
            max_tokens,
            time.monotonic(),
        )
        if self.log_requests:
            logger.info(
                "Added request %s: %d prompt tokens, max_tokens %d, %s",
                request_id,
                num_prompt_tokens,
                max_tokens,
                params,
            )
        return stream

    async def reset_prefix_cache(self) -> None:
        """Forget the prefix cache's blocks that no request holds (vLLM's
        `EngineClient.reset_prefix_cache`); requests added after it find no earlier prefix
        (the message reaches the engine core before theirs). Raises EngineDeadError if the
        engine core is gone."""
        for core in self.cores:
            core.send_reset_prefix_cache()

    async def abort(self, request_id: str) -> None:
        """vLLM's coroutine spelling of `abort_request`."""
        self.abort_request(request_id)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (and its state here). Its stream ends
        with a final output whose unfinished completions have finish_reason "abort" (vLLM's
        FinishReason.ABORT). Unknown and finished ids are ignored."""
        final_output = self.output_processor.abort_output(request_id)
        children = self.output_processor.abort_request(request_id)
        stream = self.streams.pop(request_id, None)
        index = self._forget(request_id)
        if stream is not None:
            if final_output is not None:
                stream.queue.put_nowait(final_output)
            self.engine_metrics[index or 0].record_aborted(request_id, len(children))
            if self.log_requests:
                logger.info("Aborted request %s", request_id)
        self._send_abort(index, children)

    def _forget(self, request_id: str) -> int | None:
        """The index of the core that ran this request, which no longer counts it as
        unfinished; None for an unknown (or already forgotten) request."""
        index = self._core_of.pop(request_id, None)
        if index is not None:
            self._loads.ended(index)
        return index

    def fail_running(self, error: PagedServeError) -> None:
        """End every running request now: its stream raises `error` (a server stopping
        after its drain period; the engine's death), its state here is forgotten and, while
        the core lives, its KV blocks there are freed. Unlike a death, this leaves the engine
        usable: new requests are accepted."""
        for request_id, stream in list(self.streams.items()):
            children = self.output_processor.abort_request(request_id)
            index = self._forget(request_id)
            self.engine_metrics[index or 0].record_aborted(request_id, len(children))
            stream.queue.put_nowait(error)
            self._send_abort(index, children)
        self.streams.clear()

    def _send_abort(self, index: int | None, children: list[str]) -> None:
        """Free the KV blocks of the engine-core requests `children` on core `index`, unless
        there are none or the engine is dead (nothing is sent to a gone core)."""
        if children and index is not None and self.dead_error is None:
            with contextlib.suppress(EngineDeadError):
                self.cores[index].send_abort(children)

    async def check_health(self) -> None:
        """Raise EngineDeadError if an engine core is gone."""
        for core in self.cores:
            if self.dead_error is None and not core.is_alive:
                self._fail(EngineDeadError(core.death_message()))
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))

    def shutdown(self) -> None:
        """Stop the engine core; requests still running end with EngineDeadError (their
        iterators raise it instead of waiting forever), and new ones are refused. Idempotent."""
        if self.dead_error is None:
            self._fail(EngineDeadError("the engine was shut down"), log=False)
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self._stop_cores()

    def _stop_cores(self) -> None:
        """Stop every core started (and leave a Ray cluster joined for them); idempotent."""
        for core in self.cores:
            core.shutdown()
        if self._ray_cluster is not None:
            self._ray_cluster.shutdown()

    async def _receive_outputs(self, index: int) -> None:
        core = self.cores[index]
        try:
            while True:
                self._process_outputs(await core.receive(), index)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("engine output handler failed")
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(repr(e))
            self._fail(error)

    def _process_outputs(self, message: EngineCoreOutputs, index: int = 0) -> None:
        """Core `index`'s outputs of one step to its requests' streams and metrics."""
        now = time.monotonic()
        core, metrics = self.cores[index], self.engine_metrics[index]
        child_to_parent = self.output_processor.child_to_parent

        def parent_of(child_id: str) -> str | None:
            parent = child_to_parent.get(child_id)
            return None if parent is None else parent[0]

        # First: a sequence scheduled for the first time may finish in this very step.
        metrics.record_queue_times(message.queue_times, message.scheduled_at)
        metrics.record_outputs(message.outputs, parent_of, now, message.timestamp)
        metrics.record_step_cost(message)
        request_outputs, stopped = self.output_processor.process_outputs(message.outputs)
        if stopped:
            with contextlib.suppress(EngineDeadError):  # the watchdog reports a dead core
                core.send_finish(stopped)
        for failed in self.output_processor.pop_failed():  # one request's internal error
            self._forget(failed.request_id)
            metrics.record_aborted(failed.request_id, len(failed.child_ids), "error")
            self._send_abort(index, failed.child_ids)
            failed_stream = self.streams.pop(failed.request_id, None)
            if failed_stream is not None:
                error = RequestFailedError(f"request {failed.request_id} failed: {failed.error!r}")
                failed_stream.queue.put_nowait(error)
        for output in request_outputs:
            stream = self.streams.get(output.request_id)
            if output.finished:
                self.streams.pop(output.request_id, None)
                self._forget(output.request_id)
                metrics.record_finished(output, now)
            if stream is not None:
                stream.queue.put_nowait(output)
        metrics.record_scheduler_stats(message.stats)
        self._loads.report(index, message.stats.kv_cache_usage)

    async def _watch_core(self, index: int) -> None:
        core = self.cores[index]
        await wait_readable(core.sentinel)
        await asyncio.sleep(0.05)  # let the output task take a last "error" message first
        self._fail(EngineDeadError(core.death_message()))

    def _fail(self, error: EngineDeadError, log: bool = True) -> None:
        """The core is gone (or shutting down): fail every pending request, refuse new ones."""
        if self.dead_error is not None:
            return
        if log:
            logger.error("engine failed; failing %d pending requests: %s", len(self.streams), error)
        self.dead_error = error  # set first: nothing is sent to the gone core
        self.fail_running(EngineDeadError(str(error)))
        try:
            current = asyncio.current_task()
        except RuntimeError:  # shutdown() called outside the event loop
            current = None
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def _log_stats(self) -> None:
        while True:
            await asyncio.sleep(self.log_stats_interval_s)
            for metrics in self.engine_metrics:
                line = metrics.log_line(time.monotonic())
                if line is not None:
                    logger.info(line)
