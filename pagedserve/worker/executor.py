"""Executors: where the model runners live (this process, or one process per TP rank)."""

from pagedserve.config import EngineConfig
from pagedserve.step import ModelRunnerOutput, SchedulerOutput
from pagedserve.worker.model_runner import ModelRunner


class UniprocExecutor:
    """One model runner in the engine's own process (tensor_parallel_size == 1)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.tensor_parallel_size != 1:
            raise NotImplementedError(
                "tensor_parallel_size > 1 is not implemented yet; use tensor_parallel_size=1"
            )
        self.runner = ModelRunner(config)
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    @property
    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
