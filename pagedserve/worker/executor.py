"""Executors: where the model runners live (this process, one process per TP rank, or Ray).

Every executor offers the same five calls to EngineCore, which never knows how many ranks
there are:

    determine_num_blocks()  KV blocks every rank can hold (the minimum over the ranks)
    block_bytes             bytes of one KV block on one rank
    initialize_cache(n)     allocate n blocks on every rank
    execute_model(step)     run one SchedulerOutput on every rank; rank 0's sampled tokens
    execute_model_async(step)  the same, returning before the device is done: the next step
                            may be launched first (async scheduling)
    shutdown()              stop the workers (idempotent)

`create_executor` picks one from `ParallelConfig.executor_backend`.
"""

from abc import ABC, abstractmethod
from typing import Any, Protocol

from pagedserve.config import EngineConfig
from pagedserve.step import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.model_runner import AsyncModelRunnerOutput, ModelRunner


class Executor(Protocol):
    """What EngineCore needs from the workers (see the module docstring)."""

    device_type: str  # of the ranks' devices: async scheduling is on by default on "cuda"

    @property
    def block_bytes(self) -> int: ...

    def determine_num_blocks(self) -> int: ...

    def initialize_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput: ...

    def shutdown(self) -> None: ...


def create_executor(config: EngineConfig) -> Executor:
    """The executor of `config.parallel_config.executor_backend`: "uni", "mp" or "ray"."""
    backend = config.parallel_config.executor_backend
    if backend == "uni":
        return UniprocExecutor(config)
    if backend == "mp":
        from pagedserve.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    from pagedserve.worker.ray_executor import RayExecutor

    return RayExecutor(config)


class UniprocExecutor:
    """One model runner in the engine's own process (tensor_parallel_size == 1)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError(
                "UniprocExecutor runs one rank; use distributed_executor_backend 'mp' or 'ray' "
                "for tensor_parallel_size > 1"
            )
        self.runner = ModelRunner(config)
        self.runner.load_model()
        self.device_type = self.runner.device.type

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    @property
    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        return self.runner.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        pass


STARTUP_TIMEOUT_S = 1800.0  # loading and (GPU) profiling a large checkpoint from a slow disk


class RankGroupExecutor(ABC):
    """What the multi-rank executors (processes, Ray actors) share: every call runs on every
    rank; rank 0's answer is the step's output. Subclasses say how a call reaches the ranks."""

    timeout_s: float
    device_type: str  # of the ranks' devices
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

    def initialize_cache(self, num_blocks: int) -> None:
        self._call("initialize_cache", num_blocks, timeout_s=STARTUP_TIMEOUT_S)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output: ModelRunnerOutput = self._call(
            "execute_model", scheduler_output, timeout_s=self.timeout_s
        )[0]
        return output

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Every rank launches the step, then waits for its previous one: the reply carries
        the previous step's output, which goes to that step's handle."""
        previous: ModelRunnerOutput | None = self._call(
            "execute_model_async", scheduler_output, timeout_s=self.timeout_s
        )[0]
        if self._unanswered is not None:
            assert previous is not None
            self._unanswered.set(previous)
        self._unanswered = _RankGroupOutput(self)
        return self._unanswered

    def finish_pending(self) -> None:
        """Collect the output of the step launched last (no later launch will carry it)."""
        output: ModelRunnerOutput | None = self._call("finish_pending", timeout_s=self.timeout_s)[0]
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
