"""RayExecutor: one Ray actor per rank, placed on a Ray cluster's nodes.

    engine process (Ray driver)                   RayWorker actor of rank r, any node
    ---------------------------                   -----------------------------------
    placement group: pp_size x tp_size bundles    Worker(config, r, ...): joins the group at
      {"GPU": 1, "CPU": 1} (CPU-only: {"CPU": 1})   tcp://<rank 0's node>:<port>, loads its shard
    actor.call.remote(method, *args) on every  ──▶ Worker.<method>(*args) ◀─ NCCL/gloo ─▶ peers
    rank, ray.get(all, timeout)                ◀── the output rank's step output (None from
                                                    the others; `worker.output_rank`)

Rank r is tensor-parallel rank r % tp_size of pipeline stage r // tp_size, as with the 'mp'
executor; the stages pass hidden states between them themselves (`worker.pp_stage`).

The engine joins the Ray cluster that is already running (`ray start --head`, then `ray start
--address=HEAD:6379` on every other node; or RAY_ADDRESS), else starts a local one. Bundles are
packed onto as few nodes as possible; a tensor-parallel group may span nodes (slow without a
fast interconnect). Failures: an actor that dies (RayActorError), raises, or does not answer
within `distributed_timeout_s` makes every later call raise EngineDeadError; the actors are
killed. Actors die with the engine's process, as Ray ties non-detached actors to their owner.
"""

import logging
import os
import time
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.distributed.parallel_state import get_ip, get_open_port
from pagedserve.errors import EngineDeadError
from pagedserve.executor.base import STARTUP_TIMEOUT_S, RankGroupExecutor
from pagedserve.worker.worker import Worker, output_rank

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0


class RayWorker:
    """The actor body: hosts one Worker (created by `start`, so that failures reach the caller
    as the original exception)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port there, for rank 0's rendezvous."""
        return get_ip(), get_open_port()

    def pid(self) -> int:
        """The actor's process id."""
        return os.getpid()

    def start(self, config: EngineConfig, rank: int, distributed_init_method: str) -> int:
        """Create this rank's Worker (device, process group, model); returns its KV block's
        size in bytes."""
        # Ray shows each actor only its own GPU (CUDA_VISIBLE_DEVICES): it is cuda:0.
        self.worker = Worker(config, rank, 0, distributed_init_method)
        block_bytes: int = self.worker.block_bytes
        return block_bytes

    def call(self, method: str, *args: Any) -> Any:
        """Run the Worker's `method(*args)` (the executor's remote call)."""
        return getattr(self.worker, method)(*args)


class RayExecutor(RankGroupExecutor):
    """Ranks as Ray actors in a placement group; see the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()  # joins the cluster of `ray start` / RAY_ADDRESS, else starts one
        world_size = config.parallel_config.world_size
        self.output_rank = output_rank(config)
        self.max_concurrent_batches = config.parallel_config.pipeline_parallel_size
        self.timeout_s = config.parallel_config.distributed_timeout_s
        self.dead_reason: str | None = None
        self.actors: list[Any] = []
        bundle = self._bundle(ray, config.device_config.device)
        self.device_type = "cuda" if "GPU" in bundle else "cpu"
        self.placement_group = placement_group([dict(bundle)] * world_size, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise ValueError(
                f"Ray cannot place {world_size} workers of {bundle} each within "
                f"{_PLACEMENT_TIMEOUT_S:g} s; the cluster has {ray.cluster_resources()}. Add "
                f"nodes (`ray start --address=HEAD:6379`) or lower tensor_parallel_size or "
                f"pipeline_parallel_size"
            ) from None
        actor_class = ray.remote(RayWorker)
        for rank in range(world_size):
            strategy = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank
            )
            self.actors.append(
                actor_class.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=strategy,
                ).remote()
            )
        try:
            host, port = ray.get(self.actors[0].node_address.remote(), timeout=STARTUP_TIMEOUT_S)
            starts = [
                actor.start.remote(config, rank, f"tcp://{host}:{port}")
                for rank, actor in enumerate(self.actors)
            ]
            # Pipeline stages may hold different numbers of layers: the largest block.
            self._block_bytes: int = max(_get_all(ray, starts, STARTUP_TIMEOUT_S))
        except BaseException:
            self.shutdown()
            raise  # a RayTaskError is also an instance of the worker's exception class
        logger.info("started %d Ray workers", world_size)

    @staticmethod
    def _bundle(ray: Any, device: str) -> dict[str, float]:
        """One GPU and one CPU per rank; one CPU on CPU-only runs ("auto": whether the cluster
        has GPUs)."""
        use_gpu = device.startswith("cuda") or (
            device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        return {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on one rank (the most any rank reported at start-up)."""
        return self._block_bytes

    def worker_pids(self) -> list[int]:
        ray = _import_ray()
        pids: list[int] = ray.get([a.pid.remote() for a in self.actors], timeout=self.timeout_s)
        return pids

    def _send(self, method: str, *args: Any) -> list[Any]:
        """Start Worker.<method>(*args) on every rank (an actor runs one caller's calls in
        order); their object refs."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        return [actor.call.remote(method, *args) for actor in self.actors]

    def _receive(self, ticket: Any, method: str, timeout_s: float) -> list[Any]:
        """The replies of the call whose refs are `ticket`, in rank order."""
        ray = _import_ray()
        refs: list[Any] = ticket
        try:
            replies = _get_all(ray, refs, timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._fail(
                f"a Ray worker did not answer {method} within {timeout_s:g} s "
                f"(distributed_timeout_s)"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise self._fail(f"a Ray worker died: {e}") from e
        except ray.exceptions.RayTaskError as e:
            raise self._fail(f"a Ray worker failed in {method}") from e
        return replies

    def _fail(self, reason: str) -> EngineDeadError:
        self.dead_reason = f"{reason}; the engine cannot continue: restart it"
        logger.error("%s", self.dead_reason)
        self.shutdown()
        return EngineDeadError(self.dead_reason)

    def shutdown(self) -> None:
        """Kill the actors and free their placement group; idempotent. Ray needs no graceful
        goodbye: killing an actor ends its process and its process-group membership."""
        self.dead_reason = self.dead_reason or "the engine was shut down"
        ray = _import_ray()
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._owns_ray:
            ray.shutdown()


def _get_all(ray: Any, refs: list[Any], timeout_s: float) -> list[Any]:
    """ray.get(refs), but raising as soon as any one fails: a dead rank must not leave us
    waiting for the ranks blocked in a collective with it."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        remaining = max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            raise ray.exceptions.GetTimeoutError(f"no reply within {timeout_s:g} s")
        ray.get(ready)  # raises the rank's error, or RayActorError if it died
    replies: list[Any] = ray.get(refs)
    return replies


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "distributed_executor_backend 'ray' needs Ray: pip install 'pagedserve[ray]'"
        ) from None
    return ray
