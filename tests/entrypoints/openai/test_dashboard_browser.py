"""The /dashboard page in headless Chromium (driven by playwright, through the system's
chromium: nothing is downloaded) against a real server under a known workload."""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from .conftest import API_KEY

REPO = Path(__file__).resolve().parents[3]
# The docs' screenshot, rewritten only on request (a test run leaves the checkout clean).
DOCS_SCREENSHOT = REPO / "docs" / "dashboard.png"
UPDATE_SCREENSHOT_ENV = "PAGEDSERVE_UPDATE_DOCS_SCREENSHOT"
NUM_REQUESTS = 8
MAX_TOKENS = 16
# Shared by the prompts: full blocks (16 tokens) the later requests find in the prefix cache.
PREFIX = "Once upon a time there was a little server that counted tokens all day long. " * 3
MODEL_NAME = "tiny-llama"
WAIT_MS = 60_000  # every wait on the page; nothing may hang CI


def metrics(url: str) -> dict[str, float]:
    """/metrics (with the key) as {name: value}, summed over label sets."""
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def dom_value(page: Page, element_id: str) -> str:
    value = page.get_attribute(f"#{element_id}", "data-value")
    assert value is not None, element_id
    return value


def next_scrape(page: Page) -> None:
    """Wait until the page has read /metrics again."""
    scrapes = page.get_attribute("body", "data-scrapes")
    wait_for(page, f"body:not([data-scrapes='{scrapes}'])")


def wait_for(page: Page, selector: str) -> None:
    page.locator(selector).wait_for(state="attached", timeout=WAIT_MS)


def chart_values(page: Page, chart: str, series: str) -> list[float | None]:
    values = page.get_attribute(f"#chart-{chart} path[data-series={series}]", "data-values")
    assert values is not None, (chart, series)
    parsed: list[float | None] = json.loads(values)
    return parsed


def check_quantiles_as_prometheus(page: Page) -> None:
    """The page's histogram_quantile on buckets worked by hand: interpolated within the
    bucket the rank falls in, the highest finite bound in +Inf, none without observations."""
    cases: list[tuple[float, list[tuple[float, int]], float | None]] = [
        (0.5, [(0.1, 2), (0.5, 6), (1.0, 8), (float("inf"), 10)], 0.1 + 0.4 * 3 / 4),
        (0.99, [(0.1, 2), (0.5, 6), (1.0, 8), (float("inf"), 10)], 1.0),
        (0.5, [(0.1, 4), (0.5, 4), (float("inf"), 4)], 0.05),
        (0.25, [(0.2, 0), (0.4, 8), (float("inf"), 8)], 0.2 + 0.2 * 2 / 8),
        (0.5, [(0.1, 0), (float("inf"), 0)], None),
    ]
    for q, cumulative, expected in cases:
        got = page.evaluate(
            "([q, b]) => pagedserveDashboard.histogramQuantile(q, "
            "b.map(([le, count]) => ({le: le === null ? Infinity : le, count})))",
            [q, [[None if le == float("inf") else le, count] for le, count in cumulative]],
        )
        assert got == pytest.approx(expected) if expected is not None else got is None, (
            q,
            cumulative,
            got,
        )


def check_mean_percent(page: Page) -> None:
    """The page's mean of a 0..1 histogram between two scrapes, in %: the observations added
    (all of them without an earlier scrape); none without observations or across a server's
    restart, also one whose new steps outnumber the old ones (a negative mean before)."""
    cases: list[tuple[list[float], list[float] | None, float | None]] = [
        ([3.0, 10.0], [1.0, 6.0], 50.0),
        ([3.0, 10.0], None, 30.0),
        ([3.0, 10.0], [3.0, 10.0], None),
        ([0.5, 2.0], [3.0, 10.0], None),
        ([0.5, 12.0], [3.0, 10.0], None),
    ]
    for now, before, expected in cases:
        got = page.evaluate(
            "([n, b]) => pagedserveDashboard.meanPercent({mbuSum: n[0], mbuCount: n[1]}, "
            "b && {mbuSum: b[0], mbuCount: b[1]}, 'mbu')",
            [now, before],
        )
        assert got == pytest.approx(expected) if expected is not None else got is None, (
            now,
            before,
            got,
        )


def check_parsing(page: Page) -> None:
    """The page's parser on the text format's corners: escaped quotes, braces and backslashes
    in label values, +Inf, exponents, a timestamp after the value, comments."""
    text = "\n".join(
        [
            '# HELP a_bucket help with } and " in it',
            "# TYPE a_bucket histogram",
            'a_bucket{x="q\\"}\\\\",le="+Inf"} 3',
            "b:c_total 1.5e+06 1712345678000",
            "",
            'd{le="0.25"} NaN',
        ]
    )
    samples = page.evaluate("(t) => pagedserveDashboard.parsePrometheus(t)", text)
    assert samples[0] == {"name": "a_bucket", "labels": {"x": 'q"}\\', "le": "+Inf"}, "value": 3}
    assert samples[1] == {"name": "b:c_total", "labels": {}, "value": 1.5e6}
    assert samples[2]["name"] == "d" and samples[2]["labels"] == {"le": "0.25"}
    assert len(samples) == 3


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="chromium is not installed (apt-get install chromium; .ci/run installs it)",
)
def test_the_page_in_chromium_shows_a_known_workload(
    server_factory: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fresh server with --protect-metrics; the page asks for the key, then, fed it, shows
    8 completions of 16 tokens: the totals equal the server's counters, the throughput chart
    rises, TTFT and TPOT have estimates, MBU and MFU (against peaks the environment gives
    the CPU) equal the server's. Takes a screenshot, copied to docs/dashboard.png when
    PAGEDSERVE_UPDATE_DOCS_SCREENSHOT=1."""
    screenshot = tmp_path / "dashboard.png"
    monkeypatch.setenv("PAGEDSERVE_PEAK_BANDWIDTH", "2e10")  # a CPU has no peaks of its own
    monkeypatch.setenv("PAGEDSERVE_PEAK_FLOPS", "5e10")
    args = ["--protect-metrics", "--served-model-name", MODEL_NAME]
    server = server_factory("llama3", API_KEY, args)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=shutil.which("chromium"),
                args=["--headless=new", "--no-sandbox", "--disable-gpu"],
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 860})
                errors: list[str] = []
                page.on("pageerror", lambda error: errors.append(str(error)))
                page.on(
                    "console",
                    lambda m: errors.append(m.text) if "Content Security" in m.text else None,
                )
                page.goto(f"{server.url}/dashboard?history=60", timeout=WAIT_MS)
                # (selectors, not wait_for_function: the page's CSP forbids eval)
                wait_for(page, "#status.error")
                assert "API key" in page.inner_text("#status")
                page.fill("#api-key", API_KEY)
                page.click("#key-form button")
                wait_for(page, "body[data-scrapes]")  # a first scrape, with the key
                assert dom_value(page, "total-generation-tokens") == "0"

                def complete(i: int) -> None:
                    response = server.post(
                        "/v1/completions",
                        {
                            "model": MODEL_NAME, "prompt": f"{PREFIX}Request {i} counts to",
                            "max_tokens": MAX_TOKENS, "ignore_eos": True,
                        },
                    )  # fmt: skip
                    assert response.status_code == 200, response.text

                # Two waves, a scrape after each (so the charts show both).
                with ThreadPoolExecutor(NUM_REQUESTS // 2) as pool:
                    for wave in range(2):
                        wave_ids = range(wave * NUM_REQUESTS // 2, (wave + 1) * NUM_REQUESTS // 2)
                        list(pool.map(complete, wave_ids))
                        next_scrape(page)
                counters = metrics(server.url)
                generated = counters["pagedserve:generation_tokens_total"]
                assert generated == NUM_REQUESTS * MAX_TOKENS
                wait_for(page, f"#total-generation-tokens[data-value='{int(generated)}']")
                # A scrape after the workload: running back to 0.
                wait_for(page, "#running[data-value='0']")
                prompt = dom_value(page, "total-prompt-tokens")
                assert float(prompt) == counters["pagedserve:prompt_tokens_total"] > 0
                assert dom_value(page, "waiting") == "0"
                assert page.inner_text("#model") == MODEL_NAME
                queries = counters["pagedserve:prefix_cache_queries_total"]
                hits = counters["pagedserve:prefix_cache_hits_total"]
                assert queries > 0
                hit_rate = float(dom_value(page, "prefix-cache-hit-rate"))
                assert hit_rate == pytest.approx(100 * hits / queries)
                for chart, series in [("throughput", "generation"), ("throughput", "prompt")]:
                    values = [v for v in chart_values(page, chart, series) if v is not None]
                    assert values and max(values) > 0, (chart, series, values)
                for estimate in ("ttft", "tpot"):
                    p99 = [v for v in chart_values(page, estimate, "p99") if v is not None]
                    p50 = [v for v in chart_values(page, estimate, "p50") if v is not None]
                    assert p50 and max(p50) > 0, estimate
                    assert all(a <= b for a, b in zip(p50, p99, strict=True)), estimate
                mbu_mean = (
                    100
                    * counters["pagedserve:step_mbu_sum"]
                    / counters["pagedserve:step_mbu_count"]
                )
                assert float(dom_value(page, "roofline")) == pytest.approx(mbu_mean)
                for series in ("MBU", "MFU"):
                    values = [v for v in chart_values(page, "roofline", series) if v is not None]
                    assert values and min(values) > 0, (series, values)
                kv = [v for v in chart_values(page, "kv-cache", "used") if v is not None]
                assert kv and all(0 <= v <= 100 for v in kv)
                check_quantiles_as_prometheus(page)
                check_parsing(page)
                check_mean_percent(page)
                assert errors == []
                next_scrape(page)
                page.screenshot(path=str(screenshot), full_page=True)
            finally:
                browser.close()
    finally:
        server.stop()
    assert screenshot.read_bytes().startswith(b"\x89PNG")
    if os.environ.get(UPDATE_SCREENSHOT_ENV) == "1":
        shutil.copyfile(screenshot, DOCS_SCREENSHOT)
