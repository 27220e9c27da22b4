"""The Executor protocol, and what the multi-rank executors share (`RankGroupExecutor`).

An executor is where the workers live: in this process (`UniprocExecutor`), one process per
rank (`MultiprocExecutor`) or one Ray actor per rank (`RayExecutor`); the ranks are
pipeline_parallel_size stages of tensor_parallel_size ranks each. Each offers EngineCore,
which never knows how many ranks there are, the same calls:

    determine_num_blocks()  KV blocks every rank can hold (the minimum over the ranks: each
                            pipeline stage sizes the cache of its own layers)
    block_bytes             bytes of one KV block on one rank
    kv_sliding_window()     the sliding window every attention layer uses, else None (the
                            KV cache manager then frees blocks that leave the window)
    initialize_cache(n)     allocate n blocks on every rank
    execute_model(step)     run one SchedulerOutput on every rank; the sampled tokens of the
                            output rank (the last stage's first; `worker.output_rank`)
    execute_model_async(step)  the same, returning before the device is done: the next step
                            may be launched first (async scheduling)
    shutdown()              stop the workers (idempotent)

Pipeline parallelism: `max_concurrent_batches` (pipeline_parallel_size; 1 otherwise) steps may
be on the ranks at once: `submit_model(step)` sends one without waiting, and its handle's
`result()` collects the replies (steps are answered in the order sent). The engine core's
batch queue keeps that many in flight, so that stage 0 runs step N+1 while stage 1 runs N.

`factory.create_executor` picks one from `ParallelConfig.executor_backend`.
"""

from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Protocol

from pagedserve.errors import EngineDeadError
from pagedserve.step import AsyncModelRunnerOutput, ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """What EngineCore needs from the workers (see the module docstring)."""

    device_type: str  # of the ranks' devices: async scheduling is on by default on "cuda"

    @property
    def block_bytes(self) -> int: ...

    def determine_num_blocks(self) -> int: ...

    def kv_sliding_window(self) -> int | None: ...

    def initialize_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput: ...

    def shutdown(self) -> None: ...


STARTUP_TIMEOUT_S = 1800.0  # loading and (GPU) profiling a large checkpoint from a slow disk


class RankGroupExecutor(ABC):
    """What the multi-rank executors (processes, Ray actors) share: every call runs on every
    rank; the output rank's answer is the step's output. Subclasses say how a call reaches the
    ranks, and set `output_rank` (`worker.output_rank`)."""

    timeout_s: float
    device_type: str  # of the ranks' devices
    output_rank: int = 0  # the rank that samples: the first of the last pipeline stage
    # Steps the ranks may hold at once (`submit_model`): pipeline_parallel_size.
    max_concurrent_batches: int = 1
    # Async scheduling: the output of the step launched last, which the ranks send back with
    # the reply to the next launch (or to "finish_pending").
    _unanswered: "_RankGroupOutput | None" = None
    # Steps submitted (`submit_model`) whose replies are not collected yet, oldest first.
    _queued: "deque[_QueuedOutput] | None" = None

    @abstractmethod
    def _send(self, method: str, *args: Any) -> Any:
        """Start `method(*args)` on every rank's worker, after the calls sent before; a
        ticket for `_receive`. Raises EngineDeadError when a rank is known to be dead."""

    def _submit(self, method: str, *args: Any) -> Any:
        """`_send` for a step that `submit_model` leaves on the ranks (an executor whose
        sends may block overrides it)."""
        return self._send(method, *args)

    @abstractmethod
    def _receive(self, ticket: Any, method: str, timeout_s: float) -> list[Any]:
        """The results of the call `ticket`, in rank order (the calls sent before it must
        have been received). Raises EngineDeadError when a rank fails, dies or does not answer
        within `timeout_s`."""

    def _call(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        """Run `method(*args)` on every rank's worker; their results in rank order (replies
        of submitted steps that come first are kept for their handles). Raises as
        `_receive`."""
        while self._queued:
            self._collect_oldest()
        return self._receive(self._send(method, *args), method, timeout_s)

    def submit_model(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Send one step to every rank without waiting (pipeline parallelism keeps up to
        `max_concurrent_batches` on the ranks); the handle's `result()` waits for its replies
        (and first for those of the steps submitted before). Raises EngineDeadError."""
        if self._queued is None:
            self._queued = deque()
        handle = _QueuedOutput(self, self._submit("execute_model", scheduler_output))
        self._queued.append(handle)
        return handle

    def _collect_oldest(self) -> None:
        """Wait for the replies of the oldest submitted step; hand its output to its handle."""
        assert self._queued
        handle = self._queued.popleft()
        try:
            replies = self._receive(handle.ticket, "execute_model", self.timeout_s)
        except BaseException:
            handle.lost = True
            raise
        handle.set(replies[self.output_rank])

    def determine_num_blocks(self) -> int:
        """The fewest blocks any rank can hold (ranks may differ in free memory)."""
        num_blocks: list[int] = self._call("determine_num_blocks", timeout_s=STARTUP_TIMEOUT_S)
        return min(num_blocks)

    def kv_sliding_window(self) -> int | None:
        """The sliding window every attention layer uses, else None (pipeline stages hold
        different layers: one window only when every stage reports the same)."""
        windows: list[int | None] = self._call("kv_sliding_window", timeout_s=self.timeout_s)
        return windows[0] if len(set(windows)) == 1 else None

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks on every rank (then graphs and warm-up)."""
        self._call("initialize_cache", num_blocks, timeout_s=STARTUP_TIMEOUT_S)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank and wait; the output rank's sampled tokens (every rank
        feeds the same ones). Raises EngineDeadError as `_call`."""
        output: ModelRunnerOutput = self._call(
            "execute_model", scheduler_output, timeout_s=self.timeout_s
        )[self.output_rank]
        return output

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Every rank launches the step, then waits for its previous one
        (`Worker.execute_model_pipelined`): the reply carries the previous step's output,
        which goes to that step's handle."""
        previous: ModelRunnerOutput | None = self._call(
            "execute_model_pipelined", scheduler_output, timeout_s=self.timeout_s
        )[self.output_rank]
        if self._unanswered is not None:
            assert previous is not None
            self._unanswered.set(previous)
        self._unanswered = _RankGroupOutput(self)
        return self._unanswered

    def finish_pending(self) -> None:
        """Collect the output of the step launched last (no later launch will carry it)."""
        output: ModelRunnerOutput | None = self._call("finish_pending", timeout_s=self.timeout_s)[
            self.output_rank
        ]
        if self._unanswered is not None:
            assert output is not None
            self._unanswered.set(output)
            self._unanswered = None


class _RankGroupOutput(AsyncModelRunnerOutput):
    """A multi-rank step's output: it arrives with the reply to the next launch, or is asked
    for with "finish_pending" when `result()` comes first."""

    def __init__(self, executor: RankGroupExecutor) -> None:
        super().__init__(None)
        self._executor: RankGroupExecutor | None = executor

    def set(self, output: ModelRunnerOutput) -> None:
        self._output, self._executor = output, None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            assert self._executor is not None
            self._executor.finish_pending()
        assert self._output is not None
        return self._output


class _QueuedOutput(AsyncModelRunnerOutput):
    """A submitted step's output (`RankGroupExecutor.submit_model`): collected, in order,
    when asked for or when a later call needs the ranks' replies behind it."""

    def __init__(self, executor: RankGroupExecutor, ticket: Any) -> None:
        super().__init__(None)
        self._executor = executor
        self.ticket = ticket
        self.lost = False  # its replies failed to come (the engine is dead)

    def set(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        """The step's output; raises EngineDeadError when it, or a step before it, failed."""
        while self._output is None:
            reason = getattr(self._executor, "dead_reason", None)
            if self.lost or reason is not None or not self._executor._queued:
                raise EngineDeadError(reason or "a step's replies were lost")
            self._executor._collect_oldest()
        return self._output
