"""A step's xgrammar calls for all its constrained requests at once: the bitmask fill (on
xgrammar's C++ threads) and the accept of the sampled tokens (one call).

Both release the GIL inside C++ only: their arguments and results are converted under it.
So the accept is one call on the calling thread: cut into chunks on Python threads it ran
slower on the H200 host (4.3 ms for 256 tokens against 1.8 ms in one call), and a grammar
thread doing both beside the engine thread gained nothing (BENCHMARKS.md, issue 17).
"""

import os
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
