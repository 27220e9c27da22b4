"""The engine-core process: an EngineCore behind two ZMQ sockets, stepping while it has work.

Requests and outputs cross as msgpack arrays of plain data (token ids, counts, strings); the
first item names the message:

    server -> core (PUSH/PULL, "input"):
        ["add", [[request_id, prompt_token_ids, params, sharing_group, fork_of], ...]]
            params: the SamplingParams fields by name (`encode_sampling_params`), max_tokens
                resolved
        ["abort", [request_id, ...]]    free now; the caller has forgotten them
        ["finish", [request_id, ...]]   a stop string matched: finish as FINISHED_STOPPED
        ["shutdown"]
    core -> server (PUSH/PULL, "output"):
        ["outputs", [output, ...], stats, queue_times]   after each step or handled input
            output: the EngineCoreOutput fields in order; a field holding a dataclass
                (SampleLogprobsData, ...) is the list of that one's fields, or nil
            stats: the SchedulerStats fields in order
            queue_times: [[request_id, seconds from arrival to first scheduling], ...]
        ["error", traceback_text]   the loop failed; the process exits right after

Startup goes over a multiprocessing pipe, once: ("ready", num_blocks), ("invalid", message)
for a ValueError (a bad option) or ("error", traceback text).
The core binds "input" and the server connects to it once the core is ready; the server binds
"output". Neither side has a high-water mark, so sends never block. The core exits on
"shutdown", when its parent process is gone (checked while idle), or on an error.
"""

import dataclasses
import logging
import os
import signal
import time
import traceback
import typing
from typing import Any

import msgpack

from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.scheduler import EngineCoreOutput

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle core checks that its parent is alive


def encode_sampling_params(params: SamplingParams) -> dict[str, Any]:
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    values["output_kind"] = params.output_kind.value
    values["eos_token_ids"] = list(params.eos_token_ids)
    return values


def decode_sampling_params(values: dict[str, Any]) -> SamplingParams:
    values = dict(values)
    values["output_kind"] = RequestOutputKind(values["output_kind"])
    values["eos_token_ids"] = tuple(values["eos_token_ids"])
    return SamplingParams(**values)


def encode_output(output: EngineCoreOutput) -> list[Any]:
    """The fields in order; nested dataclasses (logprobs data) as lists of their fields."""
    return [_plain(getattr(output, f.name)) for f in dataclasses.fields(output)]


def decode_output(values: list[Any]) -> EngineCoreOutput:
    kwargs = {}
    for f, value in zip(dataclasses.fields(EngineCoreOutput), values, strict=True):
        nested = _NESTED_TYPES.get(f.name)
        kwargs[f.name] = nested(*value) if nested is not None and value is not None else value
    return EngineCoreOutput(**kwargs)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name) for f in dataclasses.fields(value)]
    return value


def _nested_types() -> dict[str, Any]:
    """Field name -> dataclass, for the fields of EngineCoreOutput that hold one."""
    nested = {}
    for name, hint in typing.get_type_hints(EngineCoreOutput).items():
        for arg in typing.get_args(hint) or (hint,):
            if dataclasses.is_dataclass(arg):
                nested[name] = arg
    return nested


_NESTED_TYPES = _nested_types()


def pack(message: list[Any]) -> bytes:
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def unpack(data: bytes) -> list[Any]:
    message: list[Any] = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return message


def run_engine_core(
    engine_args: dict[str, Any],
    input_address: str,
    output_address: str,
    ready_pipe: Any,
    parent_pid: int,
) -> None:
    """Main of the engine-core process (started with the 'spawn' context)."""
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s (EngineCore) %(name)s: %(message)s"
    )
    # Ctrl-C, or a SIGTERM sent to the whole process group (timeout, systemd), reaches the
    # server too, which then stops us with "shutdown": dying first would look like a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from pagedserve.engine.arg_utils import EngineArgs
        from pagedserve.engine.core import EngineCore

        core = EngineCore(EngineArgs(**engine_args).create_engine_config())
        loop = _CoreLoop(core, input_address, output_address, parent_pid)
    except BaseException as e:
        # A ValueError names a bad option: the caller re-raises it as one, without our stack.
        if isinstance(e, ValueError):
            ready_pipe.send(("invalid", str(e)))
        else:
            ready_pipe.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    ready_pipe.send(("ready", core.num_blocks))
    ready_pipe.close()
    loop.run()


class _CoreLoop:
    """Receives messages, steps the core while it has requests, sends outputs back."""

    def __init__(self, core: Any, input_address: str, output_address: str, parent_pid: int):
        import zmq

        self.core = core
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PULL)
        self.input.setsockopt(zmq.RCVHWM, 0)
        self.input.bind(input_address)
        self.output = self.context.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_address)
        self.unscheduled: dict[str, float] = {}  # request id -> arrival, until first scheduled
        self.rejected: list[EngineCoreOutput] = []  # sent as aborted with the next outputs
        self.running = True

    def run(self) -> None:
        try:
            while self.running:
                handled_input = self._receive_all()
                if self.running and (handled_input or self.core.has_unfinished_requests()):
                    self._step()
        except BaseException:
            logger.exception("the engine core loop failed")
            self._send(["error", traceback.format_exc()])
            raise SystemExit(1) from None
        finally:
            self.core.shutdown()
            self.input.close(linger=0)
            self.output.close()
            self.context.term()

    def _receive_all(self) -> bool:
        """Handle every waiting message; block while there is no work. Stop once the parent
        (API server) process is gone, idle or busy: nobody would read the outputs."""
        handled = False
        while self.running:
            if os.getppid() != self.parent_pid:  # a cheap syscall, so checked every step
                logger.info("the API server process is gone; shutting down")
                self.running = False
                break
            busy = handled or self.core.has_unfinished_requests()
            if not self.input.poll(0 if busy else _IDLE_POLL_MS):
                if busy:
                    return handled
                continue
            self._handle(unpack(self.input.recv()))
            handled = True
        return handled

    def _handle(self, message: list[Any]) -> None:
        from pagedserve.request import Request, RequestStatus

        kind = message[0]
        if kind == "add":
            now = time.monotonic()
            for request_id, prompt_token_ids, params, group, fork_of in message[1]:
                request = Request(
                    request_id,
                    prompt_token_ids,
                    decode_sampling_params(params),
                    now,
                    sharing_group=group,
                    fork_of=fork_of,
                )
                try:
                    self.core.add_request(request)
                except ValueError as e:  # the server checks first; never let one request kill us
                    logger.error("rejected request %s: %s", request_id, e)
                    self.rejected.append(EngineCoreOutput(request_id, [], None, "abort", None, 0))
                    continue
                self.unscheduled[request_id] = now
        elif kind in ("abort", "finish"):
            for request_id in message[1]:
                self.unscheduled.pop(request_id, None)
            if kind == "abort":
                self.core.abort_requests(message[1])
            else:
                self.core.finish_requests(message[1], RequestStatus.FINISHED_STOPPED)
        elif kind == "shutdown":
            self.running = False
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _step(self) -> None:
        from pagedserve.request import RequestStatus

        start = time.monotonic()
        outputs = self.core.step()
        if self.rejected:
            outputs, self.rejected = self.rejected + outputs, []
        queue_times = []
        requests = self.core.scheduler.requests
        for request_id, arrival in list(self.unscheduled.items()):
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.WAITING:
                queue_times.append([request_id, start - arrival])
                del self.unscheduled[request_id]
        stats = dataclasses.astuple(self.core.stats())
        self._send(["outputs", [encode_output(o) for o in outputs], list(stats), queue_times])

    def _send(self, message: list[Any]) -> None:
        """Send without ever blocking for good: a PUSH socket whose peer is gone would wait
        forever, so retry only while the API server process is alive."""
        import zmq

        data = pack(message)
        while True:
            try:
                self.output.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if os.getppid() != self.parent_pid:
                    logger.info("the API server process is gone; shutting down")
                    self.running = False
                    return
                time.sleep(0.01)
