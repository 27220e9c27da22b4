"""Data parallelism (vLLM's `--data-parallel-size`): the engine cores' devices, ports and
Ray cluster, and which core takes a request.

AsyncLLMEngine (and the offline LLMEngine, through `dp_engine_core`) starts
`data_parallel_size` engine-core processes, each with its own `tensor_parallel_size` ranks
(its own executor and torch.distributed group, on a rendezvous port of its own). On GPUs core
i sees only GPUs i*tp .. (i+1)*tp-1 of those this process sees (its CUDA_VISIBLE_DEVICES),
so its ranks take cuda:0 .. cuda:tp-1 as they do without data parallelism. With the Ray
backend the cores' ranks are Ray actors on one Ray cluster, which places them on GPUs itself.
Each request goes to the least loaded core (`CoreLoads`) and stays there; its aborts follow it.
"""

import contextlib
import os
import socket
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.envs import DISTRIBUTED_PORT


def core_envs(config: EngineConfig) -> list[dict[str, str]]:
    """The environment variables each engine core sets first, by data-parallel rank: its
    GPUs (CUDA_VISIBLE_DEVICES) where the ranks run on this host's GPUs (nothing on a CPU or
    with the Ray backend, which hands each actor its GPU), and with several cores of
    multiprocess ranks, its group's own rendezvous port (PAGEDSERVE_DISTRIBUTED_PORT).

    Raises ValueError naming data_parallel_size, tensor_parallel_size (and
    pipeline_parallel_size: a core has pp x tp ranks) and the device count
    when the cores need more GPUs than this process sees."""
    parallel = config.parallel_config
    dp_size = parallel.data_parallel_size
    envs: list[dict[str, str]] = [{} for _ in range(dp_size)]
    if dp_size == 1:
        return envs
    if parallel.executor_backend == "mp":
        for env, port in zip(envs, _distinct_free_ports(dp_size), strict=True):
            env[DISTRIBUTED_PORT] = str(port)
    for env, gpus in zip(envs, _core_gpus(config), strict=True):
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus
    return envs


def _core_gpus(config: EngineConfig) -> list[str]:
    """Each core's CUDA_VISIBLE_DEVICES value; empty strings where the GPUs are not ours to
    choose (a CPU engine, Ray). Raises ValueError as `core_envs`."""
    parallel = config.parallel_config
    # A core's ranks: pipeline_parallel_size x tensor_parallel_size.
    dp_size, tp_size = parallel.data_parallel_size, parallel.world_size
    device = config.device_config.device
    if parallel.executor_backend == "ray" or device.startswith("cpu"):
        return [""] * dp_size
    import torch

    if device == "auto" and not torch.cuda.is_available():
        return [""] * dp_size
    num_gpus = torch.cuda.device_count()
    if dp_size * tp_size > num_gpus:
        per_core = f"tensor_parallel_size ({parallel.tensor_parallel_size})"
        if parallel.pipeline_parallel_size > 1:
            per_core = f"pipeline_parallel_size ({parallel.pipeline_parallel_size}) x {per_core}"
        raise ValueError(
            f"data_parallel_size ({dp_size}) x {per_core} = "
            f"{dp_size * tp_size} GPUs needed, but {num_gpus} are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Entries may be indices or UUIDs; torch counts only those before the first invalid one.
    gpus = [g.strip() for g in visible.split(",")] if visible else [str(i) for i in range(num_gpus)]
    return [",".join(gpus[rank * tp_size : (rank + 1) * tp_size]) for rank in range(dp_size)]


def _distinct_free_ports(count: int) -> list[int]:
    """`count` different TCP ports that are free now (held open together while chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("", 0))
            ports.append(int(sock.getsockname()[1]))
    return ports


class RayCluster:
    """The Ray cluster that the cores of a data-parallel engine with the Ray backend share:
    the one this process is connected to, else the one `ray.init()` joins (`ray start`,
    RAY_ADDRESS) or starts. Each core then joins it through RAY_ADDRESS (`env`) instead of
    starting a cluster of its own, which would see every GPU again."""

    def __init__(self) -> None:
        try:
            import ray
        except ImportError:
            raise ImportError(
                "distributed_executor_backend 'ray' needs Ray: pip install 'pagedserve[ray]'"
            ) from None
        self._ray = ray
        self._owned = not ray.is_initialized()
        if self._owned:
            ray.init()
        self.env = {"RAY_ADDRESS": str(ray.get_runtime_context().gcs_address)}

    def shutdown(self) -> None:
        """Disconnect from the cluster if this object connected (a cluster `ray.init()`
        started here stops with it); idempotent."""
        if self._owned and self._ray.is_initialized():
            self._ray.shutdown()
        self._owned = False


class CoreLoads:
    """Which engine core takes the next request: the one with the fewest unfinished requests
    it was given, ties broken by the lower KV cache usage the core last reported, then in
    turn (round robin from the core after the last one picked). `num_cores` >= 1."""

    def __init__(self, num_cores: int) -> None:
        self.num_unfinished = [0] * num_cores
        self.kv_cache_usage = [0.0] * num_cores
        self._next = 0  # round robin's start

    def pick(self) -> int:
        """The index of the core for a new request (counted once `added` is called)."""
        n = len(self.num_unfinished)
        index = min(
            range(n),
            key=lambda i: (
                self.num_unfinished[i],
                self.kv_cache_usage[i],
                (i - self._next) % n,
            ),
        )
        self._next = (index + 1) % n
        return index

    def added(self, index: int) -> None:
        self.num_unfinished[index] += 1

    def ended(self, index: int) -> None:
        """A request of core `index` finished, was aborted or failed."""
        self.num_unfinished[index] = max(self.num_unfinished[index] - 1, 0)

    def report(self, index: int, kv_cache_usage: float) -> None:
        """Core `index`'s KV cache usage (0..1) in its latest step."""
        self.kv_cache_usage[index] = kv_cache_usage


def start_options(config: EngineConfig) -> tuple[list[dict[str, str]], Any]:
    """Per core, the variables to set (`core_envs`, plus the shared Ray cluster's address
    with the Ray backend), and that RayCluster (None without Ray) for the caller to shut
    down. Without data parallelism: one core, nothing to set, no cluster joined here."""
    envs = core_envs(config)
    parallel = config.parallel_config
    if parallel.data_parallel_size == 1 or parallel.executor_backend != "ray":
        return envs, None
    cluster = RayCluster()
    return [env | cluster.env for env in envs], cluster


def start_cores(
    engine_args: EngineArgs, envs: list[dict[str, str]], blocking: bool = False
) -> list[EngineCoreClient]:
    """Start one engine core per entry of `envs` (`start_options`), without waiting for them
    to be ready: they load at once. One entry: the core of an engine without data
    parallelism (no rank). `blocking`: see EngineCoreClient. If one fails to start, those
    already started are stopped."""
    cores: list[EngineCoreClient] = []
    try:
        for rank, env in enumerate(envs):
            dp_rank = None if len(envs) == 1 else rank
            cores.append(
                EngineCoreClient(
                    engine_args, wait=False, dp_rank=dp_rank, env=env, blocking=blocking
                )
            )
    except BaseException:
        for core in cores:
            core.shutdown()
        raise
    return cores
