"""`GET /dashboard`: a live page of the server's own /metrics.

The page (static/dashboard.html) is plain HTML, CSS and JavaScript in one file, with no build
step and nothing loaded from elsewhere: it polls /metrics (Prometheus text), keeps a few
minutes of samples and draws its charts as inline SVG. It holds no data itself, so it is open
even with --protect-metrics; it then asks for the API key and sends it on its fetches.
"""

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

# Nothing but the page itself and its same-origin fetches of /metrics: no CDN can be used.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def dashboard_html() -> str:
    """The page, as the package ships it."""
    return (files(__package__) / "static" / "dashboard.html").read_text(encoding="utf-8")


def add_dashboard_route(app: FastAPI) -> None:
    """GET /dashboard: the page (read once, now)."""
    html = dashboard_html()
    headers = {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)
