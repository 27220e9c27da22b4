"""RequestStream's merging of queued outputs (vLLM's RequestOutputCollector) and
RequestOutput.add, which it merges with."""

import asyncio

import pytest

from pagedserve.engine.request_stream import RequestStream
from pagedserve.errors import EngineDeadError
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import RequestOutputKind


def output(
    pieces: list[tuple[int, str, list[int]]],  # (index, text, token ids) per completion
    finished: bool = False,
    finish_reason: str | None = None,
    prompt_logprobs: list | None = None,  # type: ignore[type-arg]
) -> RequestOutput:
    completions = [
        CompletionOutput(
            index=index,
            text=text,
            token_ids=list(tokens),
            cumulative_logprob=-float(len(tokens)),
            logprobs=[{t: Logprob(-1.0, 1, str(t))} for t in tokens],
            finish_reason=finish_reason,
        )
        for index, text, tokens in pieces
    ]
    return RequestOutput("r", None, [1, 2], prompt_logprobs, completions, finished)


def test_add_aggregates_deltas_by_completion_index() -> None:
    """Text, tokens and logprobs append per index (a new index is appended); the newest
    finish reason, cumulative logprob and finished flag win; the first prompt logprobs stay."""
    first = output([(0, "a", [1]), (1, "x", [7])], prompt_logprobs=[None, {2: Logprob(-0.5)}])
    first.add(output([(1, "y", [8, 9]), (0, "b", [2])], prompt_logprobs=[]), aggregate=True)
    first.add(output([(2, "z", [5])], finished=True, finish_reason="length"), aggregate=True)
    texts = [(c.index, c.text, c.token_ids, len(c.logprobs or [])) for c in first.outputs]
    assert texts == [(0, "ab", [1, 2], 2), (1, "xy", [7, 8, 9], 3), (2, "z", [5], 1)]
    assert first.outputs[1].cumulative_logprob == -2.0  # the newest
    assert first.finished and first.outputs[2].finish_reason == "length"
    assert first.prompt_logprobs == [None, {2: Logprob(-0.5)}]


def test_add_without_aggregate_keeps_the_newest_completion() -> None:
    first = output([(0, "a", [1])])
    first.add(output([(0, "ab", [1, 2])], finished=True, finish_reason="stop"), aggregate=False)
    assert [(c.text, c.token_ids, c.finish_reason) for c in first.outputs] == [
        ("ab", [1, 2], "stop")
    ]
    assert first.finished


def drain(stream: RequestStream) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [item async for item in stream]

    return asyncio.run(run())


def test_queued_delta_outputs_come_out_as_one() -> None:
    """Three DELTA outputs queued before the consumer reads arrive as one, with every token;
    the stream ends with the finished one."""
    stream = RequestStream("r", RequestOutputKind.DELTA)
    for i in range(3):
        stream.queue.put_nowait(output([(0, str(i), [i])]))
    stream.queue.put_nowait(output([(0, "!", [9])], finished=True, finish_reason="stop"))
    (merged,) = drain(stream)
    assert (merged.outputs[0].text, merged.outputs[0].token_ids) == ("012!", [0, 1, 2, 9])
    assert merged.finished and stream.finished


def test_an_output_read_at_once_is_not_held_back() -> None:
    """The merge takes only what is already queued: a consumer that keeps up gets every
    output on its own."""

    async def run() -> list[str]:
        stream = RequestStream("r", RequestOutputKind.DELTA)
        texts = []
        for i, last in ((0, False), (1, False), (2, True)):
            stream.queue.put_nowait(output([(0, str(i), [i])], finished=last))
            texts.append((await stream.__anext__()).outputs[0].text)
        return texts

    assert asyncio.run(run()) == ["0", "1", "2"]


def test_cumulative_outputs_keep_the_newest_and_none_keeps_all() -> None:
    stream = RequestStream("r", RequestOutputKind.CUMULATIVE)
    stream.queue.put_nowait(output([(0, "a", [1])]))
    stream.queue.put_nowait(output([(0, "ab", [1, 2])], finished=True))
    assert [o.outputs[0].text for o in drain(stream)] == ["ab"]
    stream = RequestStream("r")  # no kind: every output as queued
    stream.queue.put_nowait(output([(0, "a", [1])]))
    stream.queue.put_nowait(output([(0, "b", [2])], finished=True))
    assert [o.outputs[0].text for o in drain(stream)] == ["a", "b"]


def test_an_error_behind_queued_outputs_comes_after_them() -> None:
    """Outputs queued before an error (the engine's death) are delivered, merged; the error
    is raised by the next read."""

    async def run() -> tuple[str, bool]:
        stream = RequestStream("r", RequestOutputKind.DELTA)
        stream.queue.put_nowait(output([(0, "a", [1])]))
        stream.queue.put_nowait(output([(0, "b", [2])]))
        stream.queue.put_nowait(EngineDeadError("gone"))
        first = await stream.__anext__()
        with pytest.raises(EngineDeadError, match="gone"):
            await stream.__anext__()
        return first.outputs[0].text, stream.finished

    assert asyncio.run(run()) == ("ab", True)


def test_a_long_backlog_merges_whole() -> None:
    """10,000 queued DELTA outputs (a client that stopped reading) merge into one with every
    token, logprob and character, in order."""
    stream = RequestStream("r", RequestOutputKind.DELTA)
    for i in range(10_000):
        stream.queue.put_nowait(output([(0, "ab", [i])], finished=i == 9_999))
    (merged,) = drain(stream)
    completion = merged.outputs[0]
    assert completion.token_ids == list(range(10_000))
    assert len(completion.logprobs or []) == 10_000 and completion.text == "ab" * 10_000
