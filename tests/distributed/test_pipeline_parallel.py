"""Pipeline parallelism on the CPU (worker processes, gloo): PP=2 (and PP=4, and PP=2 x TP=2)
give the single process's greedy tokens and logprobs; each stage builds, loads and caches
only its layers; the split can be set by PAGEDSERVE_PP_LAYER_PARTITION; bad sizes and
unsupported models fail at start-up naming the option; a killed stage fails the engine."""

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.config import ParallelConfig
from pagedserve.config_checks import check_gpus_for_ranks
from pagedserve.distributed.parallel_state import set_pipeline_parallel_state
from pagedserve.errors import EngineDeadError
from pagedserve.models.loader import load_model
from pagedserve.models.pp_utils import PPMissingLayer
from pagedserve.pp_layers import get_pp_indices, pp_partition

from ._helpers import (
    _COMMON,
    SHARED_MODELS,
    assert_same_outputs,
    engine_options,
    greedy_outputs,
    prompts_for,
    save_tiny_model,
    wait_gone,
)

# 4 decoder layers: 2 per stage at PP=2, 1 at PP=4. Tied embeddings: the last stage loads its
# own LM head from the checkpoint's embedding.
LLAMA4 = transformers.LlamaConfig(
    **{**_COMMON, "num_hidden_layers": 4},
    vocab_size=512,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
QWEN3 = transformers.Qwen3Config(
    **{**_COMMON, "num_hidden_layers": 4},
    vocab_size=509,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=False,
)
# Biased q/k/v; a window of 8 on stage 0's layers only: the engine must keep every block
# (stage 1 reads them all), not free those that leave stage 0's window.
QWEN2 = transformers.Qwen2Config(
    **{**_COMMON, "num_hidden_layers": 4},
    vocab_size=512,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    use_sliding_window=True,
    sliding_window=8,
    layer_types=["sliding_attention"] * 2 + ["full_attention"] * 2,
)
STORIES = SHARED_MODELS / "stories260k"  # 5 layers, tied: the default split is [3, 2]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {"stories260k": STORIES}
    for name, config in (("llama4", LLAMA4), ("qwen3", QWEN3), ("qwen2", QWEN2)):
        paths[name] = save_tiny_model(config, tmp_path_factory.mktemp(name))
    for name in ("llama_gqa", "gpt2", "gemma2"):  # 2 layers
        paths[name] = save_tiny_model(name, tmp_path_factory.mktemp(name))
    return paths


@pytest.fixture(scope="module")
def expected(model_paths: dict[str, Path]) -> dict[str, list[tuple[list[int], float]]]:
    """The single process's greedy outputs, computed once per model."""
    names = ("llama4", "qwen3", "qwen2", "stories260k")
    return {name: greedy_outputs(model_paths[name]) for name in names}


def test_layer_partition() -> None:
    """vLLM's split: even, the remainder one layer each to the stages before the last."""
    assert pp_partition(4, 2) == [2, 2]
    assert pp_partition(5, 2) == [3, 2]
    assert pp_partition(7, 4) == [2, 2, 2, 1]
    assert pp_partition(6, 4) == [1, 2, 2, 1]
    assert pp_partition(8, 2, "3,5") == [3, 5]
    assert [get_pp_indices(8, rank, 2, "3,5") for rank in (0, 1)] == [(0, 3), (3, 8)]
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) is larger .* = 2\)"):
        pp_partition(2, 3)
    for bad in ("3,4", "8", "0,8", "a,b", "3,5,0"):
        with pytest.raises(ValueError, match="PAGEDSERVE_PP_LAYER_PARTITION=.* sum to"):
            pp_partition(8, 2, bad)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_builds_and_loads_only_its_layers(stage: int, model_paths: dict[str, Path]) -> None:
    """Stage 0: the embedding and layers 0-1; stage 1: layers 2-3, the final norm and an LM
    head loaded from the tied embedding. The other modules are parameterless placeholders."""
    hf_config = transformers.AutoConfig.from_pretrained(model_paths["llama4"])
    set_pipeline_parallel_state(stage, 2)
    try:
        model = load_model(
            str(model_paths["llama4"]), hf_config, torch.float32, torch.device("cpu")
        )
    finally:
        set_pipeline_parallel_state(0, 1)
    mine = {0: {0, 1}, 1: {2, 3}}[stage]
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, PPMissingLayer) == (i not in mine)
    assert isinstance(model.model.embed_tokens, PPMissingLayer) == (stage == 1)
    assert isinstance(model.model.norm, PPMissingLayer) == (stage == 0)
    assert isinstance(model.lm_head, PPMissingLayer) == (stage == 0)
    names = {name for name, _ in model.named_parameters()}
    assert all(name.split(".")[2] in {str(i) for i in mine} for name in names if ".layers." in name)
    if stage == 1:
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_paths["llama4"])
        embedding = reference.get_input_embeddings().weight
        assert torch.equal(model.lm_head.weight, embedding)


@pytest.mark.parametrize(
    ("name", "pp_size"),
    [("llama4", 2), ("qwen3", 2), ("qwen2", 2), ("stories260k", 2), ("llama4", 4)],
)
def test_pipeline_parallel_matches_single_process(
    name: str,
    pp_size: int,
    model_paths: dict[str, Path],
    expected: dict[str, list[tuple[list[int], float]]],
) -> None:
    got = greedy_outputs(model_paths[name], pipeline_parallel_size=pp_size)
    assert_same_outputs(got, expected[name])


def test_pipeline_and_tensor_parallel_match_single_process(
    model_paths: dict[str, Path], expected: dict[str, list[tuple[list[int], float]]]
) -> None:
    """PP=2 x TP=2: 4 ranks; the tensor-parallel collectives stay inside each stage."""
    got = greedy_outputs(model_paths["llama4"], pipeline_parallel_size=2, tensor_parallel_size=2)
    assert_same_outputs(got, expected["llama4"])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_are_pipelined_through_the_stages(
    async_scheduling: bool,
    model_paths: dict[str, Path],
    expected: dict[str, list[tuple[list[int], float]]],
) -> None:
    """The engine keeps two steps on the ranks at once (the batch queue: stage 0 takes step
    N+1 while stage 1 runs N), each of requests whose last token is back; async scheduling
    (placeholder tokens) gives way to it. Same greedy outputs as one process."""
    path = model_paths["llama4"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    in_flight_at_submit: list[int] = []
    with LLM(
        str(path),
        **engine_options(path),
        pipeline_parallel_size=2,
        async_scheduling=async_scheduling,
    ) as llm:
        core = llm.llm_engine.engine_core
        assert core.max_concurrent_batches == 2 and not core.async_scheduling
        submit = core.executor.submit_model

        def recording_submit(scheduler_output: Any) -> Any:
            in_flight_at_submit.append(len(core._batch_queue))
            return submit(scheduler_output)

        core.executor.submit_model = recording_submit
        outputs = llm.generate(prompts_for(path), params, use_tqdm=False)
    got = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob or 0.0) for o in outputs]
    assert_same_outputs(got, expected["llama4"])
    assert max(in_flight_at_submit) == 1  # a second step went out before the first was back


def test_abort_and_preemption_with_steps_in_flight(model_paths: dict[str, Path]) -> None:
    """A request aborted while its step is on the ranks ends "abort"; the others run to
    their length though the small cache preempts requests that have steps in flight; the
    engine ends with no step queued and no block held."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine

    path = model_paths["llama4"]
    args = EngineArgs(str(path), **engine_options(path), pipeline_parallel_size=2)
    engine = LLMEngine.from_engine_args(args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(prompts_for(path)):
            engine.add_request(str(i), prompt, params)
        for _ in range(6):
            engine.step()
        core = engine.engine_core
        assert core._batch_queue  # a step is on the ranks
        [aborted] = engine.abort_request("0")
        assert [c.finish_reason for c in aborted.outputs] == ["abort"]
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0]
        assert sorted(finished, key=int) == [str(i) for i in range(1, 10)]
        assert all(
            len(c.token_ids) == 12 and c.finish_reason == "length" for c in finished.values()
        )
        assert core.scheduler.num_preemptions_total > 0
        assert not core._batch_queue and engine.kv_cache.usage == 0
    finally:
        engine.shutdown()


def test_swap_preemption_matches_single_process(
    model_paths: dict[str, Path], expected: dict[str, list[tuple[list[int], float]]]
) -> None:
    """preemption_mode 'swap': each stage copies its own layers' blocks to its CPU swap
    space and back, in step order with the steps in flight."""
    path = model_paths["llama4"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    options = dict(engine_options(path), preemption_mode="swap", swap_space=0.01)
    with LLM(str(path), **options, pipeline_parallel_size=2) as llm:
        outputs = llm.generate(prompts_for(path), params, use_tqdm=False)
        assert llm.llm_engine.engine_core.kv_cache.num_swapped_out_blocks > 0
    got = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob or 0.0) for o in outputs]
    assert_same_outputs(got, expected["llama4"])


def test_prompt_logprobs_and_seeded_sampling_match_single_process() -> None:
    """The last stage scores the prompt (prompt_logprobs) and samples with the request's seed
    as one process does."""
    params = SamplingParams(
        temperature=1.0, top_k=50, seed=7, max_tokens=8, ignore_eos=True, prompt_logprobs=2
    )
    results = []
    for pp_size in (1, 2):
        with LLM(str(STORIES), **engine_options(STORIES), pipeline_parallel_size=pp_size) as llm:
            outputs = llm.generate(prompts_for(STORIES), params, use_tqdm=False)
        results.append(
            [
                (
                    o.outputs[0].token_ids,
                    [sorted(p.items()) if p else None for p in o.prompt_logprobs or []],
                )
                for o in outputs
            ]
        )
    single, pipelined = results
    assert [ids for ids, _ in pipelined] == [ids for ids, _ in single]
    for (_, got), (_, want) in zip(pipelined, single, strict=True):
        assert len(got) == len(want) > 1
        for got_pos, want_pos in zip(got, want, strict=True):
            if want_pos is None:
                assert got_pos is None
                continue
            assert [t for t, _ in got_pos] == [t for t, _ in want_pos]
            for (_, a), (_, b) in zip(got_pos, want_pos, strict=True):
                assert abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize(("partition", "largest_stage"), [(None, 2), ("1,3", 3), ("3,1", 3)])
def test_each_stage_caches_only_its_layers(
    partition: str | None,
    largest_stage: int,
    model_paths: dict[str, Path],
    expected: dict[str, list[tuple[list[int], float]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KV block of the largest stage holds its layers only (of 4); an uneven split set by
    PAGEDSERVE_PP_LAYER_PARTITION reaches the workers (which start from a forkserver with
    an older environment) and gives the same outputs."""
    path = model_paths["llama4"]
    with LLM(str(path), **engine_options(path)) as llm:
        block_bytes_4_layers = llm.llm_engine.engine_core.executor.block_bytes
    if partition is not None:
        monkeypatch.setenv("PAGEDSERVE_PP_LAYER_PARTITION", partition)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(str(path), **engine_options(path), pipeline_parallel_size=2) as llm:
        executor = llm.llm_engine.engine_core.executor
        assert executor.block_bytes == block_bytes_4_layers * largest_stage // 4
        outputs = llm.generate(prompts_for(path), params, use_tqdm=False)
    got = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob or 0.0) for o in outputs]
    assert_same_outputs(got, expected["llama4"])


def test_start_up_errors_name_the_option(
    model_paths: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def start(name: str, **options: object) -> None:
        LLM(str(model_paths[name]), device="cpu", skip_tokenizer_init=True, **options)

    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) .*num_hidden_layers = 2"):
        start("llama_gqa", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        start("llama_gqa", pipeline_parallel_size=0)
    for name, cls in (("gpt2", "GPT2LMHeadModel"), ("gemma2", "Gemma2ForCausalLM")):
        with pytest.raises(NotImplementedError, match=f"pipeline parallelism .*{cls}"):
            start(name, pipeline_parallel_size=2)
    with pytest.raises(NotImplementedError, match="pipeline parallelism .*transformers backend"):
        start("llama_gqa", pipeline_parallel_size=2, model_impl="transformers")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        start("llama_gqa", pipeline_parallel_size=2, distributed_executor_backend="uni")
    monkeypatch.setenv("PAGEDSERVE_PP_LAYER_PARTITION", "3,2")
    with pytest.raises(ValueError, match="PAGEDSERVE_PP_LAYER_PARTITION='3,2' must list"):
        start("llama4", pipeline_parallel_size=2)


def test_more_ranks_than_gpus_is_refused_naming_both_sizes() -> None:
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert config.world_size == 4 and config.executor_backend == "mp"
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(2\) x tensor_parallel_size"):
        check_gpus_for_ranks(config.world_size, 2, config)
    check_gpus_for_ranks(config.world_size, 4, config)  # enough GPUs: no error


@pytest.mark.parametrize("stage", [0, 1])
def test_a_killed_stage_fails_generation(stage: int) -> None:
    """Either stage killed mid-generation: the engine's dead error names the rank and how it
    died, every rank is gone, and later calls fail the same way (as test_faults.py for TP)."""
    llm = LLM(
        str(STORIES),
        device="cpu",
        dtype="float32",
        pipeline_parallel_size=2,
        num_gpu_blocks_override=256,
        distributed_timeout_s=3.0,
    )
    pids = llm.llm_engine.engine_core.executor.worker_pids
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    def kill_stage() -> None:
        time.sleep(0.5)  # generation runs for seconds: this lands mid-step or between steps
        os.kill(pids[stage], signal.SIGKILL)

    thread = threading.Thread(target=kill_stage)
    thread.start()
    try:
        with pytest.raises(EngineDeadError, match="rank") as info:
            llm.generate(["Once upon a time"] * 8, long, use_tqdm=False)
    finally:
        thread.join()
    assert f"rank {stage}" in str(info.value) and "killed by SIGKILL" in str(info.value)
    assert wait_gone(pids, timeout_s=2.0) == []
    with pytest.raises(EngineDeadError):
        llm.generate(["Once upon a time"], long, use_tqdm=False)
    llm.shutdown()
