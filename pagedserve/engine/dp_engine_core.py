"""DataParallelEngineCore: the offline LLMEngine's engine core under data parallelism: N
engine-core processes (`EngineCoreClient`, as the API server's), driven synchronously.

vLLM runs offline data parallelism as one process per rank, each with its own `LLM` and a
share of the prompts. Here one `LLM(data_parallel_size=N)` starts N cores and hands each
request to the least loaded one (`data_parallel.CoreLoads`, as the server); `step()` returns
whatever outputs the cores have sent, waiting for the first.
"""

import dataclasses
from typing import Any

import zmq

from pagedserve.config import EngineConfig
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core_client import EngineCoreClient
from pagedserve.engine.data_parallel import CoreLoads, start_cores, start_options
from pagedserve.errors import EngineDeadError
from pagedserve.messages import EngineCoreOutput
from pagedserve.request import Request, RequestStatus

_POLL_S = 0.05  # how long `step` waits for outputs before it checks the cores are alive


class DataParallelEngineCore:
    """What LLMEngine needs of an EngineCore (add_request, abort_requests, finish_requests,
    reset_prefix_cache, has_unfinished_requests, step, num_blocks, sliding_window,
    device_name, shutdown), over `data_parallel_size` engine-core processes.

    `engine_args` must be the options `config` was built from (the cores build theirs from
    them, with the model's resolved folders and `config`'s step token budget). The sequences
    of one request (n > 1) share a core. A core that dies or fails makes every later call
    raise EngineDeadError (the engine cannot continue, as vLLM's). The scheduler and the KV
    cache live in the cores' processes: `scheduler` and `kv_cache` raise
    NotImplementedError, and `step_tokens` counts only the tokens the step sampled.
    """

    def __init__(self, config: EngineConfig, engine_args: EngineArgs) -> None:
        envs, self._ray_cluster = start_options(config)
        args = dataclasses.replace(
            engine_args.resolved(config),
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        )
        self.cores: list[EngineCoreClient] = []
        try:
            self.cores = start_cores(args, envs, blocking=True)
            for core in self.cores:
                core.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(core.num_blocks for core in self.cores)
        self.sliding_window = self.cores[0].sliding_window
        self.device_name = self.cores[0].device_name
        self._loads = CoreLoads(len(self.cores))
        # Each running sequence (engine-core request id) -> its request's unit (its sharing
        # group, else itself) -> that unit's core and its number of running sequences.
        self._unit_of: dict[str, str] = {}
        self._unit_core: dict[str, int] = {}
        self._num_live: dict[str, int] = {}
        self._dead: str | None = None
        self._poller = zmq.Poller()
        for core in self.cores:
            self._poller.register(core.output_socket, zmq.POLLIN)
        self.step_cost = (0.0, 0.0)
        self.step_tokens = 0
        self.step_seconds = 0.0

    @property
    def scheduler(self) -> Any:
        raise NotImplementedError("data_parallel_size > 1: the schedulers run in the cores")

    @property
    def kv_cache(self) -> Any:
        raise NotImplementedError("data_parallel_size > 1: the KV caches live in the cores")

    def add_request(self, request: Request) -> None:
        """Send a sequence to its request's core (the least loaded, for the first)."""
        self._check_alive()
        # A request's load: its sequences together (n > 1 share a group and a core).
        unit = request.sharing_group or request.request_id
        index = self._unit_core.get(unit)
        if index is None:
            index = self._loads.pick()
            self._loads.added(index)
            self._unit_core[unit] = index
        self.cores[index].send_add([request])
        self._unit_of[request.request_id] = unit
        self._num_live[unit] = self._num_live.get(unit, 0) + 1

    def abort_requests(self, request_ids: list[str]) -> None:
        for index, ids in self._end(request_ids).items():
            self.cores[index].send_abort(ids)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """A stop string matched here: the cores finish these sequences as stopped."""
        assert status == RequestStatus.FINISHED_STOPPED, status  # all the message carries
        for index, ids in self._end(request_ids).items():
            self.cores[index].send_finish(ids)

    def _end(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Forget these sequences (unknown ids are skipped); returns the known ones by
        core. A request stops counting toward its core's load with its last sequence."""
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            unit = self._unit_of.pop(request_id, None)
            if unit is None:
                continue
            index = self._unit_core[unit]
            by_core.setdefault(index, []).append(request_id)
            self._num_live[unit] -= 1
            if self._num_live[unit] == 0:
                del self._num_live[unit], self._unit_core[unit]
                self._loads.ended(index)
        return by_core

    def reset_prefix_cache(self) -> None:
        self._check_alive()
        for core in self.cores:
            core.send_reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self._unit_of)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs every core has sent since the last call, waiting until one has sent
        some while any sequence runs. Raises EngineDeadError when a core died or failed."""
        self.step_cost, self.step_tokens, self.step_seconds = (0.0, 0.0), 0, 0.0
        outputs: list[EngineCoreOutput] = []
        while self._unit_of and not outputs:
            self._check_alive()
            # Wake when any core has sent outputs (or after _POLL_S, to notice deaths).
            self._poller.poll(int(_POLL_S * 1000))
            for index in range(len(self.cores)):
                outputs += self._take(index)
        return outputs

    def _take(self, index: int) -> list[EngineCoreOutput]:
        """The outputs of core `index`'s waiting messages."""
        outputs: list[EngineCoreOutput] = []
        try:
            while (message := self.cores[index].receive_blocking(0.0)) is not None:
                outputs += message.outputs
                self._loads.report(index, message.stats.kv_cache_usage)
                self.step_cost = (
                    self.step_cost[0] + message.step_bytes,
                    self.step_cost[1] + message.step_flops,
                )
                self.step_seconds += message.step_seconds
        except EngineDeadError as e:
            self._dead = str(e)
            raise
        for output in outputs:
            self.step_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                self._end([output.request_id])
        return outputs

    def _check_alive(self) -> None:
        if self._dead is None:
            for core in self.cores:
                if not core.is_alive:
                    self._dead = core.death_message()
                    break
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def shutdown(self) -> None:
        """Stop every core (and leave a Ray cluster joined for them); idempotent."""
        for core in self.cores:
            core.shutdown()
        if self._ray_cluster is not None:
            self._ray_cluster.shutdown()
