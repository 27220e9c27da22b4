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

`factory.create_executor` picks one from `ParallelConfig.executor_backend`.
"""

from abc import ABC, abstractmethod
from typing import Any, Protocol

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
    # Async scheduling: the output of the step launched last, which the ranks send back with
    # the reply to the next launch (or to "finish_pending").
    _unanswered: "_RankGroupOutput | None" = None

    @abstractmethod
    def _call(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        """Run `method(*args)` on every rank's worker; their results in rank order. Raises
        EngineDeadError when a rank fails, dies or does not answer within `timeout_s`."""

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
