"""A step's grammar bitmask: which of its requests sample under a grammar, and their rows."""

from collections.abc import Sequence

from pagedserve.request import Request
from pagedserve.step import GrammarOutput, ScheduledRequest
from pagedserve.structured_output.manager import StructuredOutputManager


def constrained_requests(
    manager: StructuredOutputManager,
    requests: Sequence[Request],
    scheduled: Sequence[ScheduledRequest],
) -> list[Request]:
    """The requests of a step (`requests[i]` scheduled as `scheduled[i]`) that sample under
    a grammar, in batch order: the step's bitmask rows."""
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
    """The bitmask rows of the requests of a step (`requests[i]` scheduled as `scheduled[i]`)
    that sample under a grammar, in batch order; None when there are none."""
    if manager is None:
        return None
    constrained = constrained_requests(manager, requests, scheduled)
    if not constrained:
        return None
    return GrammarOutput([r.request_id for r in constrained], manager.grammar_bitmask(constrained))


def schedule_grammar(
    manager: StructuredOutputManager | None,
    defer: bool,
    requests: Sequence[Request],
    scheduled: Sequence[ScheduledRequest],
) -> tuple[GrammarOutput | None, bool]:
    """A just-scheduled step's bitmask rows (`grammar_output`), and whether they are deferred:
    with `defer` (the scheduler's `defer_grammar`) and a constrained request that samples, the
    rows are filled after the step before has applied its tokens (None here); the grammar
    process starts on them now."""
    deferred = defer and any(
        item.sample and request.use_structured_output
        for request, item in zip(requests, scheduled, strict=True)
    )
    if not deferred:
        return grammar_output(manager, requests, scheduled), False
    if manager is not None and manager.uses_process:
        # the grammar process fills these rows once the step in flight's tokens are in
        manager.prefetch_fill(
            constrained_requests(manager, requests, scheduled),
            sum(item.sample for item in scheduled),
        )
    return None, True


def deferred_grammar_output(
    manager: StructuredOutputManager | None,
    requests: Sequence[Request],
    scheduled: Sequence[ScheduledRequest],
) -> GrammarOutput | None:
    """`grammar_output` of a deferred step's still-live requests, from the grammar process's
    prefetched rows where it runs."""
    if manager is not None and manager.uses_process:
        rows = manager.prefetched_output(constrained_requests(manager, requests, scheduled))
        return None if rows is None else GrammarOutput(*rows)
    return grammar_output(manager, requests, scheduled)
