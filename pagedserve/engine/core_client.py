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
from pagedserve.engine.core_proc import feature_to_data, run_engine_core
from pagedserve.errors import EngineDeadError
from pagedserve.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreError,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    ResetPrefixCache,
    Shutdown,
    ToCore,
    decode_to_server,
    encode,
)
from pagedserve.process_start import check_not_importing_main, main_not_reimported
from pagedserve.request import Request

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0


class EngineCoreClient:
    """The API server's side of the engine-core process (see `core_proc` for the messages).

    Construction starts the core; with `wait` (the default) it then blocks until the core has
    loaded the model and sized its KV cache (`wait_ready`, which raises ValueError for a bad
    option, e.g. a KV cache that does not fit, or RuntimeError with the core's traceback if
    that fails). `send_*` never block; they raise EngineDeadError once the core is gone.
    """

    def __init__(
        self,
        engine_args: EngineArgs,
        wait: bool = True,
        *,
        dp_rank: int | None = None,
        env: dict[str, str] | None = None,
        blocking: bool = False,
    ) -> None:
        """`dp_rank`: the core's index under data parallelism (None without: one core);
        `env`: environment variables the core process sets first (its GPUs); `blocking`:
        outputs are read with `receive_blocking` (a caller without an event loop: the
        offline LLMEngine), else with the coroutine `receive`."""
        check_not_importing_main()
        self.dp_rank = dp_rank
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
        # (a zmq.asyncio socket, or a plain one for `blocking`)
        self._output: Any = (self._context if blocking else self._async_context).socket(zmq.PULL)
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
                dp_rank,
                env,
            ),
            name="EngineCore" if dp_rank is None else f"EngineCore_DP{dp_rank}",
        )
        self._started = time.monotonic()
        with main_not_reimported():  # a script without a main guard works too
            self.process.start()
        ready_writer.close()
        self._ready_reader: Any = ready_reader
        self._input_address = input_address
        self._ready = False
        self.num_blocks = 0
        self.sliding_window: int | None = None
        self.device_name: str | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the core is ready (idempotent); on failure, stop it and raise as the
        class docstring says."""
        if self._ready:
            return
        try:
            # The KV cache's size and the model's sliding window (None: none for every
            # layer), for checking that a request fits before sending it; the CUDA device's
            # name (None: a CPU) for the roofline peaks of the metrics.
            ready = self._wait_ready(self._ready_reader)
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._ready_reader.close()
        self.num_blocks, self.sliding_window, self.device_name = ready
        self._input.connect(self._input_address)
        self._ready = True

    def _wait_ready(self, ready_reader: Any) -> tuple[int, int | None, str | None]:
        waited = time.monotonic()
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
        if kind == "unsupported":
            raise NotImplementedError(payload)
        if kind != "ready":
            raise RuntimeError(f"the engine core failed to start:\n{payload}")
        now = time.monotonic()
        logger.info(
            "engine core ready in %.1f s after its start (this process waited %.1f s; pid %d)",
            now - self._started,
            now - waited,
            self.process.pid,
        )
        num_blocks, sliding_window, device_name = payload
        return int(num_blocks), sliding_window, device_name

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process ends."""
        sentinel: int = self.process.sentinel
        return sentinel

    def send_add(self, requests: list[Request]) -> None:
        self._send(
            AddRequests(
                [
                    EngineCoreRequest(
                        r.request_id,
                        r.prompt_token_ids,
                        r.sampling_params,
                        r.sharing_group,
                        r.priority,
                        r.cache_salt,
                        [feature_to_data(f) for f in r.mm_features],
                    )
                    for r in requests
                ]
            )
        )

    def send_abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(request_ids))

    def send_finish(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(FinishRequests(request_ids))

    def send_reset_prefix_cache(self) -> None:
        self._send(ResetPrefixCache())

    def _send(self, message: ToCore) -> None:
        if not self.process.is_alive():
            raise EngineDeadError(self.death_message())
        try:
            self._input.send(encode(message), flags=zmq.DONTWAIT)
        except zmq.ZMQError as e:
            raise EngineDeadError(f"cannot reach the engine core: {e}") from e

    async def receive(self) -> EngineCoreOutputs:
        """The next outputs message. Raises EngineDeadError when the core reports a failure."""
        message = decode_to_server(await self._output.recv())
        if isinstance(message, EngineCoreError):
            raise EngineDeadError(f"the engine core failed:\n{message.traceback}")
        return message

    @property
    def output_socket(self) -> zmq.Socket[bytes]:
        """The socket the outputs arrive on, for a zmq.Poller over several blocking clients."""
        socket: zmq.Socket[bytes] = self._output
        return socket

    def receive_blocking(self, timeout_s: float) -> EngineCoreOutputs | None:
        """The next outputs message, waiting up to `timeout_s` (None when none came); for a
        client made with `blocking`. Raises EngineDeadError as `receive`."""
        if not self._output.poll(int(timeout_s * 1000)):
            return None
        message = decode_to_server(self._output.recv())
        if isinstance(message, EngineCoreError):
            raise EngineDeadError(f"the engine core failed:\n{message.traceback}")
        return message

    def death_message(self) -> str:
        which = "" if self.dp_rank is None else f" of data-parallel rank {self.dp_rank}"
        return (
            f"the engine core process{which} is dead (exit code {self.process.exitcode}); "
            f"restart the server"
        )

    def shutdown(self) -> None:
        """Ask the core to stop, then make sure it does; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._ready:  # still starting, not listening yet: nothing to wait for
            self.process.kill()
        if self.process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._input.send(encode(Shutdown()), flags=zmq.DONTWAIT)
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
