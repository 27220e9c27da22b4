"""A step's grammar bitmask: which of its requests sample under a grammar, and their rows,
filled now (sync scheduling) or in the manager's fill thread once the step before has applied
its tokens (async scheduling: `SchedulerOutput.grammar_deferred`)."""

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from pagedserve.request import Request
from pagedserve.step import GrammarOutput, ScheduledRequest
from pagedserve.structured_output.manager import StructuredOutputManager

_T = TypeVar("_T")
_U = TypeVar("_U")


def constrained_requests(
    manager: StructuredOutputManager,
    requests: Sequence[Request],
    scheduled: Sequence[ScheduledRequest],
) -> list[Request]:
    """The requests of a step (`requests[i]` scheduled as `scheduled[i]`) that sample under
    a grammar, in batch order."""
    return [
        request
        for request, item in zip(requests, scheduled, strict=True)
        if item.sample and manager.should_fill_bitmask(request)
    ]


def grammar_output(
    manager: StructuredOutputManager | None,
    requests: Sequence[Request],
    scheduled: Sequence[ScheduledRequest],
) -> GrammarOutput | None:
    """The step's bitmask, filled now; None when no request samples under a grammar."""
    if manager is None:
        return None
    constrained = constrained_requests(manager, requests, scheduled)
    if not constrained:
        return None
    return GrammarOutput([r.request_id for r in constrained], manager.grammar_bitmask(constrained))


def start_grammar_output(
    manager: StructuredOutputManager | None,
    requests: Sequence[Request],
    scheduled: Sequence[ScheduledRequest],
) -> "Future[GrammarOutput | None]":
    """`grammar_output` with its rows chosen now and filled in the manager's fill thread
    (the caller waits on the future)."""
    constrained = [] if manager is None else constrained_requests(manager, requests, scheduled)
    if manager is None or not constrained:
        done: Future[GrammarOutput | None] = Future()
        done.set_result(None)
        return done
    ids = [r.request_id for r in constrained]
    return _chain(manager.start_grammar_bitmask(constrained), lambda b: GrammarOutput(ids, b))


def _chain(future: "Future[_T]", then: Callable[[_T], _U]) -> "Future[_U]":
    """A future of `then(future's result)` (its exception, if it fails)."""
    out: Future[_U] = Future()

    def done(f: "Future[_T]") -> None:
        try:
            out.set_result(then(f.result()))
        except BaseException as e:  # handed to the waiter
            out.set_exception(e)

    future.add_done_callback(done)
    return out
