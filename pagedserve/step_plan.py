"""A step as the scheduler builds it: its requests under the token and encoder budgets, the
ScheduledRequests they become, and the Request objects of the steps still in flight."""

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.multimodal import fit_encoder_budget
from pagedserve.request import Request
from pagedserve.step import PLACEHOLDER_TOKEN_ID, NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class StepPlan:
    token_budget: int
    encoder_budget: int  # embedding rows of the images this step may encode
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    num_preempted: int = 0
    max_encoder_budget: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_encoder_budget = self.encoder_budget

    @property
    def requests(self) -> list[Request]:
        """The planned requests, in batch order."""
        return [request for request, _, _ in self.scheduled]

    def add(self, request: Request, num_new_tokens: int, new_block_ids: list[int]) -> None:
        self.scheduled.append((request, num_new_tokens, new_block_ids))
        self.token_budget -= num_new_tokens

    def remove(self, request: Request) -> None:
        """Unplan a request (preempted after it was planned): its tokens return to the budget."""
        for i, (planned, num_new_tokens, _) in enumerate(self.scheduled):
            if planned is request:
                del self.scheduled[i]
                self.token_budget += num_new_tokens
                return

    def fit_encoder_budget(
        self, request: Request, start: int, num_new_tokens: int, admitted: bool
    ) -> int:
        """`multimodal.fit_encoder_budget` for the request's chunk from prompt position
        `start`; spends the plan's encoder budget."""
        if not request.mm_features or num_new_tokens == 0:
            return num_new_tokens
        untouched = self.encoder_budget == self.max_encoder_budget
        num_new_tokens, cost = fit_encoder_budget(
            request.mm_features,
            start,
            num_new_tokens,
            self.encoder_budget,
            untouched,
            admitted,
        )
        self.encoder_budget -= cost
        return num_new_tokens

    def launch(self) -> list[ScheduledRequest]:
        """Advance each planned request's `num_computed_tokens` past its tokens (and its
        placeholders past the token it samples), and describe it to the workers."""
        scheduled_requests = []
        for request, num_new_tokens, new_block_ids in self.scheduled:
            start = request.num_computed_tokens
            request.num_computed_tokens += num_new_tokens
            token_ids = request.all_token_ids[start : start + num_new_tokens]
            if len(token_ids) < num_new_tokens:  # the token the step in flight samples
                token_ids.append(PLACEHOLDER_TOKEN_ID)
            sample = request.num_computed_tokens == (
                request.num_tokens + request.num_output_placeholders
            )
            if sample:
                request.num_output_placeholders += 1
            scheduled_requests.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=token_ids,
                    num_computed_tokens=start,
                    new_block_ids=new_block_ids,
                    sample=sample,
                )
            )
        return scheduled_requests


# Steps in flight are at most 2 (async scheduling) or pipeline_parallel_size (the batch
# queue); older entries belong to failed steps.
_MAX_LAUNCHED = 16


class LaunchedSteps:
    """Steps scheduled but not yet applied, each with the Request objects it is for: a request
    id may be reused by a new request while the step is in flight (after an abort or a stop
    string)."""

    def __init__(self) -> None:
        # id(SchedulerOutput) -> (it, its requests by id)
        self._steps: dict[int, tuple[SchedulerOutput, dict[str, Request]]] = {}

    def add(self, output: SchedulerOutput, requests: Iterable[Request]) -> None:
        self._steps[id(output)] = (output, {r.request_id: r for r in requests})
        while len(self._steps) > _MAX_LAUNCHED:  # outputs never applied (a failed step)
            del self._steps[next(iter(self._steps))]

    def get(self, output: SchedulerOutput) -> dict[str, Request] | None:
        """The requests of `output` by id; None when it is not in flight."""
        launched = self._steps.get(id(output))
        return launched[1] if launched is not None and launched[0] is output else None

    def pop(self, output: SchedulerOutput) -> dict[str, Request] | None:
        """`get`, and forget the step (its output is being applied)."""
        requests = self.get(output)
        self._steps.pop(id(output), None)
        return requests
