"""The engine's side of the grammar process: its matchers' slots, bitmask buffers and steps.

StructuredOutputManager delegates here once `use_grammar_process` is on. The engine's deferred
step (async scheduling on a GPU) then goes:

    schedule N+1      prefetch: ask for N+1's rows; sent at once if N's tokens were sent,
                      else right after them (the process fills after it accepts)
    N's tokens back   send_step_tokens (the engine sends them as soon as the device has
                      them, before or after scheduling): the process accepts them
    sample N+1        prefetched: wait for the rows (and fill now those of requests whose
                      thinking ended with N)
    apply N's tokens  accept: tokens not sent early go now; a stop token terminates

So the process accepts and fills while the engine thread schedules and launches the forward.
"""

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.structured_output.grammar_process import GrammarProcess, SharedBitmask
from pagedserve.structured_outputs_params import StructuredOutputsParams

# (request id, slot) of a bitmask row
Row = tuple[str, int]
Pinning = tuple[Callable[[np.ndarray], None], Callable[[np.ndarray], None]]


@dataclass(slots=True)
class RemoteGrammar:
    """A request's matcher in the grammar process: its slot there (a request id may be
    reused while a step is in flight; a slot never is). The process knows whether it has
    terminated."""

    slot: int


@dataclass(slots=True)
class _Prefetch:
    """A fill asked for when its step was scheduled."""

    rows: list[Row]
    buffer: SharedBitmask
    done: "Future[None] | None" = None  # None: not sent yet (the tokens before it are not)


class RemoteMatchers:
    """The grammar process (started at the first compile) and the engine's view of it.

    load_tokenizer: picklable (the process calls it). pin: page-locks / unlocks a bitmask
    buffer for the device's copies, or None on a CPU. Two shared buffers are used in turn:
    a step's bitmask must be on its way to the device before the step after next fills."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: list[int],
        pin: Pinning | None,
    ) -> None:
        self._args = (load_tokenizer, vocab_size, stop_token_ids)
        self._width = (vocab_size + 31) // 32
        self._pin = pin or (None, None)
        # The process (once started) and the buffers, apart from self: a finalizer stops and
        # releases them if the engine is dropped without `shutdown` (else the process and
        # its shared memory outlived it, the process held by its reply thread).
        self._started: list[GrammarProcess] = []
        self._buffers: list[SharedBitmask] = []
        self._finalizer = weakref.finalize(self, _release, self._started, self._buffers)
        self._turn = 0
        self._next_slot = 0
        self._lock = threading.Lock()  # compile threads and the engine thread
        self._next_name = 0
        self._unmatched: dict[Future[Any], int] = {}  # compile -> requests waiting for it
        self._evicted: set[Future[Any]] = set()  # out of the cache, still waited for
        self.stop_token_ids: frozenset[int] = frozenset()  # the matchers' (from a compile)
        self._sent: set[int] = set()  # slots whose token in flight was sent, not applied
        self._awaiting: list[Row] | None = None  # the last fill's rows, tokens not sent
        self._prefetch: _Prefetch | None = None

    @property
    def _process(self) -> GrammarProcess | None:
        return self._started[0] if self._started else None

    def start(self) -> None:
        """Start the process if it is not running (the first compile does)."""
        with self._lock:
            if not self._started:
                self._started.append(GrammarProcess(*self._args))

    def warm_up(self) -> None:
        """Start the process now and have it load the tokenizer and xgrammar's vocabulary
        tables, so that the first constrained request does not wait for them (12.5 s on the
        H200 host, most of it the process's imports: BENCHMARKS.md, issue 17)."""
        self.start()
        assert self._process is not None
        self._process.send(("warm",))

    def compile(self, key: str, params: StructuredOutputsParams) -> str:
        """Compile the constraint `key` in the process; its name there (one per compile: a
        key evicted and asked for again compiles anew while its first compile may still
        run). Blocks (a compile thread calls it). Raises RuntimeError with xgrammar's error."""
        self.start()
        assert self._process is not None
        with self._lock:
            name = f"{self._next_name}:{key}"
            self._next_name += 1
        self.stop_token_ids = frozenset(self._process.compile(name, params).result())
        return name

    # A compile stays in the process while a request waits to make its matcher from it.

    def waits_for(self, compiled: "Future[Any]") -> None:
        """A request waits for `compiled` (the manager's future of a compile's name)."""
        with self._lock:
            self._unmatched[compiled] = self._unmatched.get(compiled, 0) + 1

    def matched(self, compiled: "Future[Any]") -> None:
        """A request waits no more (its matcher is made, its compile failed, or it ended)."""
        with self._lock:
            left = self._unmatched.pop(compiled, 0) - 1
            if left > 0:
                self._unmatched[compiled] = left
                return
            if compiled not in self._evicted:
                return
            self._evicted.discard(compiled)
        compiled.add_done_callback(self._forget)

    def evict(self, compiled: "Future[Any]") -> None:
        """The manager's cache dropped `compiled`: the process forgets it once no request
        waits for it (its matchers keep what they need)."""
        with self._lock:
            if self._unmatched.get(compiled):
                self._evicted.add(compiled)
                return
        compiled.add_done_callback(self._forget)

    def _forget(self, compiled: "Future[Any]") -> None:
        if self._process is not None and not compiled.cancelled() and compiled.exception() is None:
            self._process.send(("forget", compiled.result()))

    def add(self, key: str) -> RemoteGrammar:
        """A new matcher of the compiled grammar `key`."""
        assert self._process is not None
        grammar = RemoteGrammar(self._next_slot)
        self._next_slot += 1
        self._process.send(("add", grammar.slot, key))
        return grammar

    def free(self, grammar: RemoteGrammar) -> None:
        assert self._process is not None
        self._sent.discard(grammar.slot)
        self._process.send(("free", grammar.slot))

    def rollback(self, grammar: RemoteGrammar, kept: int) -> None:
        """Make the matcher's state that of the first `kept` output tokens it was to see
        (its token in flight, sent and not yet appended to the request, is kept too)."""
        assert self._process is not None
        self._process.send(("rollback", grammar.slot, kept + (grammar.slot in self._sent)))

    def fill(self, rows: list[Row]) -> np.ndarray:
        """The bitmask of `rows` [len(rows), words], filled now (waits)."""
        assert self._process is not None
        buffer = self._buffer(len(rows))
        self._process.fill([slot for _, slot in rows], buffer, 0).result()
        self._awaiting = rows
        return buffer.array[: len(rows)]

    def prefetch(self, rows: list[Row], capacity: int) -> None:
        """Ask for the bitmask of `rows`, filled after the tokens of the step in flight;
        `capacity`: the rows the step may end up with (its sampling requests)."""
        self._prefetch = _Prefetch(rows, self._buffer(capacity))
        if not self._awaiting:  # else it goes after those tokens (`send_step_tokens`)
            self._send_prefetch()

    def prefetched(self, rows_now: list[Row]) -> tuple[list[str], np.ndarray] | None:
        """The prefetched rows (a request that finished since keeps its row: its token is
        dropped) and, filled now, those of `rows_now` it lacks (a thinking that ended with
        the step before). (request ids, bitmask [rows, words]); None: no rows."""
        assert self._process is not None
        self._send_prefetch()
        prefetch, self._prefetch = self._prefetch, None
        rows = [] if prefetch is None else prefetch.rows
        have = {slot for _, slot in rows}
        extra = [row for row in rows_now if row[1] not in have]
        if not rows and not extra:
            return None
        buffer = prefetch.buffer if prefetch is not None else self._buffer(len(extra))
        if extra:
            self._process.fill([slot for _, slot in extra], buffer, len(rows)).result()
        if prefetch is not None and prefetch.done is not None:
            prefetch.done.result()
        rows = rows + extra
        self._awaiting = rows
        return [rid for rid, _ in rows], buffer.array[: len(rows)]

    @property
    def awaiting_tokens(self) -> bool:
        """A fill was handed out whose rows' sampled tokens are not yet sent."""
        return bool(self._awaiting)

    def send_step_tokens(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """Send the sampled tokens of the last fill's rows (from a step's ModelRunnerOutput),
        then the prefetch waiting for them."""
        rows, self._awaiting = self._awaiting, None
        if not rows or self._process is None:
            return
        token_of = dict(zip(request_ids, token_ids, strict=True))
        slots = [slot for _, slot in rows]
        tokens = [token_of.get(rid, -1) for rid, _ in rows]  # -1: not sampled, skipped
        self._process.send(("accept", slots, tokens))
        self._sent.update(slot for slot, token in zip(slots, tokens, strict=True) if token >= 0)
        self._send_prefetch()

    def accept(self, sampled: Sequence[tuple[str, RemoteGrammar, int]]) -> set[str]:
        """Apply a step's tokens (request id, grammar, token) past their thinking: send those
        not sent early; the ids of the requests whose grammars terminated (stop tokens)."""
        terminated: set[str] = set()
        late: list[tuple[int, int]] = []
        for request_id, grammar, token_id in sampled:
            if grammar.slot in self._sent:
                self._sent.discard(grammar.slot)
            else:
                late.append((grammar.slot, token_id))
            if token_id in self.stop_token_ids:  # the mask allowed it: the grammar may end
                terminated.add(request_id)
        if late:
            assert self._process is not None  # it made the grammars
            self._process.send(("accept", [s for s, _ in late], [t for _, t in late]))
        return terminated

    def shutdown(self) -> None:
        _release(self._started, self._buffers)

    def _send_prefetch(self) -> None:
        prefetch = self._prefetch
        if prefetch is not None and prefetch.done is None and self._process is not None:
            slots = [slot for _, slot in prefetch.rows]
            prefetch.done = self._process.fill(slots, prefetch.buffer, 0)

    def _buffer(self, rows: int) -> SharedBitmask:
        """The next of the two buffers, grown to `rows` (the old one released)."""
        assert self._process is not None
        self._turn ^= 1
        while len(self._buffers) <= self._turn:
            self._buffers.append(SharedBitmask(0, self._width, *self._pin))
        buffer = self._buffers[self._turn]
        if buffer.shape[0] < rows:
            grown = SharedBitmask(max(rows, 2 * buffer.shape[0]), self._width, *self._pin)
            self._process.send(("release", buffer.name))
            buffer.close()
            self._buffers[self._turn] = buffer = grown
        return buffer


def _release(started: list[GrammarProcess], buffers: list[SharedBitmask]) -> None:
    """Stop the process and release the buffers (`shutdown`, or the finalizer)."""
    for process in started:
        process.shutdown()
    started.clear()
    for buffer in buffers:
        buffer.close()
    buffers.clear()
