"""The offline API's scheduling options: `LLM.generate(priority=[...])` with
scheduling_policy "priority", and its refusal under fcfs."""

from collections.abc import Iterator

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.step import SchedulerOutput

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPTS = ["Once upon a time", "The little dog", "Lily liked to"]


@pytest.fixture(scope="module")
def priority_llm() -> Iterator[LLM]:
    """One request at a time, so that the admission order is the whole schedule."""
    llm = LLM(
        device="cpu",
        max_model_len=128,
        kv_cache_memory_bytes=4 << 20,
        max_num_seqs=1,
        scheduling_policy="priority",
    )
    yield llm
    llm.llm_engine.shutdown()


def record_admissions(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids in the order the scheduler admits them (filled as the engine runs)."""
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule
    admitted: list[str] = []

    def recording_schedule() -> SchedulerOutput:
        output: SchedulerOutput = schedule()
        admitted.extend(new.request_id for new in output.new_requests)
        return output

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    return admitted


def test_generate_runs_prompts_in_priority_order(
    priority_llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = priority_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    admitted = record_admissions(priority_llm, monkeypatch)
    outputs = priority_llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[2, 0, 1])
    # Outputs stay in input order; the requests ran lowest priority value first.
    assert [o.prompt for o in outputs] == PROMPTS
    assert admitted == [outputs[1].request_id, outputs[2].request_id, outputs[0].request_id]
    # The order changes when each runs, not what it generates (greedy).
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert not priority_llm.llm_engine.has_unfinished_requests()


def test_priority_list_must_have_one_value_per_prompt(priority_llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 priorities for 3 prompts") as error:
        priority_llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 1])
    assert error.value.param == "priority"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="priority must be an int"):
        priority_llm.generate(PROMPTS[0], PARAMS, use_tqdm=False, priority=["high"])  # type: ignore[list-item]
    assert not priority_llm.llm_engine.has_unfinished_requests()


def test_fcfs_refuses_a_priority_but_takes_zero() -> None:
    llm = LLM(device="cpu", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    try:
        with pytest.raises(ValueError, match="got priority 3 but priority scheduling is not"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 3, 0])
        assert not llm.llm_engine.has_unfinished_requests()  # the first was aborted
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, priority=[0, 0, 0])
        assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    finally:
        llm.llm_engine.shutdown()
