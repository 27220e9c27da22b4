"""Throw-away scheduler outputs the model runner runs at start-up: profiling and warm-up."""

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import NewRequestData, ScheduledRequest, SchedulerOutput


def profiling_step(num_reqs: int, seq_len: int, block_size: int) -> SchedulerOutput:
    """The largest step the engine can meet: `num_reqs` fresh prompts of `seq_len` tokens,
    in blocks 0, 1, ... (profiling runs before the KV cache is handed to the scheduler)."""
    blocks_per_req = -(-seq_len // block_size)
    new, scheduled = [], []
    for i in range(num_reqs):
        request_id = f"__profile_{i}"
        new.append(
            NewRequestData(request_id, seq_len, SamplingParams(temperature=1.0), [0] * seq_len)
        )
        block_ids = list(range(i * blocks_per_req, (i + 1) * blocks_per_req))
        scheduled.append(ScheduledRequest(request_id, [0] * seq_len, 0, block_ids, True))
    return SchedulerOutput(new, scheduled, set())


def warm_up_steps(long_len: int, block_size: int, blocks_per_request: int) -> list[SchedulerOutput]:
    """Three fake requests: a long prefill alone; then its decode beside a new prefill and a
    one-token request (mixed launch, split-KV decode); then decodes only; then cleanup."""
    params = SamplingParams(temperature=0.0)
    ids = ["__warm_up_0", "__warm_up_1", "__warm_up_2"]
    blocks = [list(range(i * blocks_per_request, (i + 1) * blocks_per_request)) for i in range(3)]
    short_len = min(long_len, 3 * block_size)
    return [
        SchedulerOutput(
            [NewRequestData(ids[0], long_len, params, [1] * long_len)],
            [ScheduledRequest(ids[0], [1] * long_len, 0, blocks[0], True)],
        ),
        SchedulerOutput(
            [NewRequestData(ids[1], short_len, params, [1] * short_len),
             NewRequestData(ids[2], 1, params, [1])],
            [ScheduledRequest(ids[0], [1], long_len, [], True),
             ScheduledRequest(ids[1], [1] * short_len, 0, blocks[1], True),
             ScheduledRequest(ids[2], [1], 0, blocks[2], True)],
        ),
        SchedulerOutput(
            [],
            [ScheduledRequest(ids[0], [1], long_len + 1, [], True),
             ScheduledRequest(ids[1], [1], short_len, [], True),
             ScheduledRequest(ids[2], [1], 1, [], True)],
        ),
        SchedulerOutput([], [], set(ids)),
    ]  # fmt: skip
