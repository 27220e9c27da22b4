"""EngineCoreClient: starts the engine-core process and exchanges messages with it."""

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core import SchedulerStats
from pagedserve.engine.core_proc import (
    decode_output,
    encode_sampling_params,
    pack,
    run_engine_core,
    unpack,
)
from pagedserve.errors import EngineDeadError
from pagedserve.process_start import check_not_importing_main, main_not_reimported
from pagedserve.request import Request
from pagedserve.scheduler import EngineCoreOutput

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class CoreOutputs:
    """One "outputs" message of the core: a step's outputs and the scheduler's state after it."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    queue_times: list[tuple[str, float]]  # request id, seconds from arrival to first scheduling


class EngineCoreClient:
    """The API server's side of the engine-core process (see `core_proc` for the messages).

    Construction blocks until the core has loaded the model and sized its KV cache, and raises
    ValueError (a bad option, e.g. a KV cache that does not fit) or RuntimeError with the
    core's traceback if that fails. `send_*` never block; they raise
    EngineDeadError once the core is gone.
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        check_not_importing_main()
        self._closed = False
        self._tmpdir = tempfile.mkdtemp(prefix="pagedserve-")
        input_address = f"ipc://{self._tmpdir}/input"
        output_address = f"ipc://{self._tmpdir}/output"
        self._context = zmq.Context()
        # The core binds the input socket and we connect (once it is ready): a connecting PUSH
        # queues messages at once, so sends never block the event loop (no high-water mark).
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._async_context = zmq.asyncio.Context()
        self._output = self._async_context.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_address)

        mp_context = multiprocessing.get_context("spawn")
        ready_reader, ready_writer = mp_context.Pipe(duplex=False)
        self.process = mp_context.Process(
            target=run_engine_core,
            args=(
                dataclasses.asdict(engine_args),
                input_address,
                output_address,
                ready_writer,
                os.getpid(),
            ),
            name="EngineCore",
        )
        with main_not_reimported():  # a script without a main guard works too
            self.process.start()
        ready_writer.close()
        try:
            self.num_blocks = self._wait_ready(ready_reader)
        except BaseException:
            self.shutdown()
            raise
        finally:
            ready_reader.close()
        self._input.connect(input_address)

    def _wait_ready(self, ready_reader: Any) -> int:
        start = time.monotonic()
        while not ready_reader.poll(0.1):
            if not self.process.is_alive():
                raise RuntimeError(
                    f"the engine core process exited (code {self.process.exitcode}) while "
                    f"starting; see its log above"
                )
        try:
            kind, payload = ready_reader.recv()
        except EOFError:
            raise RuntimeError("the engine core process died while starting") from None
        if kind == "invalid":
            raise ValueError(payload)
        if kind != "ready":
            raise RuntimeError(f"the engine core failed to start:\n{payload}")
        logger.info(
            "engine core ready in %.1f s (pid %d)", time.monotonic() - start, self.process.pid
        )
        return int(payload)

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process ends."""
        sentinel: int = self.process.sentinel
        return sentinel

    def send_add(self, requests: list[Request]) -> None:
        payload = [
            [
                r.request_id,
                r.prompt_token_ids,
                encode_sampling_params(r.sampling_params),
                r.sharing_group,
                r.fork_of,
            ]
            for r in requests
        ]
        self._send(["add", payload])

    def send_abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(["abort", request_ids])

    def send_finish(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(["finish", request_ids])

    def _send(self, message: list[Any]) -> None:
        if not self.process.is_alive():
            raise EngineDeadError(self.death_message())
        try:
            self._input.send(pack(message), flags=zmq.DONTWAIT)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    async def receive(self) -> CoreOutputs:
        """The next outputs message. Raises EngineDeadError when the core reports a failure."""
        message = unpack(await self._output.recv())
        if message[0] == "error":
            raise EngineDeadError(f"the engine core failed:\n{message[1]}")
        _, outputs, stats, queue_times = message
        return CoreOutputs(
            [decode_output(o) for o in outputs],
            SchedulerStats(*stats),
            [(request_id, seconds) for request_id, seconds in queue_times],
        )

    def death_message(self) -> str:
        return (
            f"the engine core process is dead (exit code {self.process.exitcode}); "
            f"restart the server"
        )

    def shutdown(self) -> None:
        """Ask the core to stop, then make sure it does; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._input.send(pack(["shutdown"]), flags=zmq.DONTWAIT)
            self.process.join(_SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():  # it ignores SIGTERM (see core_proc.run): kill it
            self.process.kill()
            self.process.join()
        for socket in (self._input, self._output):
            socket.close(linger=0)
        self._context.term()
        self._async_context.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


async def wait_readable(fd: int) -> None:
    """Return when `fd` becomes readable (a process sentinel: when the process ends)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, on_readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
