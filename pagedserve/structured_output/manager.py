"""StructuredOutputManager: compiles grammars off the step loop, keeps each constrained
sequence's matcher, and fills the step's token bitmask (vLLM's `vllm/v1/structured_output`).

The scheduler owns one. Its life with a request:

    add_request      init_request: the compile is submitted to a thread pool (or found in the
                     cache, keyed by the constraint); the request waits, skipped by the
                     scheduler, until `is_ready` (which then makes its GrammarMatcher)
    schedule()       grammar_bitmask: one int32 row per constrained request that samples this
                     step, sent with the SchedulerOutput; the sampler bans what a row forbids
    update_from_output  accept_token: the matcher advances with the sampled token; when it
                     terminates the request finishes (stop)
    preemption       sync_after_preemption: the matcher's state matches the kept tokens
    finish           free_request

With a reasoning parser (`StructuredOutputsConfig.reasoning_parser`), the mask applies only
once `is_reasoning_end` holds: the thinking is free text, the answer is constrained. No torch
here: the bitmask is a numpy array, which xgrammar fills directly.

The compiles and their cache are grammar_compiler.py's. `use_grammar_process` moves the
compiles and the matchers into a process of their own (grammar_process.py,
remote_matchers.py); the engine's deferred path then sends each step's tokens early
(`send_step_tokens`) and asks for the next step's rows when they are scheduled
(`prefetch_fill`), so that the accept and the fill overlap the engine thread's own work.
"""

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.request import Request
from pagedserve.structured_output.backend_xgrammar import XgrammarGrammar
from pagedserve.structured_output.batch_matcher import BatchMatcher, BitmaskBuffers
from pagedserve.structured_output.grammar_compiler import GrammarCompiler, GrammarStats
from pagedserve.structured_output.remote_matchers import Pinning, RemoteGrammar, RemoteMatchers
from pagedserve.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StructuredOutputRequest:
    """A request's constraint and its state in the manager (vLLM's StructuredOutputRequest)."""

    params: StructuredOutputsParams
    compiled: "Future[Any]"  # the CompiledGrammar, from the cache or the thread pool
    grammar: XgrammarGrammar | None = None  # made when the compile is done
    failed: bool = False  # the compile raised (the scheduler aborts the request)
    reasoning_ended: bool = True  # False while the thinking runs: no mask, no advance
    num_output_tokens_before: int = 0  # output tokens not fed to the grammar (the thinking)


class StructuredOutputManager:
    """The engine's grammar side (see the module docstring).

    load_tokenizer: returns the model's Hugging Face tokenizer; called once, in the compile
    thread, when the first constraint arrives (so that an engine without constraints never
    builds xgrammar's vocabulary tables, and the step loop never waits for them).
    vocab_size: the width of the model's logits. stop_token_ids: the model's EOS ids.
    reasoning_parser: a registered reasoning parser's name, or None.
    disable_any_whitespace: no optional whitespace in any request's JSON (the engine's
    option; a request may also ask for it itself).
    """

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: list[int],
        reasoning_parser: str | None = None,
        max_workers: int | None = None,
        disable_any_whitespace: bool = False,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.disable_any_whitespace = disable_any_whitespace
        self._compiler = GrammarCompiler(
            load_tokenizer, vocab_size, stop_token_ids, reasoning_parser, max_workers
        )
        self._batch_matcher: BatchMatcher | None = None
        self._bitmasks = BitmaskBuffers((vocab_size + 31) // 32)
        self._remote: RemoteMatchers | None = None  # use_grammar_process

    def use_bitmask_buffers(self, allocate: Callable[[tuple[int, int]], np.ndarray]) -> None:
        """Fill each step's bitmask into one of two buffers made by `allocate(shape)` (int32,
        C order), in turn, and hand out a view of it rather than a copy: on a GPU they are
        pinned host memory, from which the device copies without a staging copy (4.9 MB a
        step for 256 rows of Qwen3's vocabulary). The caller must be done with a step's
        bitmask before the step after next fills (the engine's in-process deferred path is:
        a step's mask is on its way to the device before the next step's fill starts)."""
        self._bitmasks = BitmaskBuffers(self._bitmasks.words, allocate)

    def use_grammar_process(self, pin: Pinning | None) -> None:
        """Compile and match in a grammar process (module docstring); `pin` page-locks and
        unlocks its bitmask buffers for the device's copies (None on a CPU; with it, the
        process starts now and loads its tables in the background). The tokenizer loader must
        be picklable. Call before the first request."""
        self._remote = RemoteMatchers(
            self._load_tokenizer, self.vocab_size, self.stop_token_ids, pin
        )
        self._compiler.remote = self._remote
        if pin is not None:  # a GPU engine: started now, not at the first constraint
            self._remote.warm_up()

    @property
    def uses_process(self) -> bool:
        return self._remote is not None

    # -- compiling ------------------------------------------------------------------------

    def init_request(self, request: Request) -> None:
        """Start (or find in the cache) the compile of `request`'s constraint; attach its
        StructuredOutputRequest. The request is not schedulable until `is_ready`."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        if self.disable_any_whitespace and not params.disable_any_whitespace:
            params = dataclasses.replace(params, disable_any_whitespace=True)
        request.structured_output = StructuredOutputRequest(params, self._compiler.submit(params))

    def _matched(self, state: StructuredOutputRequest) -> None:
        """The request no longer needs its compile in the grammar process (its matcher is
        made, its compile failed, or it finished first)."""
        if self._remote is not None:
            self._remote.matched(state.compiled)

    def is_ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled (or failed to: see `failed`); makes its
        matcher the first time. A request without a constraint is always ready."""
        state = request.structured_output
        if state is None or state.grammar is not None or state.failed:
            return True
        if not state.compiled.done():
            return False
        try:
            compiled = state.compiled.result()
        except Exception:
            logger.exception("compiling the grammar of request %s failed", request.request_id)
            state.failed = True
            self._matched(state)
            return True
        if self._remote is not None:
            state.grammar = self._remote.add(compiled)
            self._matched(state)
        else:
            assert self._compiler.backend is not None
            state.grammar = self._compiler.backend.new_matcher(compiled)
        if (reasoner := self._compiler.reasoner) is not None:
            # The chat template may close the thinking in the prompt (Qwen3 with
            # enable_thinking=False), as vLLM checks the prompt first.
            state.reasoning_ended = reasoner.is_reasoning_end(request.prompt_token_ids)
            if not state.reasoning_ended and request.num_output_tokens:
                state.reasoning_ended = reasoner.is_reasoning_end(request.output_token_ids)
        state.num_output_tokens_before = request.num_output_tokens
        return True

    def stats(self) -> GrammarStats:
        return self._compiler.stats()

    # -- stepping ---------------------------------------------------------------------------

    @staticmethod
    def should_fill_bitmask(request: Request) -> bool:
        """The request's next token is constrained: it has a grammar and its thinking (if any)
        is over."""
        state = request.structured_output
        return state is not None and state.grammar is not None and state.reasoning_ended

    def grammar_bitmask(self, requests: list[Request]) -> np.ndarray:
        """The step's bitmask: row i (int32 words, bit t of word t // 32 = token t allowed)
        for requests[i], each of which `should_fill_bitmask`. [len(requests), ceil(V / 32)].
        One xgrammar call fills every row (`BatchMatcher.fill`, on its C++ threads); the
        row of a terminated grammar allows every token."""
        num_rows = len(requests)
        if self._remote is not None:
            return self._remote.fill(_rows(requests))
        bitmask = self._bitmasks.rows(num_rows)
        grammars = []
        for request in requests:
            state = request.structured_output
            assert state is not None and state.grammar is not None
            grammars.append(state.grammar)
        live = [row for row, grammar in enumerate(grammars) if not grammar.terminated]
        if len(live) == num_rows:  # the usual step: one xgrammar call, rows 0..n-1
            self._batch().fill([g.matcher for g in grammars], bitmask)
        else:
            # A terminated grammar has no next-token mask (xgrammar raises): its row allows
            # every token, as vLLM leaves it. Its request finishes with the step that
            # terminated it, so only a step launched before that can reach here.
            bitmask[[row for row, g in enumerate(grammars) if g.terminated]] = -1
            if live:
                self._batch().fill([grammars[row].matcher for row in live], bitmask, live)
        if self._bitmasks.handed_out:
            return bitmask  # see use_bitmask_buffers
        return bitmask.copy()  # the buffer is reused next step; the step keeps its own

    def accept_tokens(self, sampled: Sequence[tuple[Request, int, Any]]) -> set[str]:
        """`accept_token` for a step's sampled tokens (request, token id, anything), each
        already appended to its request; the ids of the requests whose grammars terminated.
        The grammars past their reasoning advance together (`BatchMatcher.accept`): this runs
        between a step's result and the next step's bitmask, on the critical path of every
        constrained step."""
        batch = self._past_reasoning(sampled)
        if self._remote is not None:
            return self._remote.accept(
                [(r.request_id, r.structured_output.grammar, t) for r, t in batch]
            )
        terminated: set[str] = set()
        if not batch:
            return terminated
        grammars = [r.structured_output.grammar for r, _ in batch]
        tokens = [r.output_token_ids[-1] for r, _ in batch]
        accepted = self._batch().accept([g.matcher for g in grammars], tokens)
        assert self._compiler.backend is not None  # it made the grammars
        stop_ids = self._compiler.backend.stop_token_ids
        for (request, _), grammar, token_id, ok in zip(
            batch, grammars, tokens, accepted, strict=True
        ):
            if ok:
                grammar.num_processed_tokens += 1
                # Only a stop token terminates a matcher: skip 256 C++ calls a step.
                if token_id in stop_ids and grammar.is_terminated():
                    grammar.terminated = True
                    terminated.add(request.request_id)
            else:
                self._escaped(request, token_id)
        return terminated

    def _past_reasoning(
        self, sampled: Sequence[tuple[Request, int, Any]]
    ) -> list[tuple[Request, int]]:
        """The (request, token) pairs of `sampled` whose grammars are past their thinking, in
        order; the other constrained requests' tokens are checked here for its end."""
        batch = []
        for request, token_id, _ in sampled:
            state = request.structured_output
            if state is None or state.grammar is None:
                continue
            if state.reasoning_ended:
                batch.append((request, token_id))
            else:
                self.accept_token(request, token_id)  # checks for the end: never terminates
        return batch

    def accept_token(self, request: Request, token_id: int) -> bool:
        """Advance the request's grammar by its newly appended output token; whether the
        grammar has terminated (the request then finishes with "stop"). While the thinking
        runs, the token is checked for its end instead (and not fed to the grammar)."""
        state = request.structured_output
        if state is None or state.grammar is None:
            return False
        if not state.reasoning_ended:
            assert self._compiler.reasoner is not None
            state.reasoning_ended = self._compiler.reasoner.is_reasoning_end(
                request.output_token_ids
            )
            state.num_output_tokens_before = request.num_output_tokens
            return False
        if not state.grammar.accept_tokens([token_id]):
            self._escaped(request, token_id)
            return False
        return bool(state.grammar.is_terminated())

    @staticmethod
    def _escaped(request: Request, token_id: int) -> None:
        """A sampled token escaped the mask (it should not): the grammar stays where it was,
        and the request goes on unconstrained by this token."""
        logger.warning(
            "request %s: token %d is not allowed by its grammar", request.request_id, token_id
        )
        assert request.structured_output is not None
        request.structured_output.num_output_tokens_before += 1

    def _batch(self) -> BatchMatcher:
        """The batched fill and accept (`fill_threads()` host threads; made on first use)."""
        if self._batch_matcher is None:
            self._batch_matcher = BatchMatcher()
        return self._batch_matcher

    def sync_after_preemption(self, request: Request) -> None:
        """Make the grammar's state match the tokens the request keeps: roll back the tokens
        it accepted that are no longer in `output_token_ids` (vLLM rolls back with
        `grammar.rollback`). pagedserve's recompute keeps every sampled token, so this undoes
        something only where an accepted token was dropped."""
        state = request.structured_output
        if state is None or state.grammar is None or not state.reasoning_ended:
            return
        kept = request.num_output_tokens - state.num_output_tokens_before
        if isinstance(state.grammar, RemoteGrammar):
            assert self._remote is not None
            self._remote.rollback(state.grammar, kept)
            return
        excess = state.grammar.num_processed_tokens - kept
        if excess > 0:
            state.grammar.rollback(excess)

    def free_request(self, request: Request) -> None:
        state = request.structured_output
        if state is not None and state.grammar is None and not state.failed:
            self._matched(state)  # it finished waiting for its compile
        if state is not None and isinstance(state.grammar, RemoteGrammar):
            assert self._remote is not None
            self._remote.free(state.grammar)
        request.structured_output = None

    def shutdown(self) -> None:
        self._compiler.shutdown()
        if self._remote is not None:
            self._remote.shutdown()

    # The grammar process's step (use_grammar_process; remote_matchers.py says how it goes).

    def prefetch_fill(self, requests: list[Request], capacity: int) -> None:
        """Ask the grammar process for the bitmask rows of `requests` (each
        `should_fill_bitmask`) when their deferred step is scheduled; `capacity`: the rows
        the step may end up with (its sampling requests)."""
        if self._remote is not None:
            self._remote.prefetch(_rows(requests), capacity)

    def prefetched_output(self, requests: list[Request]) -> tuple[list[str], np.ndarray] | None:
        """The deferred step's rows when it samples: the prefetched ones, and those of
        `requests` (each `should_fill_bitmask` now) they lack. (request ids, bitmask
        [rows, words]); None: no rows."""
        assert self._remote is not None
        return self._remote.prefetched(_rows(requests))

    @property
    def awaiting_tokens(self) -> bool:
        """Sampled tokens of a handed-out fill are to be sent (`send_step_tokens`)."""
        return self._remote is not None and self._remote.awaiting_tokens

    def send_step_tokens(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """Send the grammar process a step's sampled tokens (its ModelRunnerOutput's ids and
        tokens) before the scheduler applies them; `accept_tokens` then sends them not again."""
        if self._remote is not None:
            self._remote.send_step_tokens(request_ids, token_ids)


def _rows(requests: list[Request]) -> list[tuple[str, int]]:
    """(request id, grammar slot) of requests with RemoteGrammars."""
    return [(r.request_id, r.structured_output.grammar.slot) for r in requests]
