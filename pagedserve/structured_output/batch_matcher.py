"""A step's xgrammar calls for all its constrained requests at once: the bitmask fill (on
xgrammar's C++ threads, into `BitmaskBuffers`) and the accept of the sampled tokens (one
call).

Both release the GIL inside C++ only: their arguments and results are converted under it.
So the accept is one call on the calling thread: cut into chunks on Python threads it ran
slower on the H200 host (4.3 ms for 256 tokens against 1.8 ms in one call), and a grammar
thread doing both beside the engine thread gained nothing (BENCHMARKS.md, issue 17).
"""

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedserve import envs


def fill_threads() -> int:
    """The host threads of a step's bitmask fill (xgrammar's C++ threads): half the cores
    this process may run on (`os.sched_getaffinity`), less
    `PAGEDSERVE_CPU_NUM_OF_RESERVED_CPU`, at least 1.

    xgrammar's own "auto" is half of `std::thread::hardware_concurrency()`: every core of the
    host, also where a container, taskset or cgroup leaves this process only a few (64
    threads on a 128-core host for a 2-core slot). Half, as xgrammar (and vLLM's fill pool,
    cpu_count // 2) choose: the CUDA runtime's and the API server's threads keep the rest.
    On a CPU-only engine the fill and the accept run in the engine thread between forwards
    (no async scheduling there by default), so these threads and torch's intra-op pool
    (`worker.cpu_threads`, the same cores less the reserved ones) do not run at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, ((cores or 2) - envs.cpu_reserved()) // 2)


class BatchMatcher:
    """xgrammar's batched fill on `threads` host threads (`fill_threads()` when None) and
    batched accept. Mirrors the calls of xgrammar's `BatchGrammarMatcher` (0.2.x)."""

    def __init__(self, threads: int | None = None) -> None:
        import xgrammar as xgr

        self.threads = fill_threads() if threads is None else max(1, threads)
        self._xgr = xgr.BatchGrammarMatcher(max_threads=self.threads)
        self._accept = xgr.BatchGrammarMatcher.batch_accept_token

    def fill(
        self, matchers: list[Any], bitmask: np.ndarray, indices: list[int] | None = None
    ) -> None:
        """Fill bitmask row `indices[i]` (row i when None) with `matchers[i]`'s allowed next
        tokens. bitmask: int32 [rows, ceil(vocab / 32)], C order, on the host. Raises
        RuntimeError (xgrammar's) for a terminated matcher or a bitmask of the wrong shape."""
        self._xgr.batch_fill_next_token_bitmask(matchers, bitmask, indices)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Advance `matchers[i]` by `tokens[i]`; whether each was accepted (False: the token
        is not allowed, the matcher stays where it was). Each matcher at most once."""
        accepted: list[bool] = self._accept(matchers, tokens)
        return accepted


class BitmaskBuffers:
    """Where the engine-thread matchers fill a step's bitmask ([rows, words] int32, C order):
    with `allocate(shape)` (pinned host memory on a GPU: `use_bitmask_buffers`), two buffers
    used in turn whose rows are handed out as they are (`handed_out`); without it, one numpy
    buffer the caller copies from. Both grow to the rows asked for."""

    def __init__(
        self, words: int, allocate: Callable[[tuple[int, int]], np.ndarray] | None = None
    ) -> None:
        self.words = words
        self._allocate = allocate or (lambda shape: np.zeros(shape, np.int32))
        self.handed_out = allocate is not None
        self._buffers: list[np.ndarray] = []
        self._turn = 0

    def rows(self, num_rows: int) -> np.ndarray:
        """The first `num_rows` rows of the next buffer (of the same one without allocate)."""
        if self.handed_out:
            self._turn ^= 1
        while len(self._buffers) <= self._turn:
            self._buffers.append(self._allocate((0, self.words)))
        if len(self._buffers[self._turn]) < num_rows:
            grown = max(num_rows, 2 * len(self._buffers[self._turn]))
            self._buffers[self._turn] = self._allocate((grown, self.words))
        return self._buffers[self._turn][:num_rows]
