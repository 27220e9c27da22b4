"""The published OpenAPI document (`/openapi.json`) made to match what the server answers:
FastAPI documents its own 422 for invalid requests, which this server answers with an
OpenAI-style 400, and knows nothing of the statuses that the handlers, the middlewares and
the error mapping send. A test fuzzes the server against this document (schemathesis)."""

import re
import warnings
from collections import Counter
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .protocol import ErrorResponse

_DESCRIPTIONS = {
    400: "invalid request (OpenAI-style error body naming `param`)",
    401: "missing or wrong API key (only with --api-key)",
    404: "unknown model",
    413: "request body larger than --max-request-body-bytes",
    429: "the engine is overloaded",
    500: "a server bug (the details are in the server log)",
    503: "the engine core has died",
}

# What each kind of route may answer besides its success.
BODY_ERRORS = (400, 401, 404, 413, 500)  # a route with a request body
GENERATION_ERRORS = (*BODY_ERRORS, 429, 503)  # one that sends requests to the engine


def error_responses(*status_codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a FastAPI route: an ErrorResponse body for each status code."""
    return {
        code: {"model": ErrorResponse, "description": _DESCRIPTIONS[code]} for code in status_codes
    }


def streamed_or_whole(model: type[Any]) -> dict[int | str, dict[str, Any]]:
    """`responses=` of the 200 of a route that streams server-sent events on `stream: true`."""
    return {
        200: {
            "model": model,
            "description": "the response; with `stream: true`, server-sent events",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        }
    }


_METHOD_SUFFIX = re.compile(r"_(get|put|post|delete|options|head|patch|trace)$")


def unique_operation_ids(schema: dict[str, Any]) -> None:
    """Give each operation of `schema` (an OpenAPI document, changed in place) its own
    operationId. FastAPI gives all methods of a multi-method route (`GET|POST /ping`) the
    route's one id, ending in one of its methods (the first of a set: either, per process);
    each of those operations gets its own method as suffix instead (`ping_ping_get`,
    `ping_ping_post`). Raises AssertionError if ids still repeat (two routes named alike)."""
    operations = [
        (method, operation)
        for path in schema.get("paths", {}).values()
        for method, operation in path.items()
        if isinstance(operation, dict) and "operationId" in operation
    ]
    counts = Counter(operation["operationId"] for _, operation in operations)
    for method, operation in operations:
        if counts[operation["operationId"]] > 1:
            stem = _METHOD_SUFFIX.sub("", operation["operationId"])
            operation["operationId"] = f"{stem}_{method}"
    counts = Counter(operation["operationId"] for _, operation in operations)
    repeated = sorted(op_id for op_id, count in counts.items() if count > 1)
    if repeated:
        raise AssertionError(f"duplicate operationIds: {repeated}")


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` by one that documents 400 (ErrorResponse) where FastAPI
    documents its 422 (the server never sends 422: invalid requests get 400), and gives
    each operation its own operationId (`unique_operation_ids`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # unique_operation_ids repairs these, or raises
                warnings.filterwarnings("ignore", message="Duplicate Operation ID")
                schema = get_openapi(
                    title=app.title,
                    version=app.version,
                    routes=app.routes,
                    description=None,
                    servers=app.servers or None,  # e.g. --root-path's prefix, as FastAPI adds
                )
            unique_operation_ids(schema)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None and "400" not in responses:
                        raise AssertionError(f"{operation.get('operationId')}: no 400 documented")
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
