"""create_executor: the executor that `ParallelConfig.executor_backend` names."""

from pagedserve.config import EngineConfig
from pagedserve.executor.base import Executor
from pagedserve.executor.multiproc_executor import MultiprocExecutor
from pagedserve.executor.ray_executor import RayExecutor
from pagedserve.executor.uniproc_executor import UniprocExecutor


def create_executor(config: EngineConfig) -> Executor:
    """The executor of `config.parallel_config.executor_backend`: "uni" (this process), "mp"
    (a process per rank) or "ray" (a Ray actor per rank). Ray itself is imported only by the
    Ray executor's constructor (ImportError naming the extra to install when it is missing)."""
    backend = config.parallel_config.executor_backend
    if backend == "uni":
        return UniprocExecutor(config)
    if backend == "mp":
        return MultiprocExecutor(config)
    return RayExecutor(config)
