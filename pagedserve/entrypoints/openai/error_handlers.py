"""How the server answers an error: every exception handler of the app, each writing the
OpenAI error body (status, message, the parameter at fault)."""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.errors import PagedServeError

from .serving import OpenAIError, error_body, to_openai_error

logger = logging.getLogger(__name__)


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status_code, str(error), error.param), status_code=error.status_code
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return f"the body is not valid JSON: {reason}".rstrip(": "), None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    return f"{where}{first.get('msg', 'invalid value')}", param


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error in the OpenAI error format: a bad body 400 (naming the field),
    Starlette's HTTP errors with their status, OpenAIError and PagedServeError by class
    (serving.to_openai_error), and anything else 500 with its traceback logged."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(OpenAIError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _error_response(OpenAIError(exc.status_code, str(exc.detail)))
        response.headers.update(exc.headers or {})  # a 405's `Allow`
        return response

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        error = to_openai_error(exc)
        if error.status_code >= 500:
            logger.error("request failed: %s", exc, exc_info=error.status_code == 500)
        return _error_response(error)

    # Expected errors by class; anything else is a bug: 500, logged with its traceback.
    for error_class in (OpenAIError, PagedServeError, Exception):
        app.add_exception_handler(error_class, on_error)
