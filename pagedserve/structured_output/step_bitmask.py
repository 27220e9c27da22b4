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
