"""Work that must not run on the event loop (tokenizing), stopped when its client leaves."""

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request

from .serving import OpenAIError

_T = TypeVar("_T")


class Cancelled(Exception):
    """Raised by work run by `run_off_loop` once its client is gone."""


async def run_off_loop(raw_request: Request, work: Callable[[threading.Event], _T]) -> _T:
    """`work(cancelled)` in a thread, off the event loop (tokenizing megabytes there would
    stall every other request). If the client disconnects first, `cancelled` is set, so that
    the work stops at its next check (between prompts, before encoding: one tokenizer call
    cannot be interrupted, but the prompt bound keeps it short), and this raises OpenAIError
    499, which nobody reads."""
    cancelled = threading.Event()

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(asyncio.to_thread(work, cancelled))
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    cancelled.set()
    # The thread ends by itself (Cancelled, at its next check): retrieve what it raises.
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    raise OpenAIError(499, "the client disconnected")
