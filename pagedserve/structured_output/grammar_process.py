"""The grammar process: structured outputs' matchers in a process of their own.

A constrained step costs the host xgrammar's accept of each row's sampled token and the fill
of each row's next bitmask (~1.8 ms each for 256 JSON rows on the H200 host). In the engine
thread that is serial with scheduling and input preparation, which already make the
unconstrained step host-bound; on a second thread of the engine process it competes with
them for the GIL (both measured: BENCHMARKS.md, issue 17). Here the matchers live in another
process. The engine sends each step's tokens as soon as the device has them and the next
step's rows as soon as they are scheduled; the process accepts and fills into shared memory
while the engine thread schedules and launches the forward, and the engine waits only when
the mask is not ready by the time the sampler needs it.

Messages, engine -> process, in one ordered pipe (every matcher operation is applied in the
engine's order): ("compile", key, params), ("forget", key), ("add", slot, key),
("free", slot), ("rollback", slot, keep), ("accept", slots, tokens),
("fill", seq, slots, buffer name, buffer rows, first row), ("warm",) (load the tokenizer
and xgrammar's vocabulary tables ahead of the first compile), ("stop",). A slot is the engine's
number for one request's matcher (a request id may be reused while a step is in flight).
Replies: ("compiled", key, error text or None, stop token ids), ("filled", seq).
"""

import contextlib
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from pagedserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class SharedBitmask:
    """An int32 bitmask buffer [rows, words] in shared memory (the engine makes it, the grammar
    process fills it, the device copies from it). `pin(array)` / `unpin(array)`: page-lock it
    for the device's copies (cudaHostRegister), or None on a CPU."""

    def __init__(
        self,
        rows: int,
        words: int,
        pin: Callable[[np.ndarray], None] | None = None,
        unpin: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        self.shape = (max(rows, 1), words)
        self.shm = SharedMemory(create=True, size=self.shape[0] * words * 4)
        self.array: np.ndarray = np.ndarray(self.shape, np.int32, self.shm.buf)
        self._unpin = unpin if pin is not None else None
        if pin is not None:
            pin(self.array)

    @property
    def name(self) -> str:
        return self.shm.name

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin(self.array)
        del self.array
        self.shm.close()
        self.shm.unlink()


class GrammarProcess:
    """The engine's handle on the grammar process (started by `start`, stopped by `shutdown`).

    load_tokenizer must be picklable (a module-level function or a functools.partial of one):
    the process calls it, once, at its first compile. Sends are ordered; replies arrive on a
    reader thread, which resolves the futures of `compile` and `fill`. If the process dies,
    every pending and later future fails with RuntimeError."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int]
    ) -> None:
        # A fresh interpreter (`python -m` this module), not multiprocessing's spawn: spawn
        # re-runs the user's main script in the child unless it has a __main__ guard (an
        # offline `LLM(...)` script usually has none), and fork is unsafe once CUDA is up.
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((load_tokenizer, vocab_size, stop_token_ids, logging.getLogger().level))
        self._lock = threading.Lock()  # sends, and the futures' tables
        self._compiles: dict[str, Future[tuple[int, ...]]] = {}
        self._fills: dict[int, Future[None]] = {}
        self._seq = 0
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="grammar-replies", daemon=True)
        self._reader.start()

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue one operation for the process (see the module docstring)."""
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            try:
                self._conn.send(message)
            except OSError as e:  # its end of the socket is gone
                raise RuntimeError("the grammar process exited") from e

    def compile(self, key: str, params: StructuredOutputsParams) -> "Future[tuple[int, ...]]":
        """Compile the constraint `key` in the process; the future gives the stop token ids
        of its matchers, or raises RuntimeError with xgrammar's error."""
        future: Future[tuple[int, ...]] = Future()
        with self._lock:
            self._compiles[key] = future
        self.send(("compile", key, params))
        return future

    def fill(self, slots: list[int], buffer: SharedBitmask, first_row: int) -> "Future[None]":
        """Fill rows first_row.. of `buffer` with the matchers of `slots` (after every
        operation sent before); done when the rows are written."""
        future: Future[None] = Future()
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._fills[seq] = future
        self.send(("fill", seq, slots, buffer.name, buffer.shape[0], first_row))
        return future

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._fail_all("the grammar process exited")
                return
            if message[0] == "compiled":
                _, key, error, stop_ids = message
                with self._lock:
                    future = self._compiles.pop(key, None)
                if future is not None:
                    if error is None:
                        future.set_result(tuple(stop_ids))
                    else:
                        future.set_exception(RuntimeError(error))
            elif message[0] == "filled":
                with self._lock:
                    done = self._fills.pop(message[1], None)
                if done is not None:
                    done.set_result(None)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._dead = why
            futures: list[Future[Any]] = [*self._compiles.values(), *self._fills.values()]
            self._compiles.clear()
            self._fills.clear()
        for future in futures:
            if not future.done():
                future.set_exception(RuntimeError(why))

    def shutdown(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):  # it may have died already
            self.send(("stop",))
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._conn.close()


# -- the process's side ---------------------------------------------------------------------


class _Home:
    """The process's matchers (slot -> XgrammarGrammar), compiled grammars (key -> xgrammar's
    CompiledGrammar) and the accept history of each slot (True: accepted, False: escaped the
    mask), which makes rollback exact."""

    def __init__(
        self,
        conn: Connection,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: list[int],
    ) -> None:
        from pagedserve.structured_output.batch_matcher import BatchMatcher

        self.conn = conn
        self.send_lock = threading.Lock()  # the main loop and the compile threads reply
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.backend: Any = None
        self.backend_lock = threading.Lock()
        self.compiled: dict[str, Any] = {}
        self.grammars: dict[int, Any] = {}
        self.history: dict[int, list[bool]] = {}
        self.buffers: dict[str, tuple[SharedMemory, np.ndarray]] = {}
        self.batch = BatchMatcher()
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="grammar-compile")

    def reply(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(message)

    def get_backend(self) -> Any:
        """The XgrammarBackend (the tokenizer and xgrammar's vocabulary tables: seconds, once)."""
        from pagedserve.structured_output.backend_xgrammar import XgrammarBackend

        with self.backend_lock:
            if self.backend is None:
                tokenizer = self.load_tokenizer()
                self.backend = XgrammarBackend(tokenizer, self.vocab_size, self.stop_token_ids)
        return self.backend

    def warm(self) -> None:
        try:
            self.get_backend()
        except Exception:  # noqa: BLE001 - the first compile reports it
            logger.exception("loading the grammar backend failed")

    def compile(self, key: str, params: StructuredOutputsParams) -> None:
        try:
            self.compiled[key] = self.get_backend().compile(params)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own
            from pagedserve.structured_output.backend_xgrammar import xgrammar_error_text

            self.reply(("compiled", key, xgrammar_error_text(e), ()))
            return
        stop_ids = sorted(self.backend.stop_token_ids)
        self.reply(("compiled", key, None, stop_ids))

    def buffer(self, name: str, rows: int) -> np.ndarray:
        found = self.buffers.get(name)
        if found is None:
            shm = SharedMemory(name=name)
            # The engine owns (and unlinks) it: without this, this process's resource
            # tracker would unlink it too at exit (Python < 3.13 registers on attach).
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            words = (self.vocab_size + 31) // 32
            found = (shm, np.ndarray((rows, words), np.int32, shm.buf))
            self.buffers[name] = found
        return found[1]

    def accept(self, slots: list[int], tokens: list[int]) -> None:
        live = [
            (slot, token)
            for slot, token in zip(slots, tokens, strict=True)
            if token >= 0 and slot in self.grammars and not self.grammars[slot].terminated
        ]
        if not live:
            return
        grammars = [self.grammars[slot] for slot, _ in live]
        accepted = self.batch.accept([g.matcher for g in grammars], [t for _, t in live])
        stop_ids = self.backend.stop_token_ids
        for (slot, token), grammar, ok in zip(live, grammars, accepted, strict=True):
            self.history[slot].append(ok)
            if ok:
                grammar.num_processed_tokens += 1
                if token in stop_ids and grammar.is_terminated():
                    grammar.terminated = True
            else:
                logger.warning("token %d is not allowed by its grammar (slot %d)", token, slot)

    def rollback(self, slot: int, keep: int) -> None:
        """Make the matcher's state that of the first `keep` tokens it was sent."""
        history = self.history.get(slot)
        if history is None or len(history) <= keep:
            return
        undone = sum(history[keep:])
        del history[keep:]
        self.grammars[slot].rollback(undone)

    def fill(self, slots: list[int], bitmask: np.ndarray) -> None:
        grammars = [self.grammars.get(slot) for slot in slots]
        live = [row for row, g in enumerate(grammars) if g is not None and not g.terminated]
        if len(live) < len(slots):  # terminated or freed: every token allowed (as in-process)
            bitmask[sorted(set(range(len(slots))) - set(live))] = -1
        if live:
            matchers = [grammars[row].matcher for row in live]  # type: ignore[union-attr]
            self.batch.fill(matchers, bitmask, None if len(live) == len(slots) else live)

    def serve(self) -> None:
        from pagedserve.structured_output.backend_xgrammar import XgrammarGrammar

        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "fill":
                _, seq, slots, name, rows, first = message
                self.fill(slots, self.buffer(name, rows)[first : first + len(slots)])
                self.reply(("filled", seq))
            elif kind == "accept":
                self.accept(message[1], message[2])
            elif kind == "add":
                self.grammars[message[1]] = XgrammarGrammar(self.compiled[message[2]])
                self.history[message[1]] = []
            elif kind == "free":
                self.grammars.pop(message[1], None)
                self.history.pop(message[1], None)
            elif kind == "rollback":
                self.rollback(message[1], message[2])
            elif kind == "compile":
                self.pool.submit(self.compile, message[1], message[2])
            elif kind == "warm":
                self.pool.submit(self.warm)
            elif kind == "forget":
                self.compiled.pop(message[1], None)
            elif kind == "release":
                found = self.buffers.pop(message[1], None)
                if found is not None:
                    shm = found[0]
                    del found  # the array's view of the memory first
                    shm.close()
            elif kind == "stop":
                return


def _main(fd: int) -> None:
    """The process: its arguments come first on the connection (file descriptor `fd`)."""
    conn = Connection(fd)
    load_tokenizer, vocab_size, stop_token_ids, log_level = conn.recv()
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    home = _Home(conn, load_tokenizer, vocab_size, stop_token_ids)
    try:
        home.serve()
    finally:
        home.pool.shutdown(wait=False, cancel_futures=True)
        shms = [shm for shm, _ in home.buffers.values()]
        home.buffers.clear()  # the arrays' views of the memory first
        for shm in shms:
            shm.close()


if __name__ == "__main__":
    _main(int(sys.argv[1]))
