"""Worker: one rank (a tensor-parallel rank of a pipeline stage); its device, its
process-group membership, its ModelRunner.

Every executor hosts Workers: `UniprocExecutor` one in the engine's own process, the others
one per rank (a process, a Ray actor), calling the same methods on every rank each time; only
the output rank's step output is returned (`output_rank`: the first rank of the last
pipeline stage, which samples; rank 0 without pipeline parallelism). Start-up goes through
`runner_setup`; steps through the runner.
"""

import logging
import os
from typing import Any

import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.distributed.parallel_state import destroy_distributed, init_distributed
from pagedserve.step import (
    AsyncModelRunnerOutput,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.runner_setup import (
    determine_num_blocks,
    initialize_kv_cache,
    kv_block_bytes,
    kv_sliding_window,
    load_model,
    resolve_device,
)

logger = logging.getLogger(__name__)


def output_rank(config: EngineConfig) -> int:
    """The rank whose step output the executor returns: the first rank of the last pipeline
    stage (it runs the LM head and samples; every rank gets its tokens by broadcast)."""
    parallel_config = config.parallel_config
    return (parallel_config.pipeline_parallel_size - 1) * parallel_config.tensor_parallel_size


def worker_device(device: str, local_rank: int, world_size: int) -> torch.device:
    """The device of the rank that is `local_rank` on its host: "cuda:{local_rank}" when
    `device` is "cuda" (or "auto" with a GPU), else the CPU. Raises ValueError when the host
    shows fewer GPUs than it has ranks, or when one GPU ("cuda:N") is named for several ranks.
    world_size: all the ranks, tensor_parallel_size x pipeline_parallel_size.
    """
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if device.startswith("cuda:") and world_size > 1:
        raise ValueError(
            f"device {device!r} names one GPU, but tensor_parallel_size x "
            f"pipeline_parallel_size is {world_size}; use device='cuda' and choose the GPUs "
            f"with CUDA_VISIBLE_DEVICES"
        )
    if device.startswith("cuda:"):
        return torch.device(device)
    num_gpus = torch.cuda.device_count()
    if local_rank >= num_gpus:
        raise ValueError(
            f"rank {local_rank} of this host needs GPU {local_rank}, but only {num_gpus} are "
            f"visible; lower tensor_parallel_size or pipeline_parallel_size, or make more GPUs "
            f"visible"
        )
    return torch.device("cuda", local_rank)


class Worker:
    """One rank of the model: its device, its process-group membership and its ModelRunner.

    rank: the global rank, pp_rank * tensor_parallel_size + tp_rank (`output_rank` answers;
        every rank runs each step's forward, of its stage's layers).
    local_rank: the rank's index among the ranks of its host (its GPU index there).
    distributed_init_method: "tcp://HOST:PORT" where rank 0 hosts the rendezvous. None: the
        one rank of `UniprocExecutor`, in the engine's own process, which may hold the user's
        code and other engines: it joins no process group and sets neither the current CUDA
        device nor the thread count; its device is `config.device_config.device` resolved.
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        self.rank = rank
        self._answers = rank == output_rank(config)
        self._joins_group = distributed_init_method is not None
        if distributed_init_method is None:
            self.device = resolve_device(config.device_config.device)
            threads = cpu_threads(1) if self.device.type == "cpu" else None
            if threads is not None:
                torch.set_num_threads(threads)
        else:
            self.device = self._init_rank(config, rank, local_rank, distributed_init_method)
        self.runner = ModelRunner(config, self.device)
        load_model(self.runner)
        self._pending: AsyncModelRunnerOutput | None = None  # launched, output not taken

    @staticmethod
    def _init_rank(
        config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str
    ) -> torch.device:
        """Take this rank's device and join the process groups; the rank's device."""
        parallel_config = config.parallel_config
        device = worker_device(config.device_config.device, local_rank, parallel_config.world_size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            threads = cpu_threads(parallel_config.world_size)
            if threads is not None:
                torch.set_num_threads(threads)
        init_distributed(
            rank,
            parallel_config.tensor_parallel_size,
            distributed_init_method,
            device,
            timeout_s=parallel_config.distributed_timeout_s,
            expert_parallel=parallel_config.enable_expert_parallel,
            pp_size=parallel_config.pipeline_parallel_size,
            pp_layer_partition=parallel_config.pp_layer_partition,
        )
        return device

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers on this rank (its KV heads only)."""
        return kv_block_bytes(self.runner)

    def kv_sliding_window(self) -> int | None:
        """The sliding window every attention layer uses, else None (`kv_sliding_window`)."""
        return kv_sliding_window(self.runner)

    def determine_num_blocks(self) -> int:
        return determine_num_blocks(self.runner)

    def initialize_cache(self, num_blocks: int) -> None:
        initialize_kv_cache(self.runner, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; the output rank returns the sampled tokens, the other ranks None (the
        next SchedulerOutput carries every token to feed, but for placeholders, which every
        rank takes from its own copy of the output rank's last sample)."""
        return self._answer(self.runner.execute_model_async(scheduler_output))

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step without waiting for the device: the handle of its output (the
        executor in this process hands it to the engine)."""
        return self.runner.execute_model_async(scheduler_output)

    def launch_forward(self, scheduler_output: SchedulerOutput) -> Any:
        """`ModelRunner.launch_forward` (the engine in this process finishes the step with
        `sample_tokens` once the step's grammar bitmask is filled)."""
        return self.runner.launch_forward(scheduler_output)

    def sample_tokens(self, pending: Any, grammar: GrammarOutput | None) -> AsyncModelRunnerOutput:
        """`ModelRunner.sample_tokens`."""
        return self.runner.sample_tokens(pending, grammar)

    def execute_model_pipelined(
        self, scheduler_output: SchedulerOutput
    ) -> ModelRunnerOutput | None:
        """Launch this step, then wait for the previous launched step and return its output
        (the output rank; None on the other ranks, or when no step was pending). The engine
        thus gets step N's tokens while the device already runs step N+1; a reply carries
        outputs, as a handle cannot cross processes."""
        previous, self._pending = self._pending, self.runner.execute_model_async(scheduler_output)
        return self._answer(previous)

    def finish_pending(self) -> ModelRunnerOutput | None:
        """Wait for the launched step, if any; its output on the output rank."""
        pending, self._pending = self._pending, None
        return self._answer(pending)

    def _answer(self, launched: AsyncModelRunnerOutput | None) -> ModelRunnerOutput | None:
        if launched is None:
            return None
        output = launched.result()
        return output if self._answers else None

    def shutdown(self) -> None:
        """Leave the process group (a rank of its own process); idempotent."""
        if self._joins_group:
            destroy_distributed()


def cpu_threads(tp_size: int) -> int | None:
    """The torch threads of one CPU rank: None when OMP_NUM_THREADS is set (torch took it at
    start-up: the user's choice), else the cores this process may run on, less
    `envs.cpu_reserved()` for other processes, split between the `tp_size` ranks of this
    host (all of them: tensor_parallel_size x pipeline_parallel_size), at least 1.

    Why: torch's intra-op pool waits for all of its threads at the end of every parallel
    op; with more threads than free cores one of them is often descheduled, and a 20 us
    attention call took 3 ms on a busy 2-core machine (the server's engine-core and API
    processes, or other jobs, sharing the cores). vLLM's CPU workers likewise leave cores
    to the front end (VLLM_CPU_NUM_OF_RESERVED_CPU)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores, reserved = len(os.sched_getaffinity(0)), envs.cpu_reserved()
    threads = max(1, (cores - reserved) // tp_size)
    logger.info("torch threads per CPU rank: %d (%d cores, %d reserved)", threads, cores, reserved)
    return threads
