"""The request-body size limit (`--max-request-body-bytes`): 413 with an OpenAI-style body."""

from fastapi import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .cli_args import DEFAULT_MAX_REQUEST_BODY_BYTES as DEFAULT_MAX_REQUEST_BODY_BYTES
from .serving import error_body


class BodySizeLimitMiddleware:
    """413 for a body over `max_bytes`: at once when Content-Length says so (nothing is
    read), else as soon as a streamed (chunked) body passes the limit, before the rest is
    read or parsed. A plain ASGI middleware, so that streaming responses pass through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (
            f"the request body is larger than this server's limit of {self.max_bytes} bytes "
            f"(--max-request-body-bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            body = error_body(413, self._message())
            await JSONResponse(body, status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the request's body read: the app's HTTPException handler
                    # answers it like any other error.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)
