"""Typed errors of the engine; the server maps them to HTTP status codes."""


class PagedServeError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(PagedServeError, ValueError):
    """Bad user input (prompt too long, invalid sampling parameters, ...). HTTP 400.

    Subclasses `ValueError` so that offline users can catch the usual Python error. `param`
    names the request field at fault (the OpenAI error body's "param"), when one is.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineOverloadedError(PagedServeError):
    """The engine cannot take more requests now. HTTP 429."""


class EngineDeadError(PagedServeError):
    """The engine loop or a worker died; in-flight requests cannot finish. HTTP 503."""


class RequestFailedError(PagedServeError):
    """An internal error (e.g. detokenizing its output) ended one request; the engine and
    the other requests go on. HTTP 500 (not 499: the client did not leave)."""


class ServerShuttingDownError(PagedServeError):
    """The server is stopping (SIGTERM/SIGINT) and a request was still running when its
    drain period ended; the engine itself is fine. HTTP 503."""


class UnsupportedModelError(PagedServeError, ValueError):
    """The model folder is missing or names an architecture we do not implement."""
