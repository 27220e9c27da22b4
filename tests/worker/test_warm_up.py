"""The model runner's start-up warm-up steps leave no state behind and change no output."""

from pagedserve import LLM, SamplingParams


def test_warm_up_leaves_no_state_and_same_outputs() -> None:
    llm = LLM(device="cpu", dtype="float32", max_model_len=512, num_gpu_blocks_override=200)
    params = SamplingParams(temperature=0, max_tokens=12)
    before = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.llm_engine.engine_core.executor.runner
    runner.warm_up(200)  # runs by itself on CUDA only; the steps are device-independent
    assert runner.states == {}
    after = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
    llm.llm_engine.engine_core.kv_cache.check_invariants()
