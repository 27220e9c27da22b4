"""The scheduler's encoder budget under random operations: every image the workers must
encode in a step (one a step feeds a token of for the first time since its request was
admitted, or admitted again after a preemption or a swap) is charged to that step, whose
images total at most the budget unless the step encodes a single image (one larger than the
budget runs alone); and every request ends."""

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.multimodal import MultiModalFeature
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.step import SchedulerOutput
from tests.test_scheduler import FakeModel, make_scheduler

BLOCK_SIZE = 4


def random_request(rng: random.Random, request_id: str, budget: int, priority: int) -> Request:
    """A prompt of 4-29 tokens holding runs of image tokens of 1 to 2 * budget rows (three
    distinct images, so that prefix hits can end inside one)."""
    num_prompt = rng.randrange(4, 30)
    features = []
    position = rng.randrange(0, 3)
    while position < num_prompt - 1 and rng.random() < 0.7:
        length = rng.randrange(1, min(num_prompt - position, 2 * budget + 1) + 1)
        if position + length > num_prompt:
            break
        k = rng.randrange(3)
        pixels = np.full(3, k, np.float32)
        features.append(MultiModalFeature(pixels, position, length, f"image{k}-{length}"))
        position += length + rng.randrange(0, 4)
    params = SamplingParams(max_tokens=rng.randrange(1, 6), eos_token_ids=(0,))
    prompt = [rng.randrange(100) for _ in range(num_prompt)]
    return Request(request_id, prompt, params, mm_features=features, priority=priority)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    budget=st.integers(2, 24),
    num_blocks=st.integers(8, 40),
    pipelined=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    num_swap_blocks=st.sampled_from([0, 0, 4, 64]),
    caching=st.booleans(),
    offload=st.booleans(),
)
def test_every_image_a_step_encodes_is_charged_to_it(
    seed: int,
    budget: int,
    num_blocks: int,
    pipelined: bool,
    policy: str,
    num_swap_blocks: int,
    caching: bool,
    offload: bool,
) -> None:
    rng = random.Random(seed)
    max_model_len = num_blocks * BLOCK_SIZE
    scheduler = make_scheduler(
        num_blocks,
        BLOCK_SIZE,
        4,
        budget,
        max_model_len,
        caching,
        None,
        policy,
        num_swap_blocks,
        10 if offload and caching else 0,
    )
    model = FakeModel(rng, scheduler)
    encoded: dict[str, set[int]] = {}  # the workers' encoder cache: request -> its images
    requests: dict[str, Request] = {}
    in_flight: list[tuple[SchedulerOutput, object]] = []

    def check(out: SchedulerOutput) -> None:
        for new in out.new_requests:  # (again): the workers start its state anew
            encoded[new.request_id] = set()
        rows = []
        for scheduled in out.scheduled_requests:
            start = scheduled.num_computed_tokens
            end = start + scheduled.num_new_tokens
            for k, feature in enumerate(requests[scheduled.request_id].mm_features):
                if feature.overlaps(start, end) and k not in encoded[scheduled.request_id]:
                    rows.append(feature.length)
                    encoded[scheduled.request_id].add(k)
        assert sum(rows) <= budget or len(rows) == 1, (rows, budget)

    def step() -> None:
        out = scheduler.schedule()
        check(out)
        if not pipelined:
            scheduler.update_from_output(out, model.run(out))
            return
        launched = None if out.is_empty else model.run(out)
        while in_flight:
            scheduler.update_from_output(*in_flight.pop())  # type: ignore[arg-type]
        if launched is not None:
            in_flight.append((out, launched))

    for op in range(40):
        choice = rng.random()
        if choice < 0.3:
            priority = rng.randrange(3) if policy == "priority" else 0
            request = random_request(rng, f"r{op}", budget, priority)
            if request.num_prompt_tokens + request.max_tokens <= max_model_len:
                scheduler.add_request(request)
                requests[request.request_id] = request
        elif choice < 0.38 and requests:
            scheduler.abort_requests([rng.choice(list(requests))])
        else:
            step()
        scheduler.kv_cache.check_invariants()
    for _ in range(3000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        step()
    assert not scheduler.has_unfinished_requests() and not in_flight
