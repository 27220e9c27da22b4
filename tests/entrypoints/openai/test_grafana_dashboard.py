"""The example Grafana dashboard (examples/grafana/) asks only for series and labels that a
real server's /metrics exposes, under their exact exposed names."""

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import REPO

DASHBOARD = REPO / "examples" / "grafana" / "pagedserve_dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
METRIC = re.compile(r"pagedserve:[a-zA-Z_:][a-zA-Z0-9_:]*")
# a series name, its selector if any: pagedserve:x_total{model_name="$model_name"}
SERIES = re.compile(r"(pagedserve:[a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?")
SELECTOR_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
QUANTILE = re.compile(r"histogram_quantile\s*\(")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load_exprs(path: Path) -> dict[str, list[str]]:
    """{panel title: its targets' PromQL}."""
    dashboard = json.loads(path.read_text())
    return {
        panel["title"]: [target["expr"] for target in panel["targets"]]
        for panel in dashboard["panels"]
    }


def referenced_series(expr: str) -> list[tuple[str, set[str]]]:
    """Each series `expr` names, with the labels its selector matches on."""
    return [
        (name, set(SELECTOR_LABEL.findall(selector or "")))
        for name, selector in SERIES.findall(expr)
    ]


def grouping_labels(expr: str) -> set[str]:
    """Labels in by/without/on/ignoring clauses."""
    return {label.strip() for group in GROUPING.findall(expr) for label in group.split(",")} - {""}


def quantile_arguments(expr: str) -> list[str]:
    """The text inside each histogram_quantile( ... ), by matching parentheses."""
    arguments = []
    for match in QUANTILE.finditer(expr):
        depth, start = 1, match.end()
        end = start
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[end], 0)
            end += 1
        arguments.append(expr[start : end - 1])
    return arguments


class Exposition:
    """One /metrics output: each sample name's family type and the labels its samples carry."""

    def __init__(self, text: str) -> None:
        self.family_type: dict[str, str] = {}  # by family name
        self.family_of: dict[str, str] = {}  # by sample name
        self.labels: dict[str, set[str]] = {}  # by sample name
        for family in text_string_to_metric_families(text):
            self.family_type[family.name] = family.type
            for sample in family.samples:
                self.family_of[sample.name] = family.name
                self.labels.setdefault(sample.name, set()).update(sample.labels)

    def problems(self, expr: str) -> list[str]:
        """What `expr` asks for that this output does not have. The labels of its by/without/
        on/ignoring clauses must be on every series it names (true of each query here)."""
        found = []
        series = referenced_series(expr)
        if not series:
            found.append("names no pagedserve: series")
        for name, selector_labels in series:
            if name not in self.labels:
                found.append(f"{name} is not in /metrics")
                continue
            family = self.family_of[name]
            kind = self.family_type[family]
            if name.endswith(HISTOGRAM_SUFFIXES) and name != family and kind != "histogram":
                found.append(f"{name} is a {kind}'s, not a histogram's")
            for label in (selector_labels | grouping_labels(expr)) - self.labels[name]:
                found.append(f"{name} has no label {label!r}")
        for argument in quantile_arguments(expr):
            names = METRIC.findall(argument)
            if not names or not all(name.endswith("_bucket") for name in names):
                found.append(f"histogram_quantile over {names}, not _bucket series")
            if "le" not in grouping_labels(argument):
                found.append("histogram_quantile without `by (le)`")
        return found


def test_parsing_finds_names_selector_labels_and_groupings() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, model_name) (rate(pagedserve:a_bucket{model_name="m",'
        ' x!~"y"}[1m]))) / on (model_name) pagedserve:b_total'
    )
    assert referenced_series(expr) == [
        ("pagedserve:a_bucket", {"model_name", "x"}),
        ("pagedserve:b_total", set()),
    ]
    assert grouping_labels(expr) == {"le", "model_name"}
    assert quantile_arguments(expr) == [
        '0.9, sum by (le, model_name) (rate(pagedserve:a_bucket{model_name="m", x!~"y"}[1m]))'
    ]


def test_a_summary_is_not_taken_for_a_histogram() -> None:
    exposition = Exposition(
        '# TYPE pagedserve:s summary\npagedserve:s_sum{model_name="m"} 1.0\n'
        'pagedserve:s_count{model_name="m"} 1.0\n'
    )
    assert exposition.problems('rate(pagedserve:s_sum{model_name="m"}[1m])') == [
        "pagedserve:s_sum is a summary's, not a histogram's"
    ]


def test_every_panel_queries_the_prometheus_input_by_model_name() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    assert variables["model_name"]["datasource"] == DATASOURCE
    assert "pagedserve:" in variables["model_name"]["query"]["query"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
            for _, selector_labels in referenced_series(target["expr"]):
                assert "model_name" in selector_labels, (panel["title"], target["expr"])
            assert '$model_name"' in target["expr"], (panel["title"], target["expr"])


@pytest.fixture(scope="module")
def exposition(server: Any) -> Exposition:
    body = {"prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
    assert server.post("/v1/completions", body).status_code == 200
    server.wait_metrics(lambda m: m.get("pagedserve:e2e_request_latency_seconds_count", 0) >= 1)
    response = httpx.get(f"{server.url}/metrics", timeout=30.0)
    assert response.status_code == 200
    return Exposition(response.text)


def test_every_panel_names_exposed_series_and_labels(exposition: Exposition) -> None:
    problems = {
        f"{title}: {expr}": found
        for title, exprs in load_exprs(DASHBOARD).items()
        for expr in exprs
        if (found := exposition.problems(expr))
    }
    assert problems == {}


def test_a_misnamed_series_or_label_is_reported(exposition: Exposition) -> None:
    """The check above can fail: the dashboard's own queries, each corrupted one way."""
    exprs = [expr for exprs in load_exprs(DASHBOARD).values() for expr in exprs]
    counter = next(e for e in exprs if "prompt_tokens_total" in e)
    bucket = next(e for e in exprs if "histogram_quantile" in e)
    by_reason = next(e for e in exprs if "finished_reason" in e)
    assert exposition.problems(counter.replace("prompt_tokens_total", "prompt_tokens")) == [
        "pagedserve:prompt_tokens is not in /metrics"
    ]
    assert exposition.problems(counter.replace("pagedserve:prompt", "pagedserve:prompts"))
    assert exposition.problems(bucket.replace("_bucket", "_sum"))
    assert exposition.problems(bucket.replace("by (le)", "by (model_name)"))
    assert exposition.problems(by_reason.replace("finished_reason", "finish_reason"))
    assert exposition.problems(counter.replace("model_name=", "model="))
