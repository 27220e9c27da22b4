"""The engine-core process: an EngineCore behind two ZMQ sockets, stepping while it has work.

Requests and outputs cross as the msgspec structs of `pagedserve.messages`, encoded with its
codec (msgpack; each message is an array whose first item is its tag, each struct the array of
its fields in order):

    server -> core (PUSH/PULL, "input"), `messages.ToCore`:
        AddRequests     ["add", [EngineCoreRequest, ...]]
            EngineCoreRequest: request_id, prompt_token_ids, sampling_params (the
                SamplingParams dataclass by field name, max_tokens resolved), sharing_group,
                priority, cache_salt, mm_features ([MultiModalFeatureData, ...]: each
                image's pixels as bytes + shape + dtype name, offset, length, identifier)
        AbortRequests   ["abort", [request_id, ...]]    free now; the caller has forgotten them
        FinishRequests  ["finish", [request_id, ...]]   a stop string matched: FINISHED_STOPPED
        Shutdown        ["shutdown"]
    core -> server (PUSH/PULL, "output"), `messages.ToServer`:
        EngineCoreOutputs   ["outputs", [EngineCoreOutput, ...], SchedulerStats, queue_times,
                             scheduled_at, timestamp]
            after each step; queue_times: [[request_id, seconds from arrival to first
            scheduling], ...], scheduled at `scheduled_at` (the step's start); timestamp: when
            the outputs were made (both the core's time.monotonic())
        EngineCoreError     ["error", traceback_text]   the loop failed; the process exits

Startup goes over a multiprocessing pipe, once: ("ready", (num_blocks, sliding_window,
device_name)) (device_name: the CUDA device's, for its roofline peaks; None on a CPU),
("invalid", message) for a ValueError (a bad option), ("unsupported", message) for a
NotImplementedError (a checkpoint we cannot run) or ("error", traceback text).
The core binds "input" and the server connects to it once the core is ready; the server binds
"output". Neither side has a high-water mark, so sends never block. The core exits on
"shutdown", when its parent process is gone (checked while idle), or on an error.
"""

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np

from pagedserve import envs
from pagedserve.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreError,
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishRequests,
    MultiModalFeatureData,
    ResetPrefixCache,
    Shutdown,
    ToCore,
    ToServer,
    decode_to_core,
    encode,
)
from pagedserve.multimodal import MultiModalFeature
from pagedserve.process_start import process_age_seconds

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

_IDLE_POLL_MS = 500  # how often an idle core checks that its parent is alive


def feature_to_data(feature: MultiModalFeature) -> MultiModalFeatureData:
    """An image as it crosses to the core: its pixel array as C-order bytes, shape and dtype."""
    pixels = np.ascontiguousarray(feature.pixel_values)
    return MultiModalFeatureData(
        pixels.tobytes(),
        list(pixels.shape),
        pixels.dtype.name,
        feature.offset,
        feature.length,
        feature.identifier,
        feature.modality,
        None if feature.grid_thw is None else list(feature.grid_thw),
    )


def feature_from_data(data: MultiModalFeatureData) -> MultiModalFeature:
    """The core's MultiModalFeature of a received image. Raises ValueError when the bytes do
    not fill the shape (a message that is not ours), or for an unknown dtype name."""
    pixels = np.frombuffer(data.pixel_bytes, dtype=np.dtype(data.pixel_dtype))
    # frombuffer's array is read-only; a copy lets torch.from_numpy share it without a warning.
    pixels = pixels.reshape(data.pixel_shape).copy()
    grid = None if data.grid_thw is None else (data.grid_thw[0], data.grid_thw[1], data.grid_thw[2])
    return MultiModalFeature(pixels, data.offset, data.length, data.identifier, data.modality, grid)


# Packages that transformers' config modules import when installed, which the engine core
# (and the API server of a text-only model) never uses through transformers (see
# `unused_imports_hidden`).
UNUSED_IMPORTS = ("torchvision", "sklearn")


@contextlib.contextmanager
def unused_imports_hidden(names: tuple[str, ...] = UNUSED_IMPORTS) -> Iterator[None]:
    """While it lasts, `import NAME` finds nothing (a None in `sys.modules`) for each of
    `names` not imported yet.

    transformers' config modules import its image utilities, which import torchvision when
    it is installed (and torchvision imports torch._dynamo), and its generation utilities,
    which import sklearn: 4.2 s and 1.2 s of the 7.9 s that loading a Llama config took on
    the H200 host (`python -X importtime`), on the critical path of the server's start. (The
    config step then took 6.0 s, not 2.5 s: torch.distributed.tensor, which transformers
    imports too, loads much of what torch._dynamo had; `engine.deferred_activations` now
    leaves it out. BENCHMARKS.md, issue 20.) The engine-core process neither processes
    images with transformers nor runs its `generate`, so it loads its config without them;
    so does the API server's process for a text-only model (`engine.server_config`:
    it processes images only for the multimodal architectures). Afterwards they
    import normally (a model's own code may use them), but transformers keeps what it saw:
    the modules it loaded meanwhile take their paths without them, and its cached
    `is_torchvision_available()` stays False in this process."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def without_unused_imports(create: Callable[[], _T]) -> _T:
    """`create()` (an engine config's creation) with `unused_imports_hidden`; again without
    it where the model folder's own config code (`auto_map`, trust_remote_code) imports one
    of them."""
    try:
        with unused_imports_hidden():
            return create()
    except ImportError as e:
        if (e.name or "").split(".")[0] not in UNUSED_IMPORTS:
            raise
        return create()


def engine_config(engine_args: dict[str, Any]) -> "EngineConfig":
    """`EngineArgs(**engine_args)`'s EngineConfig, loaded `without_unused_imports` (where
    the model's own config code imports one of them, the API server's process loads it
    too)."""
    from pagedserve.engine.arg_utils import EngineArgs

    return without_unused_imports(EngineArgs(**engine_args).create_engine_config)


def run_engine_core(
    engine_args: dict[str, Any],
    input_address: str,
    output_address: str,
    ready_pipe: Any,
    parent_pid: int,
    dp_rank: int | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Main of the engine-core process (started with the 'spawn' context). `dp_rank`: this
    core's index under data parallelism (None without), shown in its log lines; `env`: the
    variables it sets first, before anything reads them (its GPUs: CUDA_VISIBLE_DEVICES)."""
    os.environ.update(env or {})
    name = "EngineCore" if dp_rank is None else f"EngineCore_DP{dp_rank}"
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s ({name}) %(name)s: %(message)s")
    # Ctrl-C, or a SIGTERM sent to the whole process group (timeout, systemd), reaches the
    # server too, which then stops us with "shutdown": dying first would look like a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A CPU engine leaves a core to the API server's process (tokenizing, HTTP) unless told
    # otherwise (vLLM's default too): on a small machine the two fight for the cores, and
    # torch's thread pool then waits on descheduled threads (see worker.cpu_threads).
    if not os.environ.get(envs.CPU_RESERVED):  # unset or empty
        os.environ[envs.CPU_RESERVED] = "1"
    try:
        from pagedserve.engine.core import EngineCore

        age = process_age_seconds()
        if age is not None:  # the process's start: Python, torch and the model code's imports
            logger.info("engine core process up in %.1f s (imports)", age)
        start = time.perf_counter()
        config = engine_config(engine_args)
        logger.info("engine config in %.1f s", time.perf_counter() - start)
        core = EngineCore(config)
        loop = _CoreLoop(core, input_address, output_address, parent_pid)
    except BaseException as e:
        # A ValueError names a bad option, a NotImplementedError an unsupported checkpoint
        # (a quantized GPT-2): the caller re-raises each as its type, without our stack.
        if isinstance(e, ValueError):
            ready_pipe.send(("invalid", str(e)))
        elif isinstance(e, NotImplementedError):
            ready_pipe.send(("unsupported", str(e)))
        else:
            ready_pipe.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    ready_pipe.send(("ready", (core.num_blocks, core.sliding_window, core.device_name)))
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
            self._send(EngineCoreError(traceback.format_exc()))
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
            data = self.input.recv()
            try:
                message = decode_to_core(data)
            except msgspec.ValidationError as e:  # a value SamplingParams let through
                self._reject_undecodable(data, e)
            else:
                self._handle(message)
            handled = True
        return handled

    def _reject_undecodable(self, data: bytes, error: msgspec.ValidationError) -> None:
        """A message that is msgpack but not a valid `ToCore` (the caller's checks missed a
        value): its requests, if it adds any, end as "abort" instead of the loop dying."""
        raw = msgspec.msgpack.decode(data)
        request_ids = []
        if isinstance(raw, list) and raw[:1] == ["add"] and len(raw) > 1:
            request_ids = [
                r[0] for r in raw[1] if isinstance(r, list) and r and isinstance(r[0], str)
            ]
        logger.error("rejected an undecodable message (requests %s): %s", request_ids, error)
        self.rejected.extend(EngineCoreOutput(rid, [], None, "abort") for rid in request_ids)

    def _handle(self, message: ToCore) -> None:
        from pagedserve.request import Request, RequestStatus

        match message:
            case AddRequests(requests):
                now = time.monotonic()
                for r in requests:
                    try:
                        request = Request(
                            r.request_id,
                            r.prompt_token_ids,
                            r.sampling_params,
                            now,
                            sharing_group=r.sharing_group,
                            priority=r.priority,
                            cache_salt=r.cache_salt,
                            mm_features=tuple(feature_from_data(f) for f in r.mm_features),
                        )
                        self.core.add_request(request)
                    except ValueError as e:  # the server checks first; never let one kill us
                        logger.error("rejected request %s: %s", r.request_id, e)
                        self.rejected.append(EngineCoreOutput(r.request_id, [], None, "abort"))
                        continue
                    self.unscheduled[r.request_id] = now
            case AbortRequests(request_ids) | FinishRequests(request_ids):
                for request_id in request_ids:
                    self.unscheduled.pop(request_id, None)
                if isinstance(message, AbortRequests):
                    self.core.abort_requests(request_ids)
                else:
                    self.core.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)
            case ResetPrefixCache():
                self.core.reset_prefix_cache()
            case Shutdown():
                self.running = False

    def _step(self) -> None:
        from pagedserve.request import RequestStatus

        start = time.monotonic()
        outputs = self.core.step()
        made = time.monotonic()
        if self.rejected:
            outputs, self.rejected = self.rejected + outputs, []
        queue_times = []
        requests = self.core.scheduler.requests
        for request_id, arrival in list(self.unscheduled.items()):
            request = requests.get(request_id)
            if request is None or request.status != RequestStatus.WAITING:
                queue_times.append((request_id, start - arrival))
                del self.unscheduled[request_id]
        step_bytes, step_flops = self.core.step_cost
        self._send(
            EngineCoreOutputs(
                outputs,
                self.core.stats(),
                queue_times,
                start,
                made,
                step_bytes,
                step_flops,
                self.core.step_seconds,
            )
        )

    def _send(self, message: ToServer) -> None:
        """Send without ever blocking for good: a PUSH socket whose peer is gone would wait
        forever, so retry only while the API server process is alive."""
        import zmq

        data = encode(message)
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
