"""UniprocExecutor: one rank, a Worker in the engine's own process (tensor_parallel_size and
pipeline_parallel_size 1)."""

from collections.abc import Callable
from typing import Any

import numpy as np

from pagedserve.config import EngineConfig
from pagedserve.step import (
    AsyncModelRunnerOutput,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedserve.worker.worker import Worker


class UniprocExecutor:
    """Hosts one Worker in this process. The Worker joins no process group and leaves the
    process's device and thread settings alone: the process is the user's, and may hold other
    engines. Raises ValueError for tensor_parallel_size or pipeline_parallel_size > 1."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.world_size != 1:
            raise ValueError(
                "UniprocExecutor runs one rank; use distributed_executor_backend 'mp' or 'ray' "
                "for tensor_parallel_size or pipeline_parallel_size > 1"
            )
        self.worker = Worker(config)
        self.device_type = self.worker.device.type

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def kv_sliding_window(self) -> int | None:
        return self.worker.kv_sliding_window()

    @property
    def block_bytes(self) -> int:
        return self.worker.block_bytes

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self.worker.execute_model(scheduler_output)
        assert output is not None  # rank 0 answers
        return output

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """The runner's own handle: in one process, the engine waits on the device directly."""
        return self.worker.execute_model_async(scheduler_output)

    # The engine may launch a step's forward, then fill its grammar bitmask while the device
    # runs it, then sample (structured outputs under async scheduling). Executors of several
    # ranks lack this: there a constrained request waits for its token instead.
    supports_deferred_grammar = True

    def launch_forward(self, scheduler_output: SchedulerOutput) -> Any:
        """The forward of a step (`ModelRunner.launch_forward`): a handle for
        `sample_tokens`, or the step's output when nothing samples."""
        return self.worker.launch_forward(scheduler_output)

    def bitmask_allocator(self) -> Callable[[tuple[int, int]], np.ndarray] | None:
        """Where the structured-output manager should fill the bitmasks of deferred steps:
        pinned host memory on a GPU (copied to it with no staging copy); None elsewhere."""
        if self.worker.device.type != "cuda":
            return None
        from pagedserve.worker.grammar_bitmask import pinned_host_bitmask

        return pinned_host_bitmask

    def host_array_pinning(
        self,
    ) -> tuple[Callable[[np.ndarray], None], Callable[[np.ndarray], None]] | None:
        """How to page-lock (and unlock) a host array that the grammar process fills, so that
        the device copies from it with no staging copy: cudaHostRegister on a GPU; None
        elsewhere."""
        if self.worker.device.type != "cuda":
            return None
        from pagedserve.worker.grammar_bitmask import pin_host_array, unpin_host_array

        return pin_host_array, unpin_host_array

    def sample_tokens(self, pending: Any, grammar: GrammarOutput | None) -> AsyncModelRunnerOutput:
        """Sample the launched forward `pending` with the step's bitmask."""
        return self.worker.sample_tokens(pending, grammar)

    def shutdown(self) -> None:
        self.worker.shutdown()
