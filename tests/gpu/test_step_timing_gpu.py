"""The device seconds of each step on a GPU (CUDA events, `ModelRunnerOutput.device_seconds`):
every forward is timed, prompt-chunk-only steps too (which return without waiting for the
device), and the steps' seconds fit inside the run's wall time."""

import os
import time
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MODELS = Path(
    os.environ.get(
        "PAGEDSERVE_TEST_MODELS", Path(__file__).resolve().parents[3] / "shared" / "models"
    )
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_forward_has_device_seconds(async_scheduling: bool) -> None:
    llm = LLM(
        str(MODELS / "tinystories-656k"),
        max_model_len=256,
        num_gpu_blocks_override=128,  # small: the other parametrization's engine may live on
        max_num_batched_tokens=32,  # 100-token prompts: chunks that sample nothing
        async_scheduling=async_scheduling,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": [5 + i] * 100}, params)
    core = engine.engine_core
    timed: list[bool] = []
    add_step_cost = core._add_step_cost

    def spy(scheduler_output, output, launched_at):  # type: ignore[no-untyped-def]
        timed.append(output.device_seconds is not None)
        add_step_cost(scheduler_output, output, launched_at)

    core._add_step_cost = spy  # type: ignore[method-assign]
    engine.step_records = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    forwards = [r for r in engine.step_records if r.num_tokens]
    assert sum(r.num_tokens for r in forwards) >= 4 * 100
    assert all(0 < r.seconds < wall for r in forwards)
    assert sum(r.seconds for r in forwards) <= wall
    assert timed and all(timed)  # CUDA events, prompt chunks included
    engine.shutdown()
