"""Operations endpoints and middleware of the server (vLLM's): API keys, CORS, `/ping`,
`/load`.

Source: vLLM's api_server (`--api-key` taking several keys, `/ping` for SageMaker-style
probes answering as `/health`, `/load` with the in-flight generation requests).
"""

import hmac
from dataclasses import dataclass, field

from fastapi import FastAPI, Response
from starlette._utils import get_route_path
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .serving import Engine, error_body

# Reachable without the API key (probes, scrapers, and the dashboard's page, which holds no
# data: it reads /metrics); /metrics needs the key too with --protect-metrics.
OPEN_PATHS = ("/health", "/ping", "/metrics", "/dashboard")
METRICS_PATH = "/metrics"


def open_paths(protect_metrics: bool) -> tuple[str, ...]:
    """The paths the API key does not guard: OPEN_PATHS, less /metrics if `protect_metrics`."""
    return tuple(p for p in OPEN_PATHS if not (protect_metrics and p == METRICS_PATH))


# The routes that generate: what /load counts while they run (a stream until its last chunk).
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _without_prefix(path: str, prefix: str) -> str:
    """`path` without a leading `prefix` (a whole path segment: "/llm" is not the prefix of
    "/llmx")."""
    if prefix and (path == prefix or path.startswith(prefix + "/")):
        return path[len(prefix) :] or "/"
    return path


class RootPathMiddleware:
    """`--root-path PREFIX` (vLLM's, an ASGI root_path): a request is served whether the
    proxy in front stripped the prefix (`/v1/models`) or not (`/PREFIX/v1/models`). Outermost:
    it gives the scope the ASGI form (`root_path` PREFIX, `path` PREFIX + the route's path,
    once), so that the other middlewares (API keys, /load) and the routes all see the route's
    path (starlette's get_route_path), and the OpenAPI document names the prefix."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or not self.root_path:
            await self.app(scope, receive, send)
            return
        given = scope.get("root_path", "")  # uvicorn's --root-path: already in `path`
        route = _without_prefix(_without_prefix(scope["path"], given), self.root_path)
        scope = {**scope, "root_path": self.root_path, "path": self.root_path + route}
        if "raw_path" in scope and scope["raw_path"] is not None:
            raw = scope["raw_path"].decode("latin-1")
            raw = _without_prefix(_without_prefix(raw, given), self.root_path)
            scope["raw_path"] = (self.root_path + raw).encode("latin-1")
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer KEY` for one of `api_keys`, compared in constant
    time, on every path but `open_paths`. A plain ASGI middleware (not BaseHTTPMiddleware),
    so that streaming and disconnects pass through."""

    def __init__(
        self, app: ASGIApp, api_keys: list[str], open_paths: tuple[str, ...] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or get_route_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        # Every key is compared (no early exit), so that the time says nothing of which.
        matches = [hmac.compare_digest(given, expected) for expected in self.expected]
        if not any(matches):
            message = "missing or invalid API key; send `Authorization: Bearer <key>`"
            await JSONResponse(error_body(401, message), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class CorsOptions:
    """vLLM's `--allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials`."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def add_cors(app: FastAPI, options: CorsOptions) -> None:
    """Starlette's CORSMiddleware with `options` (as vLLM adds it)."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=options.allowed_origins,
        allow_methods=options.allowed_methods,
        allow_headers=options.allowed_headers,
        allow_credentials=options.allow_credentials,
    )


class ServerLoad:
    """In-flight generation requests (vLLM's `server_load`), kept by `LoadMiddleware`."""

    def __init__(self) -> None:
        self.in_flight = 0


class LoadMiddleware:
    """Counts a request to a GENERATION_PATHS route from its arrival until its response's
    last body chunk is sent, or it ends otherwise (error, client gone)."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or get_route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self.load.in_flight -= 1

        async def counted_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()

        try:
            await self.app(scope, receive, counted_send)
        finally:
            finish()


def add_operation_routes(app: FastAPI, engine: Engine, load: ServerLoad) -> None:
    """`GET|POST /ping` (as /health: 200 empty, 503 once the engine core is dead),
    `GET /load` (`{"server_load": in-flight generation requests}`) and
    `POST /reset_prefix_cache` (200 empty; vLLM's, which it serves in its dev mode only: the
    prefix cache forgets the blocks no request holds, so a benchmark can start cold)."""

    @app.post("/reset_prefix_cache", response_class=Response,
              responses={200: {"description": "reset (empty body)"}})  # fmt: skip
    async def reset_prefix_cache() -> Response:
        await engine.reset_prefix_cache()  # EngineDeadError -> 503
        return Response(status_code=200)

    async def ping() -> Response:
        await engine.check_health()  # EngineDeadError -> 503
        return Response(status_code=200)

    app.add_api_route(
        "/ping", ping, methods=["GET", "POST"], response_class=Response,
        responses={200: {"description": "healthy (empty body)"}},
    )  # fmt: skip

    @app.get("/load")
    async def server_load() -> dict[str, int]:
        return {"server_load": load.in_flight}
