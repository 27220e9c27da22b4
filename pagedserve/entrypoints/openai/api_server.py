"""The OpenAI-compatible HTTP server: `build_app(engine, ...)` and the uvicorn entry point
(`python -m pagedserve.entrypoints.openai.api_server --model MODEL ...`)."""

import argparse
import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry

from pagedserve import envs
from pagedserve.engine.prompt_bound import check_prompt_chars
from pagedserve.entrypoints.chat_media import MediaOptions
from pagedserve.errors import EngineDeadError, ServerShuttingDownError
from pagedserve.version import __version__

from .body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware
from .dashboard import add_dashboard_route
from .error_handlers import add_error_handlers
from .openapi import (
    BODY_ERRORS,
    GENERATION_ERRORS,
    error_responses,
    install_openapi,
    streamed_or_whole,
)
from .operations import (
    APIKeyMiddleware,
    CorsOptions,
    LoadMiddleware,
    RootPathMiddleware,
    ServerLoad,
    add_cors,
    add_operation_routes,
    open_paths,
)
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from .server_metrics import add_metrics_route, add_process_metrics, instrument_http
from .serving import Engine, OpenAIError, check_model
from .serving_chat import TEXT_ONLY, OpenAIServingChat, chat_prompt
from .serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)


_DEATH_POLL_S = 0.2


async def _call_on_death(engine: Engine, on_engine_death: Callable[[], None]) -> None:
    """Poll the engine's health; once it is dead, call `on_engine_death`. The engine fails
    its pending requests when it notices the death (before check_health raises), so their
    handlers already hold their 503s when the server starts to shut down (uvicorn lets
    in-flight responses finish)."""
    while True:
        try:
            await engine.check_health()
        except EngineDeadError as e:
            logger.error(
                "the engine core died (%s); exiting so that a supervisor can restart the "
                "server (--keep-alive-on-engine-death keeps it answering 503 instead)",
                e,
            )
            on_engine_death()
            return
        await asyncio.sleep(_DEATH_POLL_S)


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where uvloop is installed (a dependency on Linux and macOS), else
    None: asyncio's own. What uvicorn's `loop="auto"` picks (and vLLM serves with); needed
    here because the server runs `Server.serve()` in a loop of its own making, where uvicorn's
    setting does not apply. httptools, its HTTP parser, uvicorn picks by itself."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def build_app(
    engine: Engine,
    served_model_names: list[str],
    *,
    api_key: str | list[str] | None = None,
    chat_template: str | None = None,
    registry: CollectorRegistry | None = None,
    model_root: str | None = None,
    on_engine_death: Callable[[], None] | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    cors: CorsOptions | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    root_path: str | None = None,
    protect_metrics: bool = False,
    media: MediaOptions = TEXT_ONLY,
) -> FastAPI:
    """The FastAPI app of one engine. `registry` holds the metrics that /metrics shows; the
    app adds its HTTP metrics to it (server_metrics.instrument_http).
    `cors`: the CORS policy (default: any origin, method and header, no credentials, as
    vLLM's defaults).

    enable_auto_tool_choice, tool_call_parser: the server flags of those names;
    reasoning_parser: the engine's --reasoning-parser (None: the engine config's, if any).
    root_path: --root-path, the prefix a proxy serves the API under; requests are served with
    it or without it (RootPathMiddleware).
    protect_metrics: --protect-metrics, /metrics needs the API key too (/dashboard, a page
    without data, stays open and asks for the key).
    media: the model's image support in chat messages (default: a text-only model; the
    server passes `MediaOptions.of_model`: --limit-mm-per-prompt, --allowed-local-media-path).
    Raises ValueError when the tokenizer lacks the reasoning parser's marker tokens.

    `on_engine_death` (None: keep answering 503) is called once, while the app runs, soon
    after the engine core dies; the pending requests have been failed by then."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        watcher = None
        if on_engine_death is not None:
            watcher = asyncio.create_task(_call_on_death(engine, on_engine_death))
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan)
    install_openapi(app)
    add_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    load = ServerLoad()
    app.add_middleware(LoadMiddleware, load=load)
    # As vLLM, an empty key is no key (no `Authorization: Bearer ` with nothing after it).
    api_keys = [key for key in ([api_key] if isinstance(api_key, str) else api_key or []) if key]
    if api_keys:  # added late, so it runs early: no body is read for an unauthorized request
        app.add_middleware(
            APIKeyMiddleware, api_keys=api_keys, open_paths=open_paths(protect_metrics)
        )
    # Outermost: a browser's preflight (OPTIONS, no API key) is answered here, and every
    # answer, 401s included, carries the CORS headers the page needs to read it.
    add_cors(app, cors or CorsOptions())
    # Outside the API key and CORS: 401s and preflights are counted too.
    instrument_http(app, registry)
    if root_path:  # outermost of all: every middleware and route sees the route's path
        app.add_middleware(RootPathMiddleware, root_path=root_path)
    # The model's generation-config defaults for fields a request leaves out (vLLM's
    # default_sampling_params); fakes in tests have no model config.
    model_config = getattr(engine, "model_config", None)
    defaults = model_config.get_diff_sampling_param() if model_config is not None else {}
    completions = OpenAIServingCompletion(engine, served_model_names, defaults)
    if reasoning_parser is None:  # the engine's own option (AsyncLLMEngine.config)
        config = getattr(engine, "config", None)
        reasoning_parser = getattr(
            getattr(config, "structured_outputs_config", None), "reasoning_parser", None
        )
    chat = OpenAIServingChat(
        engine, served_model_names, chat_template, defaults,
        enable_auto_tools=enable_auto_tool_choice, tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser, media=media,
    )  # fmt: skip
    tokenizer = engine.get_tokenizer()

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={**streamed_or_whole(CompletionResponse), **error_responses(*GENERATION_ERRORS)},
    )
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Any:
        return await completions.create_completion(request, raw_request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            **streamed_or_whole(ChatCompletionResponse),
            **error_responses(*GENERATION_ERRORS),
        },
    )
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Any:
        return await chat.create_chat_completion(request, raw_request)

    @app.get("/v1/models", responses=error_responses(401, 500))
    async def show_models() -> ModelList:
        cards = [
            ModelCard(id=name, root=model_root, max_model_len=engine.max_model_len)
            for name in served_model_names
        ]
        return ModelList(data=cards)

    def tokenize_sync(request: TokenizeChatRequest | TokenizeCompletionRequest) -> list[int]:
        if isinstance(request, TokenizeChatRequest):
            chat = chat_prompt(tokenizer, request, chat_template, engine.max_model_len, media)
            return chat.prompt_token_ids(media)  # with the images' tokens
        check_prompt_chars(tokenizer, request.prompt, engine.max_model_len)
        return list(tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))

    # Tokenizing, rendering templates and decoding run in a thread: on the event loop, a
    # megabyte prompt would hold up every other request (/health included) for seconds.
    @app.post("/tokenize", responses=error_responses(*BODY_ERRORS))
    async def tokenize(
        request: TokenizeChatRequest | TokenizeCompletionRequest,
    ) -> TokenizeResponse:
        check_model(request.model, served_model_names)
        token_ids = await asyncio.to_thread(tokenize_sync, request)
        return TokenizeResponse(
            count=len(token_ids), max_model_len=engine.max_model_len, tokens=token_ids
        )

    def detokenize_sync(tokens: list[int]) -> str:
        vocab_size = len(tokenizer)
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(400, f"token id {bad[0]} is outside [0, {vocab_size})", "tokens")
        text: str = tokenizer.decode(tokens)
        return text

    @app.post("/detokenize", responses=error_responses(*BODY_ERRORS))
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        check_model(request.model, served_model_names)
        return DetokenizeResponse(prompt=await asyncio.to_thread(detokenize_sync, request.tokens))

    # As vLLM's: 200 with an empty body, 503 once the engine core is dead.
    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "healthy (empty body)"}, **error_responses(503)},
    )
    async def health() -> Response:
        await engine.check_health()  # EngineDeadError -> 503
        return Response(status_code=200)

    add_operation_routes(app, engine, load)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    add_metrics_route(app, registry)
    add_dashboard_route(app)
    return app


def run_server(args: argparse.Namespace) -> None:
    """Start the engine core, then serve until SIGINT/SIGTERM; always stop the core."""
    import uvicorn

    from pagedserve.engine.arg_utils import engine_args_from_namespace
    from pagedserve.engine.async_engine import AsyncLLMEngine

    from .cli_args import check_server_args, resolve_server_args
    from .launch import (
        DrainingServer,
        bind_socket,
        read_chat_template,
        stop_signals_end_serving,
    )

    args = resolve_server_args(args)
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # as vLLM
    if args.skip_tokenizer_init:
        raise SystemExit("the server needs a tokenizer; drop --skip-tokenizer-init")
    # Bad flags end the command with one line naming them, not a traceback.
    try:
        check_server_args(args)
        envs.max_n_sequences()  # a bad PAGEDSERVE_MAX_N_SEQUENCES fails now, not per request
        envs.max_stop_strings()
        envs.max_stop_string_chars()
        chat_template = read_chat_template(args.chat_template)
        sock = bind_socket(args.host, args.port)
    except (ValueError, OSError) as e:
        raise SystemExit(f"pagedserve serve: error: {e}") from None
    from pagedserve.process_start import process_age_seconds

    age = process_age_seconds()
    logger.info(
        "starting the engine for %s%s; the server answers once it is ready",
        args.model,
        "" if age is None else f" ({age:.1f} s after the process started)",
    )
    try:
        engine = AsyncLLMEngine.from_engine_args(
            engine_args_from_namespace(args),
            log_requests=args.enable_log_requests and not args.disable_log_requests,
            log_stats=not args.disable_log_stats,
            log_stats_interval_s=args.stats_log_interval,
            served_model_name=args.served_model_name[0],
        )
    except (ValueError, NotImplementedError) as e:  # a bad option; an unsupported checkpoint
        sock.close()
        raise SystemExit(f"pagedserve serve: error: {e}") from None
    add_process_metrics(engine.metrics.registry)
    server: list[uvicorn.Server] = []  # made once the app exists
    died = False

    def exit_server() -> None:  # vLLM's default too (unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)
        server[0].should_exit = True

    try:
        try:
            app = build_app(
                engine,
                args.served_model_name,
                api_key=args.api_key,
                chat_template=chat_template,
                registry=engine.metrics.registry,
                model_root=args.model,
                on_engine_death=None if args.keep_alive_on_engine_death else exit_server,
                max_request_body_bytes=args.max_request_body_bytes,
                cors=CorsOptions(
                    args.allowed_origins or ["*"],
                    args.allowed_methods or ["*"],
                    args.allowed_headers or ["*"],
                    args.allow_credentials,
                ),
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser,
                root_path=args.root_path,
                protect_metrics=args.protect_metrics,
                media=MediaOptions.of_model(
                    engine.config.model_config, engine.input_processor.mm_processor
                ),
            )
        except ValueError as e:  # e.g. a reasoning parser whose markers the tokenizer lacks
            raise SystemExit(f"pagedserve serve: error: {e}") from None
        config = uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            root_path=args.root_path or "",
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
        stopping = ServerShuttingDownError("the server is shutting down")
        server.append(DrainingServer(config, lambda: engine.fail_running(stopping)))
        port = sock.getsockname()[1]  # the one the system chose for --port 0
        scheme = "https" if args.ssl_certfile else "http"
        url = f"{scheme}://{args.host}:{port}{args.root_path or ''}"
        age = process_age_seconds()
        since = "" if age is None else f" ({age:.1f} s after the process started)"
        logger.info("serving %s on %s%s", ", ".join(args.served_model_name), url, since)
        with (
            stop_signals_end_serving(server[0]),
            asyncio.Runner(loop_factory=event_loop_factory()) as runner,
        ):
            runner.run(server[0].serve(sockets=[sock]))
        died = engine.errored  # read before shutdown(), which ends the engine on purpose
    finally:
        engine.shutdown()
        sock.close()
    if died:
        # A nonzero status, so that supervisors restarting on failure (systemd's
        # Restart=on-failure) restart it.
        raise SystemExit("pagedserve serve: the engine core died; see the log above")


def main(argv: list[str] | None = None) -> int:
    from .cli_args import add_server_args

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m pagedserve.entrypoints.openai.api_server",
        description="OpenAI-compatible server (completions, chat, models, tokenize, metrics).",
    )
    from pagedserve.entrypoints.argv import normalize_argv

    add_server_args(parser)
    run_server(parser.parse_args(normalize_argv(sys.argv[1:] if argv is None else argv, parser)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
