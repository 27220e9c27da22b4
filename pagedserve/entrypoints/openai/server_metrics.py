"""The server's /metrics: the engine's collectors, HTTP metrics by route and status
(prometheus-fastapi-instrumentator, as vLLM) and the process's CPU and memory, in one output."""

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_fastapi_instrumentator import Instrumentator

# Routes left out of the HTTP metrics (vLLM leaves out the same kinds): probes and scrapes.
_NOT_COUNTED = ["^/metrics$", "^/health$", "^/load$", "^/ping$", "^/version$"]


def instrument_http(app: FastAPI, registry: CollectorRegistry | None) -> None:
    """Count `app`'s requests into `registry` (nothing without one) by route template,
    method and status class: `http_requests_total`, `http_request_duration_seconds`,
    `http_request_size_bytes`, ... Paths that match no route count as handler "none"."""
    if registry is not None:  # (the middleware makes its collectors when the app starts)
        Instrumentator(excluded_handlers=_NOT_COUNTED, registry=registry).instrument(app)


def add_metrics_route(app: FastAPI, registry: CollectorRegistry | None) -> None:
    """GET /metrics: `registry` in Prometheus's text format (empty without one)."""

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus metrics, in its text format",
                "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics() -> Response:
        data = generate_latest(registry) if registry is not None else b""
        return Response(content=data, media_type=CONTENT_TYPE_LATEST)


def add_process_metrics(registry: CollectorRegistry) -> None:
    """The process's CPU seconds, memory bytes and open files (`process_*`), Python's
    version (`python_info`) and garbage collections (`python_gc_*`): what vLLM's /metrics
    shows from prometheus_client's default registry. Call once per registry."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
