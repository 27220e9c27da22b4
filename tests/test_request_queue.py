"""Scheduling policies: the waiting queues' order, and whom the scheduler runs and preempts."""

import random

import pytest

from pagedserve import step_plan
from pagedserve.config import SchedulerConfig
from pagedserve.request import Request, RequestStatus
from pagedserve.request_queue import PriorityRequestQueue, RequestQueue, create_request_queue
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import ModelRunnerOutput, SchedulerOutput

from .test_scheduler import make_scheduler, run_step


def make_request(
    request_id: str, priority: int, arrival_time: float, num_prompt: int = 4
) -> Request:
    """Prompts of different ids share no prefix block (their first letters differ)."""
    params = SamplingParams(max_tokens=2, eos_token_ids=(2,))
    prompt = [ord(request_id[0]) + i for i in range(num_prompt)]
    return Request(request_id, prompt, params, arrival_time, priority=priority)


def drain(queue: RequestQueue) -> list[str]:
    return [queue.pop_request().request_id for _ in range(len(queue))]


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    queue = create_request_queue("priority")
    assert isinstance(queue, PriorityRequestQueue)
    for request_id, priority, arrival in [
        ("late-urgent", 0, 3.0),
        ("first-lax", 5, 1.0),
        ("early-urgent", 0, 2.0),
        ("negative", -1, 4.0),
        ("same-time", 0, 2.0),  # a tie on both: insertion order
    ]:
        queue.add_request(make_request(request_id, priority, arrival))
    assert queue.peek_request().request_id == "negative"
    assert drain(queue) == ["negative", "early-urgent", "same-time", "late-urgent", "first-lax"]
    with pytest.raises(IndexError):
        queue.peek_request()


def test_priority_queue_remove_and_prepend() -> None:
    queue = create_request_queue("priority")
    a, b, c = (make_request(r, p, t) for r, p, t in [("a", 1, 1.0), ("b", 2, 2.0), ("c", 0, 3.0)])
    for request in (a, b, c):
        queue.add_request(request)
    queue.remove_request(a)
    with pytest.raises(ValueError, match="'a'"):
        queue.remove_request(a)
    queue.prepend_request(a)  # a preempted request returns to its place, not the front
    assert queue.pop_request() is c
    queue.prepend_requests([c])
    assert sorted(r.request_id for r in queue) == ["a", "b", "c"]
    assert drain(queue) == ["c", "a", "b"]


def test_fcfs_queue_prepends_to_the_front() -> None:
    queue = create_request_queue("fcfs")
    a, b, c = (make_request(r, 0, t) for r, t in [("a", 1.0), ("b", 2.0), ("c", 3.0)])
    queue.add_request(a)
    queue.add_request(b)
    queue.prepend_request(c)
    queue.prepend_requests([queue.pop_request(), queue.pop_request()])  # c, a back in order
    assert drain(queue) == ["c", "a", "b"]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(max_num_batched_tokens=64, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy"):
        create_request_queue("lifo")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("priority", ["b", "d", "c", "a"]), ("fcfs", ["a", "b", "c", "d"])],
)
def test_one_request_at_a_time_runs_in_priority_order(policy: str, expected: list[str]) -> None:
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    for request_id, priority, arrival in [("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0)]:
        scheduler.add_request(make_request(request_id, priority, arrival))
    order = [run_step(scheduler).new_requests[0].request_id]
    scheduler.add_request(make_request("d", 0, 4.0))  # arrives while b runs; beats c and a
    for _ in range(50):
        if not scheduler.has_unfinished_requests():
            break
        out = run_step(scheduler)
        assert len(out.scheduled_requests) <= 1
        order += [new.request_id for new in out.new_requests]
    assert order == expected


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_blocks_run_out_preempts_the_worst_priority(policy: str) -> None:
    """4 blocks of 4 slots. "lax" (priority 5) runs first with a 5-token prompt (2 blocks);
    "urgent" (priority 0) joins with 8 tokens (2 blocks). The step after, urgent's 9th token
    needs a third block: priority preempts lax, which was already planned for the step (its
    token goes back to the budget); fcfs preempts the newest, urgent itself."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, scheduling_policy=policy)
    lax = make_request("lax", 5, 1.0, num_prompt=5)
    lax.max_tokens = 6
    urgent = make_request("urgent", 0, 2.0, num_prompt=8)
    urgent.max_tokens = 6
    scheduler.add_request(lax)
    run_step(scheduler)
    scheduler.add_request(urgent)
    run_step(scheduler)
    assert scheduler.kv_cache.num_free_blocks == 0
    out = run_step(scheduler)
    victim, survivor = (lax, urgent) if policy == "priority" else (urgent, lax)
    assert [r.request_id for r in out.scheduled_requests] == [survivor.request_id]
    assert out.total_num_scheduled_tokens == 1
    assert victim.status == RequestStatus.PREEMPTED and victim in scheduler.waiting
    assert (victim.num_preemptions, survivor.num_preemptions) == (1, 0)
    assert scheduler.running == [survivor] and scheduler.num_preemptions_total == 1
    scheduler.kv_cache.check_invariants()
    for _ in range(50):
        if not scheduler.has_unfinished_requests():
            break
        run_step(scheduler)
        scheduler.kv_cache.check_invariants()
    assert lax.output_token_ids == [7] * 6 and urgent.output_token_ids == [7] * 6
    assert scheduler.kv_cache.num_free_blocks == 4


@pytest.mark.parametrize("pipelined", [False, True])
def test_random_priority_preemptions_keep_invariants(
    pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random arrivals with random priorities on a small cache: preemption often takes a
    request planned earlier in the same step (counted: the path must be exercised). Block
    accounting holds after every step, and every request still gets all its tokens.
    `pipelined` schedules step N+1 before applying step N's tokens (async scheduling)."""
    num_unplanned = 0
    remove = step_plan.StepPlan.remove

    def counting_remove(plan: step_plan.StepPlan, request: Request) -> None:
        nonlocal num_unplanned
        num_unplanned += any(planned is request for planned, _, _ in plan.scheduled)
        remove(plan, request)

    monkeypatch.setattr(step_plan.StepPlan, "remove", counting_remove)
    for seed in range(40):
        rng = random.Random(seed)
        scheduler = make_scheduler(
            num_blocks=10, block_size=2, max_num_seqs=4, scheduling_policy="priority"
        )
        requests = []
        in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
        for step in range(400):
            if step < 40 and rng.random() < 0.5:
                request = make_request(
                    f"{chr(97 + step % 26)}{step}",
                    rng.randrange(4),
                    float(step),
                    rng.randrange(1, 6),
                )
                request.max_tokens = rng.randrange(1, 9)
                scheduler.add_request(request)
                requests.append(request)
            out = scheduler.schedule()
            sampled = [r.request_id for r in out.scheduled_requests if r.sample]
            runner = ModelRunnerOutput(sampled, [7] * len(sampled), [None] * len(sampled))
            while in_flight:
                scheduler.update_from_output(*in_flight.pop())
            if pipelined:
                in_flight.append((out, runner))
            else:
                scheduler.update_from_output(out, runner)
            scheduler.kv_cache.check_invariants()
            if step >= 40 and not scheduler.has_unfinished_requests() and not in_flight:
                break
        assert not scheduler.has_unfinished_requests()
        assert scheduler.kv_cache.num_free_blocks == 10
        for request in requests:
            assert request.output_token_ids == [7] * request.max_tokens, request.request_id
    assert num_unplanned > 0
