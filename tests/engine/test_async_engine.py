"""AsyncLLMEngine on its own (engine core in a child process); the codec: test_messages.py."""

import asyncio
import dataclasses
from typing import Any

import pytest

from pagedserve import LLM, RequestOutputKind, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.errors import InvalidRequestError

PROMPTS = ["Once upon a time", "Lily and Ben", "The cat"]
ENGINE_ARGS = dict(device="cpu", max_model_len=256, kv_cache_memory_bytes=8 * 2**20)


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    llm = LLM(**ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=12, n=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return {o.prompt: o.outputs[0].text for o in outputs if o.prompt is not None}


def test_generate_abort_and_errors(expected: dict[str, str]) -> None:
    async def run(engine: AsyncLLMEngine) -> None:
        async def delta_text(prompt: str, request_id: str) -> list[str]:
            params = SamplingParams(
                temperature=0.0, max_tokens=12, n=2, output_kind=RequestOutputKind.DELTA
            )
            texts = ["", ""]
            async for output in engine.generate(prompt, params, request_id):
                for completion in output.outputs:
                    texts[completion.index] += completion.text
            return texts

        results = await asyncio.gather(*(delta_text(p, f"r{i}") for i, p in enumerate(PROMPTS)))
        for prompt, texts in zip(PROMPTS, results, strict=True):
            assert texts == [expected[prompt]] * 2  # greedy: both sequences agree

        # closing the iterator early aborts the request and frees its blocks
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        generator = engine.generate("Once", long, "long")
        await generator.__anext__()
        await generator.aclose()
        await wait_idle(engine)

        # abort() from elsewhere ends the stream with a final "abort" output (vLLM)
        stream = engine.add_request("other", "Once", long)
        engine.abort_request("other")
        [final] = [output async for output in engine.iterate(stream)]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        await wait_idle(engine)

        # What the constructors accept crosses to the engine core, which stays up: truthy
        # flags (ignore_eos=1) and prompt token ids that are bools or int subclasses used to
        # fail msgspec's decoding in the core and kill it.
        loose = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=1, detokenize=1)
        final = await last(engine.generate("Once", loose, "loose"))
        assert len(final.outputs[0].token_ids) == 3
        ids = {"prompt_token_ids": [True, _Int(400), 300]}
        as_ints = await last(engine.generate({"prompt_token_ids": [1, 400, 300]}, loose, "i"))
        final = await last(engine.generate(ids, loose, "ids"))
        assert final.prompt_token_ids == [1, 400, 300]
        assert final.outputs[0].token_ids == as_ints.outputs[0].token_ids
        await engine.check_health()

        # A value that slips past every check fails decoding in the core: that message's
        # requests end as "abort" and the core stays up (it used to die).
        send_add = engine.core.send_add

        def corrupt(requests: list[Any]) -> None:
            for request in requests:
                request.sampling_params.ignore_eos = 1  # not a bool: msgspec refuses it
            send_add(requests)

        engine.core.send_add = corrupt  # type: ignore[method-assign]
        final = await last(engine.generate("Once", loose, "undecodable"))
        engine.core.send_add = send_add  # type: ignore[method-assign]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        await engine.check_health()
        await wait_idle(engine)

        with pytest.raises(InvalidRequestError, match="max_model_len"):
            await generator_first(engine.generate("x", SamplingParams(max_tokens=1000), "bad"))
        await engine.check_health()

    run_with_engine(run)


def run_with_engine(run: Any) -> None:
    """Run the coroutine function `run(engine)` on a fresh AsyncLLMEngine, then shut it down."""
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(**ENGINE_ARGS), log_stats=False)
    try:
        asyncio.run(asyncio.wait_for(run(engine), 120))
    finally:
        engine.shutdown()
    assert not engine.core.is_alive


class _Int(int):
    """An int subclass (as numpy's and others' integer types may be)."""


async def last(generator: Any) -> Any:
    """The last output of a stream."""
    outputs = [output async for output in generator]
    return outputs[-1]


async def generator_first(generator: Any) -> Any:
    async for output in generator:
        return output


async def wait_idle(engine: AsyncLLMEngine) -> None:
    metrics = engine.metrics
    for _ in range(200):
        if (
            metrics.num_requests_running._value.get() == 0
            and metrics.kv_cache_usage._value.get() == 0
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine did not become idle")


def test_engine_args_are_plain_data() -> None:
    """The core process receives EngineArgs as a dict; it must round-trip."""
    args = EngineArgs(**ENGINE_ARGS)
    assert EngineArgs(**dataclasses.asdict(args)) == args
