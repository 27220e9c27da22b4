"""The grammar compiles of the StructuredOutputManager: a thread pool off the step loop, an LRU
cache of compiled grammars keyed by constraint, and their hit and compile-time counters."""

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedserve.reasoning import ReasoningParser, get_reasoning_parser
from pagedserve.structured_output.backend_xgrammar import XgrammarBackend, constraint_key
from pagedserve.structured_output.remote_matchers import RemoteMatchers
from pagedserve.structured_outputs_params import StructuredOutputsParams

_CACHE_SIZE = 1024  # compiled grammars kept (LRU); a JSON schema's is tens of KB


@dataclass(frozen=True, slots=True)
class GrammarStats:
    """Cumulative compile-cache counters (a miss is a compile)."""

    num_cache_hits: int
    num_cache_misses: int
    compile_seconds: float  # summed over the compiles done

    @property
    def hit_rate(self) -> float:
        total = self.num_cache_hits + self.num_cache_misses
        return self.num_cache_hits / total if total else 0.0


class GrammarCompiler:
    """Compiles constraints in `max_workers` threads (the manager's arguments of the same
    names). The xgrammar backend and the reasoning parser are made in a compile thread, at the
    first constraint; with `remote` set (the grammar process) the compiles run there, and a
    compile's result is its key in the process."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: list[int],
        reasoning_parser: str | None,
        max_workers: int | None,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.reasoning_parser = reasoning_parser
        workers = max_workers or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the backend's creation, the counters
        self.backend: XgrammarBackend | None = None  # in process: made by the first compile
        self.reasoner: ReasoningParser | None = None
        self._cache: OrderedDict[str, Future[Any]] = OrderedDict()
        self._num_hits = 0
        self._num_misses = 0
        self._compile_seconds = 0.0
        self.remote: RemoteMatchers | None = None  # the manager's use_grammar_process

    def submit(self, params: StructuredOutputsParams) -> "Future[Any]":
        """The compile of `params`: from the cache, or started now."""
        key = constraint_key(params)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not _failed(future):
                self._cache.move_to_end(key)
                self._num_hits += 1
            else:
                future = self._executor.submit(self._compile, params, key)
                self._cache[key] = future
                self._num_misses += 1
                while len(self._cache) > _CACHE_SIZE:
                    _, evicted = self._cache.popitem(last=False)
                    if self.remote is not None:
                        self.remote.evict(evicted)
            if self.remote is not None:
                self.remote.waits_for(future)
        return future

    def _compile(self, params: StructuredOutputsParams, key: str) -> Any:
        """The compiled grammar (in the grammar process: its key there, once compiled)."""
        start = time.perf_counter()
        if self.remote is not None:
            compiled: Any = self.remote.compile(key, params)  # RuntimeError: xgrammar's
            if self.reasoning_parser is not None:
                with self._lock:
                    if self.reasoner is None:
                        self.reasoner = get_reasoning_parser(
                            self.reasoning_parser, self._load_tokenizer()
                        )
        else:
            compiled = self._get_backend().compile(params)
        elapsed = time.perf_counter() - start
        with self._lock:
            self._compile_seconds += elapsed
        return compiled

    def _get_backend(self) -> XgrammarBackend:
        with self._lock:
            if self.backend is None:
                tokenizer = self._load_tokenizer()
                self.backend = XgrammarBackend(tokenizer, self.vocab_size, self.stop_token_ids)
                if self.reasoning_parser is not None:
                    self.reasoner = get_reasoning_parser(self.reasoning_parser, tokenizer)
            return self.backend

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(self._num_hits, self._num_misses, self._compile_seconds)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _failed(future: "Future[Any]") -> bool:
    return future.done() and future.exception() is not None
