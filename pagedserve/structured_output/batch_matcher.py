"""A step's xgrammar calls for all its constrained requests at once: the bitmask fill and the
accept of the sampled tokens, each spread over host threads.

xgrammar's `BatchGrammarMatcher.batch_fill_next_token_bitmask` fills on its own C++ threads;
its `batch_accept_token` runs on the calling thread only, but (like the fill) releases the GIL
while it runs, so the accept is cut into chunks that Python threads run at once. Both run on
the engine's critical path of every constrained step (BENCHMARKS.md, issue 17: 256 accepts
took ~2.5 ms of a ~13 ms host step on one thread).
"""

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pagedserve import envs

# Fewest matchers a thread's chunk of the accept gets: below it a thread's hand-off (~20 us)
# costs more than the ~5-10 us a token it saves.
_MIN_ACCEPT_CHUNK = 16


def fill_threads() -> int:
    """The host threads of a step's grammar work (the fill's C++ threads, the accept's
    chunks): half the cores this process may run on (`os.sched_getaffinity`), less
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
    """xgrammar's batched fill and accept on `threads` host threads (`fill_threads()` when
    None). Mirrors the calls of xgrammar's `BatchGrammarMatcher` (0.2.x)."""

    def __init__(self, threads: int | None = None) -> None:
        import xgrammar as xgr

        self.threads = fill_threads() if threads is None else max(1, threads)
        self._xgr = xgr.BatchGrammarMatcher(max_threads=self.threads)
        self._accept_one = xgr.BatchGrammarMatcher.batch_accept_token
        self._pool: ThreadPoolExecutor | None = None  # the accept's other chunks; on first use

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
        chunks = min(self.threads, len(matchers) // _MIN_ACCEPT_CHUNK)
        if chunks <= 1:
            return self._accept_one(matchers, tokens)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="grammar-accept")
        bounds = [len(matchers) * i // chunks for i in range(chunks + 1)]
        futures = [
            self._pool.submit(self._accept_one, matchers[start:stop], tokens[start:stop])
            for start, stop in zip(bounds[1:-1], bounds[2:], strict=True)
        ]
        accepted = self._accept_one(matchers[: bounds[1]], tokens[: bounds[1]])
        for future in futures:
            accepted += future.result()
        return accepted

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
