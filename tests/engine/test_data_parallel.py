"""Data parallelism's parts: which core takes a request (CoreLoads), each core's GPUs
(core_envs), the option errors, an AsyncLLMEngine of two cores whose aborts reach the
core that runs the request, and the offline LLM on two cores. The real server:
tests/entrypoints/openai/test_data_parallel_server.py."""

import asyncio
import time
from typing import Any

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.data_parallel import CoreLoads, core_envs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError
from pagedserve.metrics import EngineMetrics

ENGINE_ARGS: dict[str, Any] = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=8 << 20)


def test_the_least_loaded_core_then_the_emptier_cache_then_in_turn() -> None:
    loads = CoreLoads(3)
    picked = []
    for _ in range(3):  # all equal: in turn
        picked.append(loads.pick())
        loads.added(picked[-1])
    assert picked == [0, 1, 2]
    loads.ended(1)
    assert loads.pick() == 1  # the fewest unfinished requests
    loads.added(1)
    loads.report(0, 0.5)
    loads.report(1, 0.25)
    loads.report(2, 0.75)
    assert loads.pick() == 1  # equal counts: the lower KV cache usage
    loads.report(1, 0.5)
    loads.report(2, 0.5)
    assert loads.pick() == 2  # then in turn, after the last one picked (1)
    assert loads.pick() == 0


def gpu_config(monkeypatch: pytest.MonkeyPatch, dp: int, tp: int, visible: str | None) -> Any:
    config = EngineArgs(device="auto", data_parallel_size=dp, tensor_parallel_size=tp)
    built = config.create_engine_config()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return built


def test_each_core_sees_its_own_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    config = gpu_config(monkeypatch, 2, 2, "3,5,6,7")
    envs = core_envs(config)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["3,5", "6,7"]
    config = gpu_config(monkeypatch, 4, 1, None)
    envs = core_envs(config)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1", "2", "3"]
    assert all("PAGEDSERVE_DISTRIBUTED_PORT" not in env for env in envs)  # one rank each
    config = gpu_config(monkeypatch, 3, 2, None)
    with pytest.raises(ValueError, match=r"data_parallel_size \(3\) x tensor_parallel_size \(2\)"):
        core_envs(config)


def test_each_tensor_parallel_group_has_its_own_port() -> None:
    cpu = EngineArgs(device="cpu", data_parallel_size=3, tensor_parallel_size=2)
    ports = [
        env.pop("PAGEDSERVE_DISTRIBUTED_PORT") for env in core_envs(cpu.create_engine_config())
    ]
    assert len(set(ports)) == 3
    one_rank = EngineArgs(device="cpu", data_parallel_size=2).create_engine_config()
    assert core_envs(one_rank) == [{}, {}]  # nothing to choose for one CPU rank each


def test_option_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1, got 0"):
        EngineArgs(data_parallel_size=0).create_engine_config()
    config = EngineArgs(data_parallel_size=2, **ENGINE_ARGS).create_engine_config()
    with pytest.raises(ValueError, match="use LLMEngine.from_engine_args"):
        LLMEngine(config)  # the cores are started from the options
    with pytest.raises(ValueError, match="pass no metrics"):
        AsyncLLMEngine(
            EngineArgs(data_parallel_size=2, **ENGINE_ARGS), metrics=EngineMetrics("m", 256)
        )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="names one GPU, but data_parallel_size is 2"):
        EngineArgs(device="cuda:0", data_parallel_size=2).create_engine_config()


def test_aborts_reach_the_core_that_runs_the_request() -> None:
    engine = AsyncLLMEngine(EngineArgs(data_parallel_size=2, **ENGINE_ARGS), log_stats=False)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    def running(index: int) -> float:
        return float(engine.engine_metrics[index].num_requests_running._value.get())

    async def wait_for(predicate: Any) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    async def run() -> None:
        first = engine.generate("Once", long, "a")
        second = engine.generate("Once", long, "b")
        await first.__anext__()
        await second.__anext__()
        assert engine._core_of == {"a": 0, "b": 1}
        await wait_for(lambda: running(0) == 1 and running(1) == 1)
        await second.aclose()  # aborts "b" on core 1 only
        await wait_for(lambda: running(1) == 0)
        assert engine.engine_metrics[1].kv_cache_usage._value.get() == 0
        assert running(0) == 1 and engine._loads.num_unfinished == [1, 0]
        await engine.reset_prefix_cache()  # reaches both cores
        # the next request goes to the idle core
        third = engine.generate("Once", long, "c")
        await third.__anext__()
        assert engine._core_of["c"] == 1
        await first.aclose()
        await third.aclose()
        await wait_for(lambda: running(0) == 0 and running(1) == 0)
        assert engine._loads.num_unfinished == [0, 0] and not engine._core_of

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_offline_llm_on_two_cores_equals_one() -> None:
    prompts = ["Once upon a time", "Lily and Ben", "The cat", "One day"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, n=2)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    with LLM(**ENGINE_ARGS) as llm:
        expected = [o.outputs for o in llm.generate(prompts, greedy, use_tqdm=False)]
        expected_seeded = llm.generate(prompts[0], seeded, use_tqdm=False)[0].outputs[0].text
    with LLM(data_parallel_size=2, **ENGINE_ARGS) as llm:
        got = [o.outputs for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert [[c.text for c in o] for o in got] == [[c.text for c in o] for o in expected]
        # the same seeded request on either core: the seed decides its text
        engine, core = llm.llm_engine, llm.llm_engine.engine_core
        for request_id in ("s0", "s1"):
            engine.add_request(request_id, prompts[0], seeded)
        assert sorted(core._unit_core.values()) == [0, 1]  # one on each core
        texts: dict[str, str] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    texts[output.request_id] = output.outputs[0].text
        assert texts == {"s0": expected_seeded, "s1": expected_seeded}
        assert not core._unit_of and core._loads.num_unfinished == [0, 0]
        # an abort reaches the request's core, which stops counting it
        long = SamplingParams(max_tokens=200, ignore_eos=True, n=2)
        engine.add_request("gone", prompts[0], long)
        assert set(core._unit_core.values()) == {0} and core._loads.num_unfinished == [1, 0]
        engine.step()
        [final] = engine.abort_request("gone")
        assert final.finished and not core._unit_of and core._loads.num_unfinished == [0, 0]
        # a core that dies fails the engine
        engine.add_request("doomed", prompts[0], long)
        core.cores[1].process.kill()
        with pytest.raises(EngineDeadError, match="data-parallel rank 1"):
            while engine.has_unfinished_requests():
                engine.step()


def test_distributed_port_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve import envs

    monkeypatch.setenv("PAGEDSERVE_DISTRIBUTED_PORT", "29555")
    assert envs.distributed_port() == 29555
    monkeypatch.setenv("PAGEDSERVE_DISTRIBUTED_PORT", "70000")
    with pytest.raises(ValueError, match="PAGEDSERVE_DISTRIBUTED_PORT must be a port number"):
        envs.distributed_port()
    monkeypatch.delenv("PAGEDSERVE_DISTRIBUTED_PORT")
    assert envs.distributed_port() is None
