"""GET /dashboard: the page, and who may read it and /metrics (in process, on the fake
engine). test_dashboard_browser.py runs the page in Chromium."""

import argparse
import fnmatch
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.entrypoints.openai.cli_args import (
    add_server_args,
    check_server_args,
    resolve_server_args,
)
from pagedserve.entrypoints.openai.dashboard import dashboard_html

from .in_process import InProcessApp

REPO = Path(__file__).resolve().parents[3]


def test_the_page_is_served_self_contained() -> None:
    html = dashboard_html()
    assert html.startswith("<!doctype html>")
    # Nothing loaded from elsewhere: no script, stylesheet or image source but the page.
    for marker in ("<script src", "<link", "http://", "https://", "<img"):
        assert marker not in html.replace('"http://www.w3.org/2000/svg"', ""), marker


def test_dashboard_is_open_by_default_even_with_an_api_key(
    fake_app_factory: Callable[..., InProcessApp],
) -> None:
    for api_key in (None, "secret"):
        app = fake_app_factory(api_key=api_key)
        page = app.get("/dashboard", headers={})
        assert page.status_code == 200, (api_key, page.text)
        assert page.headers["content-type"].startswith("text/html")
        assert page.text == dashboard_html()
        assert "connect-src 'self'" in page.headers["content-security-policy"]
        assert app.get("/metrics", headers={}).status_code == 200, api_key
        assert "/dashboard" not in app.get("/openapi.json", headers={}).text


def test_protect_metrics_puts_metrics_behind_the_key_and_not_the_page(
    fake_app_factory: Callable[..., InProcessApp],
) -> None:
    """With --protect-metrics, /metrics needs the key; the page (no data, and a browser's
    navigation cannot send a Bearer header) stays open, asking for the key."""
    app = fake_app_factory(api_key="secret", protect_metrics=True)
    key = {"Authorization": "Bearer secret"}
    assert app.get("/metrics", headers={}).status_code == 401
    assert app.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert app.get("/metrics", headers=key).status_code == 200
    page = app.get("/dashboard", headers={})
    assert page.status_code == 200 and 'id="api-key"' in page.text
    assert app.get("/health", headers={}).status_code == 200  # probes stay open


def test_protect_metrics_needs_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    parser = add_server_args(argparse.ArgumentParser())
    args = resolve_server_args(parser.parse_args(["--protect-metrics"]))
    with pytest.raises(ValueError, match="--protect-metrics requires --api-key"):
        check_server_args(args)
    check_server_args(
        resolve_server_args(parser.parse_args(["--protect-metrics", "--api-key", "k"]))
    )


def test_the_package_data_ships_the_page() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["pagedserve.entrypoints.openai"]
    static = REPO / "pagedserve" / "entrypoints" / "openai" / "static"
    for path in static.iterdir():
        name = f"static/{path.name}"
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


def test_behind_a_root_path_the_page_reads_the_prefixed_metrics(
    fake_app_factory: Callable[..., InProcessApp],
) -> None:
    """Under --root-path /llm the page is /llm/dashboard, and its relative fetch of "metrics"
    resolves to /llm/metrics."""
    app = fake_app_factory(api_key="secret", root_path="/llm")
    assert app.get("/llm/dashboard", headers={}).status_code == 200
    assert app.get("/llm/metrics", headers={}).status_code == 200
    assert 'fetch("metrics"' in dashboard_html()
