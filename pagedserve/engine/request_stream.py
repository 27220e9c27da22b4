"""RequestStream: the outputs of one AsyncLLMEngine request, as an async iterator."""

import asyncio

from pagedserve.outputs import RequestOutput


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    It ends after the output with `finished=True`, which an abort sends too (finish_reason
    "abort", as vLLM); it raises EngineDeadError if the engine core dies or the engine is
    shut down first.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item
