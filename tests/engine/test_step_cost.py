"""The engine core's roofline cost of each step (`EngineCore.step_cost`): exactly
`roofline.step_cost` of what the step ran, counted in the step that applies its tokens."""

import time
from pathlib import Path
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.messages import EngineCoreOutput
from pagedserve.roofline import step_cost

SHARED = Path(__file__).resolve().parents[3] / "shared"
MODEL = str(SHARED / "models" / "tinystories-656k")


def make_llm(async_scheduling: bool) -> LLM:
    return LLM(
        MODEL,
        dtype="float32",
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=8,  # chunks the prompt
        async_scheduling=async_scheduling,
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_step_cost_is_the_cost_of_the_forwards_applied(async_scheduling: bool) -> None:
    """A 12-token prompt (2 chunks of 8 and 4 tokens, the second samples) and 3 decode steps:
    the steps' costs add up to those five forwards', each costing what it ran; nothing when
    idle."""
    engine = make_llm(async_scheduling).llm_engine
    core = engine.engine_core
    engine.add_request(
        "r", {"prompt_token_ids": list(range(1, 13))}, SamplingParams(max_tokens=4, ignore_eos=True)
    )
    costs = []
    engine.step_records = []
    while engine.has_unfinished_requests():
        engine.step()
        costs.append(core.step_cost)
    forwards = [[(8, 8)], [(4, 12)], [(1, 13)], [(1, 14)], [(1, 15)]]
    expected = [step_cost(core.model_cost, f) for f in forwards]
    assert [c for c in costs if c != (0.0, 0.0)] == expected
    # The offline engine's records of those steps: their tokens and the same costs.
    records = engine.step_records
    assert len(records) == len(costs)
    assert all((r.seconds > 0) == (r.num_tokens > 0) for r in records)
    assert [(r.step_bytes, r.step_flops) for r in records] == costs
    assert [r.num_tokens for r in records if r.num_tokens] == [8, 4, 1, 1, 1]
    assert core.model_cost.layer_windows == (None,) * len(core.model_cost.layer_windows)
    engine.step()
    assert core.step_cost == (0.0, 0.0)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cpu_step_seconds_are_each_forwards_own(
    async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU a forward runs inside its launch call (no device_seconds): each record's
    seconds are that call's, at least the 30 ms per token it sleeps here. With async
    scheduling the forward launched before the previous one is applied was timed from that
    apply, so each record held the next forward's time (a 4-token chunk at a 1-token
    decode's 30 ms, the last decode at ~0 s: an absurd MBU)."""
    engine = make_llm(async_scheduling).llm_engine
    executor = engine.engine_core.executor
    sleep_per_token = 0.03

    def slow(launch: Any) -> Any:
        def call(scheduler_output: Any, *args: Any) -> Any:
            time.sleep(sleep_per_token * scheduler_output.total_num_scheduled_tokens)
            return launch(scheduler_output, *args)

        return call

    for name in ("execute_model", "execute_model_async"):
        monkeypatch.setattr(executor, name, slow(getattr(executor, name)))
    engine.add_request(
        "r", {"prompt_token_ids": list(range(1, 13))}, SamplingParams(max_tokens=4, ignore_eos=True)
    )
    engine.step_records = []
    while engine.has_unfinished_requests():
        engine.step()
    forwards = [r for r in engine.step_records if r.num_tokens]
    assert [r.num_tokens for r in forwards] == [8, 4, 1, 1, 1]
    # (A lower bound only: no upper bound on a shared machine's timing. The bug gave each
    # record the next, shorter forward's time, under its own sleep.)
    for r in forwards:
        assert r.seconds >= sleep_per_token * r.num_tokens, forwards


def test_outputs_finished_outside_a_step_survive_a_step_that_waits() -> None:
    """Async scheduling with a request whose sampling reads its output tokens on the host
    (a repetition penalty) finishes the step in flight before scheduling the next. An output
    made outside a step (a request whose grammar failed to compile) was then dropped: its
    client never heard that the request ended."""
    engine = make_llm(async_scheduling=True).llm_engine
    core = engine.engine_core
    params = SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.2)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    engine.step()  # launched; in flight
    assert not core.scheduler.can_schedule_ahead and core._in_flight is not None
    failed = EngineCoreOutput("other", [], finish_reason="abort")
    core.scheduler._pending_outputs.append(failed)
    outputs = core.step()
    assert failed in outputs
