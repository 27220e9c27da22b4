"""RequestStream: the outputs of one AsyncLLMEngine request, as an async iterator."""

import asyncio

from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    It ends after the output with `finished=True`, which an abort sends too (finish_reason
    "abort", as vLLM); it raises EngineDeadError if the engine core dies or the engine is
    shut down first. Outputs that queued up while the consumer was busy come out as one
    (vLLM's RequestOutputCollector): a DELTA output absorbs the next ones
    (`RequestOutput.add`), a cumulative one is replaced by the newest. A client that falls
    behind then gets one chunk, one socket write, for several engine steps.
    """

    def __init__(self, request_id: str, output_kind: RequestOutputKind | None = None) -> None:
        """`output_kind`: the request's (SamplingParams.output_kind), which says how queued
        outputs merge; None yields every output as it was queued."""
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.merge = output_kind is not None
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._error: BaseException | None = None  # queued behind outputs already merged

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = self._error if self._error is not None else await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        backlog: list[RequestOutput] = []
        last = item
        while self.merge and not last.finished and not self.queue.empty():
            following = self.queue.get_nowait()
            if isinstance(following, BaseException):
                self._error = following  # raised by the next call, after these outputs
                break
            backlog.append(following)
            last = following
        if backlog:
            item.add_all(backlog, self.aggregate)
        self.finished = item.finished
        return item
