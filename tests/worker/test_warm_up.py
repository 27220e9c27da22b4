"""The model runner's start-up warm-up steps leave no state behind and change no output."""

from pagedserve import LLM, SamplingParams
from pagedserve.worker.runner_setup import warm_up


def make_llm() -> LLM:
    return LLM(device="cpu", dtype="float32", max_model_len=512, num_gpu_blocks_override=200)


def test_warm_up_leaves_no_state_and_same_outputs() -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = make_llm().generate("Once upon a time", params, use_tqdm=False)
    llm = make_llm()
    runner = llm.llm_engine.engine_core.executor.worker.runner
    warm_up(runner, 200)  # runs by itself at start-up on CUDA only; the steps are device-free
    assert runner.states == {}
    got = llm.generate("Once upon a time", params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    llm.llm_engine.engine_core.kv_cache.check_invariants()
