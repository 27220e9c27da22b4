"""The request lifecycle of AsyncLLMEngine and LLMEngine: abort, cancel, close, reuse of an
id, shutdown with requests in flight (issue 13, item 7)."""

import asyncio

import pytest

from pagedserve import RequestOutputKind, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.errors import EngineDeadError, ServerShuttingDownError
from pagedserve.messages import EngineCoreOutput
from pagedserve.outputs import RequestOutput
from tests.engine.test_async_engine import run_with_engine, wait_idle

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _assert_forgotten(engine: AsyncLLMEngine, request_id: str) -> None:
    """Nothing of the request is left on this side (the core's side: `wait_idle`)."""
    assert request_id not in engine.streams
    assert request_id not in engine.output_processor.requests
    assert request_id not in engine.metrics._requests
    parents = {parent for parent, _ in engine.output_processor.child_to_parent.values()}
    assert request_id not in parents


async def _consumer_started(engine: AsyncLLMEngine, request_id: str) -> "asyncio.Task[None]":
    """A task reading a long request's outputs, returned once the first one came."""
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("Once", LONG, request_id):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    return task


def test_async_engine_request_lifecycle() -> None:
    async def run(engine: AsyncLLMEngine) -> None:
        # abort() of a running n=2 request: a final output, every completion "abort"
        delta = SamplingParams(
            temperature=0.8, seed=1, n=2, max_tokens=200, ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        outputs: list[RequestOutput] = []
        first = asyncio.Event()

        async def consume() -> None:
            async for output in engine.generate("Once upon a time", delta, "a"):
                outputs.append(output)
                first.set()

        consumer = asyncio.create_task(consume())
        await first.wait()
        await engine.abort("a")
        await consumer  # ends: it does not hang, it does not stop silently
        final = outputs[-1]
        assert final.finished and final.request_id == "a"
        assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
        assert all(c.stop_reason is None for c in final.outputs)
        assert all(not o.finished for o in outputs[:-1])
        _assert_forgotten(engine, "a")
        await wait_idle(engine)

        # abort while still waiting (the core has produced nothing): a final output too
        stream = engine.add_request("w", "Once", LONG)
        engine.abort_request("w")
        [only] = [output async for output in engine.iterate(stream)]
        assert only.finished and only.outputs[0].finish_reason == "abort"
        assert only.outputs[0].token_ids == [] and only.outputs[0].text == ""
        _assert_forgotten(engine, "w")

        # unknown and finished ids: ignored
        await engine.abort("never-seen")
        await engine.abort("w")

        # aclose() right after the first output frees everything before it returns
        generator = engine.generate("Once", LONG, "closed")
        await generator.__anext__()
        await generator.aclose()
        _assert_forgotten(engine, "closed")

        # cancelling the consuming task frees it too
        task = await _consumer_started(engine, "cancelled")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        _assert_forgotten(engine, "cancelled")
        await wait_idle(engine)

        # an id reused at once after an abort: outputs of the old request that are still on
        # their way from the core must not reach the new one
        stream = engine.add_request("r", "Once", LONG)
        [old_core_id] = engine.output_processor.requests["r"].child_ids
        engine.abort_request("r")
        short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        stream = engine.add_request("r", "The cat", short)
        stale = EngineCoreOutput(old_core_id, [42], None, None, None, 0)
        assert engine.output_processor.process_outputs([stale]) == ([], [])
        results = [output async for output in engine.iterate(stream)]
        assert len(results[-1].outputs[0].token_ids) == 5
        assert results[-1].outputs[0].finish_reason == "length"

        # fail_running (a stopping server's drain period is over): the running request's
        # iterator raises the given error and is freed; the engine stays usable
        task = await _consumer_started(engine, "draining")
        engine.fail_running(ServerShuttingDownError("stopping"))
        with pytest.raises(ServerShuttingDownError):
            await asyncio.wait_for(task, 30)
        _assert_forgotten(engine, "draining")
        await wait_idle(engine)
        assert not engine.errored
        results = [output async for output in engine.generate("The cat", short, "after")]
        assert results[-1].outputs[0].finish_reason == "length"

        # shutdown with a request in flight: its iterator raises, new requests are refused
        task = await _consumer_started(engine, "inflight")
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 30)
        _assert_forgotten(engine, "inflight")
        with pytest.raises(EngineDeadError):
            engine.add_request("late", "Once", LONG)

    run_with_engine(run)


def test_llm_engine_abort_returns_the_final_outputs() -> None:
    """LLMEngine.abort_request gives back what vLLM's abort hands out: a finished
    RequestOutput whose unfinished completions have finish_reason "abort"."""
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=50, n=2, ignore_eos=True)
    engine.add_request("x", "Once upon a time", params)
    engine.add_request("waiting", "The dog", SamplingParams(max_tokens=5))
    for _ in range(3):
        engine.step()
    [aborted] = engine.abort_request("x")
    assert aborted.request_id == "x" and aborted.finished
    assert [c.finish_reason for c in aborted.outputs] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 50 and c.text for c in aborted.outputs)
    assert engine.abort_request(["x", "unknown"]) == []
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.usage == 0
    assert engine.output_processor.requests == {}
