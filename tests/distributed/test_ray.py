"""The Ray backend on a local Ray cluster (4 CPUs, started here): TP=2 and PP=2 equal one
rank, and a killed actor fails the engine."""

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import EngineDeadError

from ._helpers import (
    REAL_MODELS,
    SHARED_MODELS,
    assert_same_outputs,
    greedy_outputs,
    save_tiny_model,
    wait_gone,
)

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagedserve[ray]'")


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.parametrize("name", ["llama_mqa", "qwen3", "gpt2", *REAL_MODELS])
def test_ray_tensor_parallel_matches_single_rank(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = (
        SHARED_MODELS / name
        if name in REAL_MODELS
        else save_tiny_model(name, tmp_path_factory.mktemp(name))
    )
    expected = greedy_outputs(path)
    got = greedy_outputs(path, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert_same_outputs(got, expected)
    deadline = time.monotonic() + 10  # Ray returns the placement group's CPUs asynchronously
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4  # actors and placement group released


def test_ray_async_scheduling_matches_single_rank() -> None:
    path = SHARED_MODELS / "stories260k"
    expected = greedy_outputs(path)
    got = greedy_outputs(
        path, tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling=True
    )
    assert_same_outputs(got, expected)


def test_ray_pipeline_parallel_matches_single_rank() -> None:
    """PP=2 over Ray (stories260k's 5 layers split [3, 2]): the last stage's rank answers."""
    path = SHARED_MODELS / "stories260k"
    expected = greedy_outputs(path)
    got = greedy_outputs(path, pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert_same_outputs(got, expected)


def test_killed_ray_worker_fails_generation() -> None:
    llm = LLM(
        str(SHARED_MODELS / "stories260k"),
        device="cpu",
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        num_gpu_blocks_override=256,
    )
    executor: Any = llm.llm_engine.engine_core.executor
    pids = executor.worker_pids()
    killed_at: list[float] = []

    def kill_rank_1() -> None:
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        killed_at.append(time.monotonic())

    thread = threading.Thread(target=kill_rank_1)
    thread.start()
    try:
        with pytest.raises(EngineDeadError, match="Ray worker"):
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            llm.generate(["Once upon a time"] * 8, params, use_tqdm=False)
        assert time.monotonic() - killed_at[0] < 10.0
    finally:
        thread.join()
    assert wait_gone(pids, timeout_s=5.0) == []
    llm.shutdown()


def test_ray_data_parallel_cores_share_the_cluster() -> None:
    """-dp 2 with the Ray backend: both engine cores join this cluster (RAY_ADDRESS) rather
    than start their own, and greedy outputs equal one engine's."""
    import asyncio

    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.async_engine import AsyncLLMEngine

    path = SHARED_MODELS / "stories260k"
    prompts = ["Once upon a time", "Lily and Ben", "The cat", "One day"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(path), device="cpu", num_gpu_blocks_override=256) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    args = EngineArgs(
        str(path),
        device="cpu",
        num_gpu_blocks_override=256,
        data_parallel_size=2,
        distributed_executor_backend="ray",
    )
    engine = AsyncLLMEngine(args, log_stats=False)

    async def generate(prompt: str, request_id: str) -> list[int]:
        outputs = [output async for output in engine.generate(prompt, params, request_id)]
        return outputs[-1].outputs[0].token_ids

    async def generate_all() -> list[list[int]]:
        return list(await asyncio.gather(*(generate(p, f"r{i}") for i, p in enumerate(prompts))))

    try:
        assert ray.available_resources().get("CPU") == 2  # one actor per core, here
        got = asyncio.run(generate_all())
        assert got == expected
        served = [m.request_success["length"]._value.get() for m in engine.engine_metrics]
        assert served == [2, 2]
    finally:
        engine.shutdown()
