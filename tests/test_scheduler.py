"""Scheduler: budgets, chunked prefill, preemption, stop rules, and random-operation invariants."""

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import SchedulerConfig
from pagedserve.kv_cache.manager import KVCacheManager, max_blocks_held
from pagedserve.multimodal import MultiModalFeature
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.step import PLACEHOLDER_TOKEN_ID, ModelRunnerOutput, SchedulerOutput


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    caching: bool = True,
    sliding_window: int | None = None,
    scheduling_policy: str = "fcfs",
    num_swap_blocks: int = 0,
    num_offload_blocks: int = 0,
) -> Scheduler:
    """With `num_swap_blocks`, preemption swaps (preemption_mode "swap")."""
    config = SchedulerConfig(
        max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=True,
        scheduling_policy=scheduling_policy,
        preemption_mode="swap" if num_swap_blocks else "recompute",
    )
    kv_cache = KVCacheManager(
        num_blocks, block_size, caching, sliding_window, num_swap_blocks, num_offload_blocks
    )
    return Scheduler(config, kv_cache, max_model_len)


def make_request(
    request_id: str,
    num_prompt: int,
    max_tokens: int = 4,
    first_token: int | None = None,
    **kw: object,
) -> Request:
    """Prompt tokens differ between request ids unless `first_token` makes them equal."""
    params = SamplingParams(max_tokens=max_tokens, eos_token_ids=(2,), **kw)  # type: ignore[arg-type]
    start = first_token if first_token is not None else 10 + sum(map(ord, request_id)) % 50
    return Request(request_id, [start + i for i in range(num_prompt)], params)


def run_step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    out = scheduler.schedule()
    sampled = [r.request_id for r in out.scheduled_requests if r.sample]
    runner = ModelRunnerOutput(sampled, [token] * len(sampled), [None] * len(sampled))
    scheduler.update_from_output(out, runner)
    return out


def test_prefill_and_decode_share_a_step() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 5))
    first = run_step(scheduler)
    assert [(r.request_id, r.num_new_tokens) for r in first.scheduled_requests] == [("a", 5)]
    scheduler.add_request(make_request("b", 6))
    second = run_step(scheduler)
    assert [(r.request_id, r.num_new_tokens) for r in second.scheduled_requests] == [
        ("a", 1),
        ("b", 6),
    ]
    assert second.scheduled_requests[0].token_ids == [7]  # a's sampled token fed back
    assert second.num_scheduled_tokens == {"a": 1, "b": 6}  # per request, as in vLLM
    assert second.total_num_scheduled_tokens == 7


def test_long_prompt_is_chunked_and_decodes_go_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("short", 3, max_tokens=10))
    run_step(scheduler)
    scheduler.add_request(make_request("long", 20))
    chunks = []
    for _ in range(3):
        out = run_step(scheduler)
        steps = {r.request_id: (r.num_new_tokens, r.sample) for r in out.scheduled_requests}
        assert steps["short"] == (1, True)  # the decode is never starved
        chunks.append(steps["long"])
    assert chunks == [(7, False), (7, False), (6, True)]


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(str(i), 4))
    out = run_step(scheduler)
    assert [r.request_id for r in out.scheduled_requests] == ["0", "1"]
    assert scheduler.num_waiting == 1


def test_preemption_recomputes_newest_and_loses_nothing() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_step(scheduler)  # both prefilled: 2 blocks each, the cache is full
    outputs_seen = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
        outputs_seen += 1
        scheduler.kv_cache.check_invariants()
        assert outputs_seen < 100
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert scheduler.num_preemptions_total >= 1
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert scheduler.kv_cache.num_free_blocks == 4


def test_stop_rules() -> None:
    scheduler = make_scheduler()
    eos = make_request("eos", 3, max_tokens=10)
    stop_id = make_request("stop_id", 3, max_tokens=10, stop_token_ids=[7])
    min_tokens = make_request("min", 3, max_tokens=10, min_tokens=2)
    ignore = make_request("ignore", 3, max_tokens=3, ignore_eos=True)
    for request in (eos, stop_id, min_tokens, ignore):
        scheduler.add_request(request)
    run_step(scheduler, token=2)  # EOS for everyone
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop_id.status == RequestStatus.FINISHED_STOPPED
    assert min_tokens.status == RequestStatus.RUNNING  # EOS before min_tokens does not stop
    assert ignore.status == RequestStatus.RUNNING
    run_step(scheduler, token=7)
    run_step(scheduler, token=2)
    assert min_tokens.status == RequestStatus.FINISHED_STOPPED
    assert ignore.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert ignore.output_token_ids == [2, 7, 2]


def test_stop_token_id_sets_stop_reason() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10, stop_token_ids=[7])
    scheduler.add_request(request)
    run_step(scheduler, token=7)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == 7


def test_abort_frees_blocks_and_tells_workers() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9))
    scheduler.add_request(make_request("b", 9))
    run_step(scheduler)
    scheduler.abort_requests(["a", "missing"])
    out = scheduler.schedule()
    assert out.finished_request_ids == {"a"}
    assert [r.request_id for r in out.scheduled_requests] == ["b"]
    scheduler.abort_requests(["b"])
    scheduler.kv_cache.check_invariants()
    assert scheduler.kv_cache.usage == 0.0 and not scheduler.has_unfinished_requests()


def test_prefix_hit_in_the_same_step() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 9, first_token=10))
    scheduler.add_request(make_request("b", 9, first_token=10))  # same tokens
    out = run_step(scheduler)
    steps = {r.request_id: r for r in out.scheduled_requests}
    assert steps["a"].num_new_tokens == 9
    assert steps["b"].num_computed_tokens == 8 and steps["b"].num_new_tokens == 1
    assert steps["b"].new_block_ids[:2] == steps["a"].new_block_ids[:2]


class FakeModel:
    """Samples random tokens, and records which token each request was fed at each position
    (a placeholder resolved to what the previous step sampled for it, as the worker does).

    It also plays the KV cache through the block tables the workers keep (new tables for new
    requests, `new_block_ids` appended; freed entries are never updated): each step writes,
    at each new token's slot, the token prefix it stands for (what its K/V depend on), then
    checks that every key each new token attends to (the `sliding_window` before it, or all)
    holds that request's own prefix: a block freed, reused or hit wrongly shows up here.
    Block copies (swap space, the CPU tier) move slots between the device and `cpu_slots`
    first, swap-outs before swap-ins, as the worker does: a copy of the wrong block, or in
    the wrong order, shows up here too."""

    def __init__(
        self,
        rng: random.Random,
        scheduler: Scheduler | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.rng = rng
        self.last_sampled: dict[str, int] = {}
        self.fed: dict[str, dict[int, int]] = {}
        self.scheduler = scheduler
        self.sliding_window = sliding_window
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[int, tuple[int, ...]] = {}
        self.cpu_slots: dict[int, tuple[int, ...]] = {}

    def run(self, out: SchedulerOutput, low: int = 0) -> ModelRunnerOutput:
        for r in out.scheduled_requests:
            fed = self.fed.setdefault(r.request_id, {})
            for i, token in enumerate(r.token_ids):
                if token == PLACEHOLDER_TOKEN_ID:
                    assert i == r.num_new_tokens - 1, "only the newest token can be in flight"
                    token = self.last_sampled[r.request_id]
                fed[r.num_computed_tokens + i] = token
        if self.scheduler is not None:
            self._play_kv_cache(out)
        sampled = [r.request_id for r in out.scheduled_requests if r.sample]
        tokens = [self.rng.randrange(low, 100) for _ in sampled]
        self.last_sampled = dict(zip(sampled, tokens, strict=True))
        return ModelRunnerOutput(sampled, tokens, [None] * len(sampled))

    def _play_kv_cache(self, out: SchedulerOutput) -> None:
        assert self.scheduler is not None
        block_size = self.scheduler.kv_cache.block_size
        for request_id in out.finished_request_ids:
            self.tables.pop(request_id, None)
        for new in out.new_requests:
            self.tables[new.request_id] = []
        for copies, src_slots, dst_slots in (
            (out.blocks_to_swap_out, self.slots, self.cpu_slots),
            (out.blocks_to_swap_in, self.cpu_slots, self.slots),
        ):
            assert len({dst for _, dst in copies}) == len(copies), "a block written twice"
            for src, dst in copies:
                for offset in range(block_size):
                    value = src_slots.get(src * block_size + offset)
                    dst_slots.pop(dst * block_size + offset, None)
                    if value is not None:
                        dst_slots[dst * block_size + offset] = value
        prefixes = {}
        for r in out.scheduled_requests:
            self.tables[r.request_id].extend(r.new_block_ids)
            tokens = list(self.scheduler.requests[r.request_id].all_token_ids)
            tokens += [self.fed[r.request_id][len(tokens)]] if r.token_ids[-1] < 0 else []
            prefixes[r.request_id] = tokens
            for position in range(r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens):
                self.slots[self._slot(r.request_id, position, block_size)] = tuple(
                    tokens[: position + 1]
                )
        for r in out.scheduled_requests:  # every write of the step comes before any read
            tokens = prefixes[r.request_id]
            for query in range(r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens):
                first = 0 if self.sliding_window is None else query - self.sliding_window + 1
                for key in range(max(first, 0), query + 1):
                    slot = self._slot(r.request_id, key, block_size)
                    assert self.slots.get(slot) == tuple(tokens[: key + 1]), (r.request_id, key)

    def _slot(self, request_id: str, position: int, block_size: int) -> int:
        return self.tables[request_id][position // block_size] * block_size + position % block_size


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
    pipelined=st.booleans(),
    sliding_window=st.sampled_from([None, None, 1, 3, 8]),
    policy=st.sampled_from(["fcfs", "priority"]),
    num_swap_blocks=st.sampled_from([0, 0, 2, 8, 64]),
    offload=st.booleans(),
)
def test_random_operations_keep_invariants(
    seed: int,
    num_blocks: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
    caching: bool,
    pipelined: bool,
    sliding_window: int | None,
    policy: str,
    num_swap_blocks: int,
    offload: bool,
) -> None:
    """Random add / step / abort / reset_prefix_cache sequences: invariants hold after every
    operation, every request ends, and at the end every block is free. `pipelined` runs the
    steps as async scheduling does (schedule step N+1 before applying step N's tokens, as
    EngineCore.step);
    every request must still have been fed exactly its own tokens at every position, and
    every key a new token attends to must hold its request's K/V (FakeModel's KV play). With
    a `sliding_window`, blocks out of the window are freed as requests advance: a request
    then never holds more than `max_blocks_held` blocks, and generations run longer. With
    the "priority" `policy` requests get random priorities: preemption then takes any running
    request, also one already planned in the step. With `num_swap_blocks` preemption swaps
    (recomputing when swap space is full); with `offload` evicted cached blocks go to a CPU
    tier of the prefix cache (10 blocks): no CPU block leaks or has two owners either."""
    rng = random.Random(seed)
    max_model_len = num_blocks * block_size
    num_offload_blocks = 10 if offload and caching and sliding_window is None else 0
    scheduler = make_scheduler(
        num_blocks,
        block_size,
        max_num_seqs,
        budget,
        max_model_len,
        caching,
        sliding_window,
        policy,
        num_swap_blocks,
        num_offload_blocks,
    )
    kv_cache = scheduler.kv_cache
    model = FakeModel(rng, scheduler, sliding_window)
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []

    def step(low: int = 0) -> None:
        if not pipelined:
            out = scheduler.schedule()
            scheduler.update_from_output(out, model.run(out, low))
            return
        out = scheduler.schedule()
        if not out.is_empty:
            launched = model.run(out, low)
        while in_flight:
            scheduler.update_from_output(*in_flight.pop())
        if not out.is_empty:
            in_flight.append((out, launched))
        for request in scheduler.requests.values():
            assert request.num_output_placeholders == (
                request.request_id in model.last_sampled and bool(in_flight)
            )

    prefixes = [[rng.randrange(100) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    requests: list[Request] = []
    for op in range(60):
        choice = rng.random()
        if choice < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(100) for _ in range(rng.randrange(4))]
            max_tokens = rng.randrange(1, 8 if sliding_window is None else 40)
            num_tokens = len(prompt) + max_tokens
            fits = max_blocks_held(num_tokens, block_size, sliding_window, budget)
            if num_tokens <= max_model_len and fits <= kv_cache.block_pool.num_usable_blocks:
                params = SamplingParams(max_tokens=max_tokens, eos_token_ids=(0,))
                group = rng.choice([None, "g1", "g2"])  # siblings share with caching off too
                # Some repeat an earlier one's prompt in its group (parallel sampling's siblings).
                leader = rng.choice(requests) if requests and rng.random() < 0.3 else None
                if leader is not None:
                    prompt, group = list(leader.prompt_token_ids), leader.sharing_group
                    if len(prompt) + max_tokens > max_model_len:
                        continue
                    if (
                        max_blocks_held(
                            len(prompt) + max_tokens, block_size, sliding_window, budget
                        )
                        > kv_cache.block_pool.num_usable_blocks
                    ):
                        continue
                priority = rng.randrange(3) if policy == "priority" else 0
                request = Request(f"r{op}", prompt, params, sharing_group=group, priority=priority)
                scheduler.add_request(request)
                requests.append(request)
        elif choice < 0.4 and requests:
            scheduler.abort_requests([rng.choice(requests).request_id])
        elif choice < 0.43:
            kv_cache.reset_prefix_cache()  # also while requests run or are swapped out
        else:
            step()
        scheduler.kv_cache.check_invariants()
        assert len(scheduler.running) <= max_num_seqs
        for request in scheduler.running:
            real = [b for b in kv_cache.req_to_blocks.get(request.request_id, [])]
            num_held = sum(b is not kv_cache.block_pool.null_block for b in real)
            assert num_held <= max_blocks_held(
                request.num_tokens + 1, block_size, sliding_window, budget
            )
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        step(low=1)
        scheduler.kv_cache.check_invariants()
    assert not scheduler.has_unfinished_requests() and not in_flight
    assert scheduler.schedule().is_empty  # (ends the CPU bookkeeping of the last frees)
    assert kv_cache.swap_space.num_free_blocks == num_swap_blocks and not kv_cache.swapped
    assert scheduler.num_swap_ins_total <= scheduler.num_swap_outs_total
    assert kv_cache.num_free_blocks == kv_cache.block_pool.num_usable_blocks
    assert kv_cache.num_free_blocks == num_blocks - (sliding_window is not None)
    for request in requests:
        assert request.is_finished
        assert request.num_output_placeholders == 0
        if request.status != RequestStatus.FINISHED_ABORTED:
            assert request.num_output_tokens >= 1
            assert request.num_output_tokens <= request.max_tokens
        for position, token in model.fed.get(request.request_id, {}).items():
            if position < request.num_tokens:
                assert request.all_token_ids[position] == token


def test_prefix_queries_count_once_per_admission() -> None:
    """A request that waits for blocks looks its prefix up every step; the metrics count it
    once, when it is admitted."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    first, second = make_request("a", 12, max_tokens=4), make_request("b", 8, max_tokens=4)
    scheduler.add_request(first)
    scheduler.add_request(second)
    for _ in range(3):
        run_step(scheduler)
        assert second.status == RequestStatus.WAITING  # no blocks left for it
    assert scheduler.kv_cache.num_query_tokens == first.num_prompt_tokens
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv_cache.num_query_tokens == first.num_prompt_tokens + 8


def test_prompt_logprobs_skip_reading_but_fill_the_prefix_cache() -> None:
    """A request with prompt logprobs needs every prompt position computed: it reads no
    prefix-cache hits (Request.skip_reading_prefix_cache), but its blocks are cached for the
    requests after it."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("plain", 9, first_token=20))
    run_step(scheduler)
    scored = make_request("scored", 9, first_token=20, prompt_logprobs=0)
    assert scored.skip_reading_prefix_cache and not make_request("x", 3).skip_reading_prefix_cache
    scheduler.add_request(scored)
    out = run_step(scheduler)
    assert {r.request_id: r.num_new_tokens for r in out.scheduled_requests}["scored"] == 9
    assert scored.num_cached_tokens == 0
    queries = scheduler.kv_cache.num_query_tokens
    scheduler.finish_requests(["plain"], RequestStatus.FINISHED_ABORTED)
    after = make_request("after", 9, first_token=20)
    scheduler.add_request(after)
    run_step(scheduler)
    assert after.num_cached_tokens == 8  # two full blocks of 4, from "plain" and "scored"
    assert scheduler.kv_cache.num_query_tokens == queries + 9  # "scored" was no lookup


def test_a_victim_unplanned_in_its_step_leaves_no_unwritten_block_in_the_prefix_cache() -> None:
    """Priority policy: "low" is planned first in a step (its decode token completes its
    second block, which allocate_slots indexes ahead of the write), then "high" needs a block
    and preempts it. The step never writes that block, so no later request may hit it (here
    the preemptor takes the freed block at once; test_kv_cache_manager's
    test_blocks_indexed_ahead_of_their_write_are_forgotten_when_unplanned covers the blocks
    that stay free)."""
    scheduler = make_scheduler(num_blocks=3, block_size=4, scheduling_policy="priority")
    low = Request("low", list(range(100, 106)), SamplingParams(max_tokens=8), priority=1)
    scheduler.add_request(low)
    run_step(scheduler)  # low's prefill: 6 tokens in blocks 0-1
    scheduler.add_request(Request("high", [200, 201, 202, 203], SamplingParams(max_tokens=8)))
    run_step(scheduler)  # low's position 6; high's prefill fills the third and last block
    out = run_step(scheduler)  # low's position 7 fills its block 1; high needs a new block
    assert [r.request_id for r in out.scheduled_requests] == ["high"]
    assert scheduler.num_preemptions_total == 1
    again = Request("again", [*low.all_token_ids[:8], 999], SamplingParams(max_tokens=1))
    _, num_hit_tokens = scheduler.kv_cache.get_computed_blocks(again)
    assert num_hit_tokens == 4  # block 0, written in step 1; not block 1
    scheduler.kv_cache.check_invariants()


def image_request(request_id: str, num_prompt: int, images: list[tuple[int, int]]) -> Request:
    """A prompt whose images (offset, length) stand in for a vision-language model's."""
    features = [
        MultiModalFeature(np.zeros(1, np.float32), offset, length, f"{request_id}-{offset}")
        for offset, length in images
    ]
    return Request(request_id, list(range(100, 100 + num_prompt)), SamplingParams(max_tokens=2),
                   mm_features=features)  # fmt: skip


def test_encoder_budget_cuts_a_chunk_before_the_image_that_does_not_fit() -> None:
    """The step's encoder budget (max_num_batched_tokens embedding rows, vLLM's default) is
    spent by the images a step starts; a chunk stops before the first one past it."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(image_request("a", 40, [(2, 10), (14, 10), (26, 3)]))
    scheduler.add_request(image_request("b", 8, [(0, 4)]))
    steps = [
        [(r.request_id, r.num_new_tokens) for r in run_step(scheduler).scheduled_requests]
        for _ in range(3)
    ]
    # Step 1: a's image 1 (10 rows) fits, its image 2 (10 more) does not: a stops at 14;
    # b's image (4 of the 6 rows left) fits in its 2 tokens of budget.
    assert steps[0] == [("a", 14), ("b", 2)]
    assert steps[1] == [("a", 16)]  # images 2 and 3 (13 rows) from position 14
    assert steps[2] == [("a", 10), ("b", 6)]  # b's image is encoded already


def test_an_image_larger_than_the_budget_runs_alone() -> None:
    """An image of more rows than the whole budget waits for a step that starts no other
    image, then runs (the text before it does not wait)."""
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(image_request("small", 4, [(0, 2)]))
    scheduler.add_request(image_request("big", 30, [(1, 20)]))
    steps = [
        [(r.request_id, r.num_new_tokens) for r in run_step(scheduler).scheduled_requests]
        for _ in range(2)
    ]
    assert steps == [[("small", 4), ("big", 1)], [("small", 1), ("big", 7)]]
