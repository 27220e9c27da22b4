"""MultiprocExecutor: one worker process per rank, driven over pipes.

    engine process (scheduler; no model)        worker process of rank r (r = 0 .. world-1,
    ------------------------------------        world = pp_size x tp_size) ---------------
    pickle (method, args) once, send to every  ──▶ Worker.<method>(*args) ◀─ gloo/NCCL ─▶ peers
    rank; wait for all replies, a worker's exit ◀── ("ok", result): the output rank's step
    (its sentinel) or the timeout                   output, None from the others; or
                                                    ("error", traceback)

Rank r is tensor-parallel rank r % tp_size of pipeline stage r // tp_size; the output rank is
the last stage's first (`worker.output_rank`). Pipeline stages pass hidden states between
them themselves (`worker.pp_stage`); the executor sends every rank the same calls.

Every rank, rank 0 included, is a worker process, so the engine's process never joins a
process group (several engines, of any tp_size, can live in one process) and a dead rank 0
is detected like any other.

Failures: an "error" reply, a worker that exits, or no reply within `distributed_timeout_s`
(a rank stuck in a collective) kill every worker at once and raise EngineDeadError; later
calls raise it again. Workers end on "shutdown", or as soon as the engine's process is gone
(a watchdog thread waits for EOF on a pipe whose only writer the engine holds), so none
outlives it, even a SIGKILLed one.

Start method: GPU ranks are spawned (a fresh interpreter each, as CUDA requires). CPU ranks
fork from multiprocessing's forkserver, itself a fresh interpreter that has only imported
torch, transformers and the worker code: a rank starts in milliseconds instead of the seconds
those imports take (tests start many engines). The forkserver stays, idle, until the engine's
process exits. Neither imports the user's `__main__` (see `process_start`): a script without
an `if __name__ == "__main__":` guard, or read from standard input, works.
"""

import contextlib
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.config_checks import check_gpus_for_ranks
from pagedserve.distributed.parallel_state import get_open_port
from pagedserve.errors import EngineDeadError
from pagedserve.executor.base import STARTUP_TIMEOUT_S, RankGroupExecutor
from pagedserve.process_start import check_not_importing_main, main_not_reimported
from pagedserve.worker.runner_setup import resolve_device
from pagedserve.worker.worker import Worker, output_rank

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 5.0


class RemoteTraceback(Exception):
    """A worker's traceback, attached as the cause of the error it raised."""

    def __str__(self) -> str:
        return f"\n\n(in the worker process)\n{self.args[0]}"


@dataclass(slots=True)
class _WorkerProcess:
    rank: int
    process: BaseProcess
    conn: connection.Connection  # the engine's end of the worker's pipe


class MultiprocExecutor(RankGroupExecutor):
    """Ranks as local processes; see the module docstring for the message path."""

    def __init__(self, config: EngineConfig) -> None:
        check_not_importing_main()
        parallel_config = config.parallel_config
        self.timeout_s = parallel_config.distributed_timeout_s
        self.dead_reason: str | None = None
        self.device_type = resolve_device(config.device_config.device).type
        world_size = parallel_config.world_size
        if self.device_type == "cuda" and config.device_config.device in ("auto", "cuda"):
            check_gpus_for_ranks(world_size, torch.cuda.device_count(), parallel_config)
        self.output_rank = output_rank(config)
        tp_size = parallel_config.tensor_parallel_size
        # (a data-parallel engine gives each core's group its own port; else any free one)
        init_method = f"tcp://127.0.0.1:{envs.distributed_port() or get_open_port()}"
        context = _start_context(config)
        # Never written: its reader sees EOF when the engine's process ends.
        engine_alive_reader, self._engine_alive = context.Pipe(duplex=False)
        self.workers: list[_WorkerProcess] = []
        self.max_concurrent_batches = parallel_config.pipeline_parallel_size
        # Submitted steps go out through a thread (`_submit`): the engine must never block
        # writing step N+1 into a worker's full pipe while that worker blocks writing step
        # N's reply, which the engine has not read yet.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._sender: list[threading.Thread] = []  # started with the first submitted step
        self._finalizer = weakref.finalize(
            self, _stop_all, self.workers, self._engine_alive, self._outbox, self._sender
        )
        for rank in range(world_size):
            conn, child_conn = context.Pipe()
            process = context.Process(
                target=run_worker,
                args=(config, rank, init_method, child_conn, engine_alive_reader),
                name=f"PagedServeWorker-{_rank_name(rank, tp_size, world_size)}",
                daemon=True,  # also terminated by multiprocessing at interpreter exit
            )
            with main_not_reimported():  # a script without a main guard works too
                process.start()
            child_conn.close()
            self.workers.append(_WorkerProcess(rank, process, conn))
        engine_alive_reader.close()
        try:
            # Pipeline stages may hold different numbers of layers: the largest block.
            self._block_bytes: int = max(self._collect("start", STARTUP_TIMEOUT_S))
        except EngineDeadError as e:  # a worker failed to start: raise its own error if any
            raise e.__cause__ or e  # noqa: B904 (the cause carries the worker's traceback)
        logger.info(
            "started %d workers (pipeline_parallel_size %d x tensor_parallel_size %d; pids %s)",
            len(self.workers),
            parallel_config.pipeline_parallel_size,
            tp_size,
            self.worker_pids,
        )

    @property
    def worker_pids(self) -> list[int]:
        """The workers' process ids in rank order (-1 for one not started)."""
        return [w.process.pid or -1 for w in self.workers]

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block on one rank (the most any rank reported at start-up)."""
        return self._block_bytes

    def shutdown(self) -> None:
        """Ask every worker to leave its group and exit; kill those that do not. Idempotent."""
        self.dead_reason = self.dead_reason or "the engine was shut down"
        self._finalizer()

    def _send(self, method: str, *args: Any) -> None:
        """Send Worker.<method>(*args) to every rank, from this thread (`_call` has collected
        the replies of every submitted step first, so the sender thread is idle)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self.workers:
            try:
                worker.conn.send_bytes(message)
            except OSError:
                raise self._fail(self._death_note(worker)) from None

    def _submit(self, method: str, *args: Any) -> None:
        """Send a submitted step through the sender thread (a write to a worker whose pipe
        is full then waits there, not here; a dead worker is seen by `_collect`)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self._sender:
            thread = threading.Thread(
                target=_send_submitted,
                args=(self._outbox, self.workers),
                name="PagedServeStepSender",
                daemon=True,
            )
            thread.start()
            self._sender.append(thread)
        self._outbox.put(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))

    def _receive(self, ticket: Any, method: str, timeout_s: float) -> list[Any]:
        """The replies of the oldest call not yet received (calls are answered in order)."""
        return self._collect(method, timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """Wait for one reply per rank, watching every worker's exit and the deadline."""
        replies: dict[int, Any] = {}
        by_handle: dict[Any, _WorkerProcess] = {w.conn: w for w in self.workers}
        by_handle.update({w.process.sentinel: w for w in self.workers})
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.workers):
            waiting = [w for w in self.workers if w.rank not in replies]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(
                    f"worker rank(s) {[w.rank for w in waiting]} did not answer "
                    f"{what} within {timeout_s:g} s (distributed_timeout_s)"
                )
            handles = [w.conn for w in waiting] + [w.process.sentinel for w in self.workers]
            for handle in connection.wait(handles, remaining):
                worker = by_handle[handle]
                # A worker that exits may have sent its error first: read that, not its death.
                if worker.rank in replies or not worker.conn.poll():
                    raise self._fail(self._death_note(worker))
                try:
                    status, payload = worker.conn.recv()
                except (EOFError, OSError):
                    raise self._fail(self._death_note(worker)) from None
                if status == "error":
                    reason = f"worker rank {worker.rank} failed in {what}"
                    # Often because a peer died mid-collective: name that death, the cause.
                    dead = self._dead_peer(worker)
                    if dead is not None:
                        reason = f"{self._death_note(dead)}, and then {reason}"
                    raise self._fail(reason, _remote_error(*payload))
                replies[worker.rank] = payload
        return [replies[rank] for rank in range(len(self.workers))]

    def _fail(self, reason: str, cause: BaseException | None = None) -> EngineDeadError:
        """Kill every worker now (the others may wait in a collective with the failed one) and
        return the error to raise."""
        self.dead_reason = f"{reason}; the engine cannot continue: restart it"
        logger.error("%s", self.dead_reason)
        stop_workers(self.workers, self._engine_alive, graceful=False)
        error = EngineDeadError(self.dead_reason)
        error.__cause__ = cause
        return error

    def _dead_peer(self, worker: _WorkerProcess) -> _WorkerProcess | None:
        """Another rank that has exited (waiting up to 0.2 s each for one just killed)."""
        for peer in self.workers:
            if peer is not worker:
                peer.process.join(0.2)
                if peer.process.exitcode is not None:
                    return peer
        return None

    @staticmethod
    def _death_note(worker: _WorkerProcess) -> str:
        worker.process.join(0.5)
        code = worker.process.exitcode
        how = (
            "still running"
            if code is None
            else f"killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exit code {code}"
        )
        return f"worker rank {worker.rank} (pid {worker.process.pid}) died ({how})"


def _start_context(config: EngineConfig) -> Any:
    """spawn for GPU ranks; for CPU ranks, the forkserver with the heavy imports preloaded."""
    device = config.device_config.device
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    hf_config_module = type(config.model_config.hf_config).__module__  # unpickling needs it
    context.set_forkserver_preload(
        ["torch", "transformers", hf_config_module, "pagedserve.worker.worker"]
    )
    return context


def _send_submitted(
    outbox: "queue.SimpleQueue[bytes | None]", workers: list[_WorkerProcess]
) -> None:
    """The sender thread: send each submitted step to every worker, in order, until None.
    A worker that is gone is skipped (the engine's `_collect` reports its death)."""
    while (message := outbox.get()) is not None:
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.conn.send_bytes(message)


def _stop_all(
    workers: list[_WorkerProcess],
    engine_alive: connection.Connection,
    outbox: "queue.SimpleQueue[bytes | None]",
    sender: list[threading.Thread],
) -> None:
    """Stop the sender thread (after what it is sending), then the workers (`stop_workers`)."""
    outbox.put(None)
    for thread in sender:
        thread.join(_SHUTDOWN_TIMEOUT_S)
    stop_workers(workers, engine_alive)


def stop_workers(
    workers: list[_WorkerProcess], engine_alive: connection.Connection, graceful: bool = True
) -> None:
    """Graceful: send "shutdown" and wait up to 5 s. Then SIGKILL whatever still runs (a
    SIGTERM would stay pending on a stopped process) and reap it."""
    if graceful:
        for worker in workers:
            if worker.process.is_alive():
                with contextlib.suppress(OSError):
                    worker.conn.send(("shutdown", ()))
        deadline = time.monotonic() + _SHUTDOWN_TIMEOUT_S
        for worker in workers:
            worker.process.join(max(deadline - time.monotonic(), 0))
    for worker in workers:
        if worker.process.is_alive():
            worker.process.kill()
    for worker in workers:
        worker.process.join(_SHUTDOWN_TIMEOUT_S)
        worker.conn.close()
    engine_alive.close()


def _remote_error(pickled_error: bytes | None, text: str) -> BaseException:
    """The worker's exception (or a RuntimeError when it does not unpickle), caused by its
    traceback."""
    error: BaseException
    try:
        error = pickle.loads(pickled_error) if pickled_error is not None else RuntimeError(text)
    except Exception:
        error = RuntimeError(text)
    error.__cause__ = RemoteTraceback(text)
    return error


def run_worker(
    config: EngineConfig,
    rank: int,
    distributed_init_method: str,
    conn: connection.Connection,
    engine_alive: connection.Connection,
) -> None:
    """Main of a worker process: start the rank, then serve calls until told to stop."""
    parallel_config = config.parallel_config
    name = _rank_name(rank, parallel_config.tensor_parallel_size, parallel_config.world_size)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(levelname)s (Worker {name}) %(name)s: %(message)s",
    )
    # Ctrl-C or a SIGTERM to the process group reaches the engine too, which stops us; we
    # also exit when it is gone (_exit_with_engine).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_engine, args=(engine_alive,), daemon=True).start()
    try:
        worker = Worker(config, rank, rank, distributed_init_method)
        conn.send(("ok", worker.block_bytes))
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the engine closed our pipe
                break
            if method == "shutdown":
                break
            conn.send(("ok", getattr(worker, method)(*args)))
        worker.shutdown()
    except BaseException as e:
        _send_error(conn, e)
        os._exit(1)  # no interpreter teardown: a collective library may block in it
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the group is left and nothing is buffered: skip torch's slow teardown


def _rank_name(rank: int, tp_size: int, world_size: int) -> str:
    """The rank's name in process names and logs: TP1 without pipeline parallelism, else
    PP1_TP0 (its stage, then its tensor-parallel rank)."""
    if world_size == tp_size:
        return f"TP{rank}"
    return f"PP{rank // tp_size}_TP{rank % tp_size}"


def _send_error(conn: connection.Connection, error: BaseException) -> None:
    try:
        pickled: bytes | None = pickle.dumps(error)
    except Exception:
        pickled = None
    with contextlib.suppress(OSError):
        conn.send(("error", (pickled, traceback.format_exc())))


def _exit_with_engine(engine_alive: connection.Connection) -> None:
    """End this worker as soon as the engine's process is gone: the pipe is never written,
    so it turns readable only at EOF, when its one writer (in the engine) is closed."""
    try:
        engine_alive.poll(None)
    finally:
        os._exit(1)
