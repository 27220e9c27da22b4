"""On a fresh real server: a known workload gives exact counts in /metrics, where the engine's
per-request histograms, the HTTP metrics by route and status and the process's CPU and memory
come out together."""

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import API_KEY

MAX_TOKENS = 5
PROMPTS = ["Once upon a time", "你好，世界", "Emoji 🎉"]
N_PROMPT = "The quick brown fox"


class Scrape:
    """One /metrics output; `value(name, **labels)` sums the samples that have those labels
    (the model_name label and the others left out match anything)."""

    def __init__(self, server: Any) -> None:
        response = httpx.get(f"{server.url}/metrics", timeout=30.0)
        assert response.status_code == 200
        self.samples = [
            sample
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        matching = [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert matching, f"no sample {name}{labels}"
        return sum(matching)


@pytest.fixture(scope="module")
def fresh_server(server_factory: Any) -> Any:
    running = server_factory("llama3", API_KEY)
    try:
        yield running
    finally:
        running.stop()


def test_a_known_workload_counts_exactly(fresh_server: Any) -> None:
    server = fresh_server
    num_prompt_tokens = [len(server.tokenize(prompt=p)) for p in [*PROMPTS, N_PROMPT]]
    body = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
    for prompt in PROMPTS:
        assert server.post("/v1/completions", {**body, "prompt": prompt}).status_code == 200
    response = server.post("/v1/completions", {**body, "prompt": N_PROMPT, "n": 2})
    assert response.status_code == 200
    assert len(response.json()["choices"]) == 2
    unauthorized = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30.0)
    assert unauthorized.status_code == 401
    num_requests, num_sequences = 4, 5
    num_generated = MAX_TOKENS * num_sequences
    num_prompt = sum(num_prompt_tokens)  # a request with n=2 prefills its prompt once

    completions = {"handler": "/v1/completions", "method": "POST"}

    def done(metrics: dict[str, float]) -> bool:
        scrape = Scrape(server)  # (the middleware counts a request once its answer is sent)
        ok = scrape.value("http_requests_total", **completions, status="2xx") == num_requests
        return ok and scrape.value("http_requests_total", **completions, status="4xx") == 1

    server.wait_metrics(done)
    scrape = Scrape(server)

    def value(name: str, **labels: str) -> float:
        return scrape.value(f"pagedserve:{name}", **labels)

    assert value("request_success_total", finished_reason="length") == num_sequences
    for reason in ("stop", "abort", "error"):
        assert value("request_success_total", finished_reason=reason) == 0, reason
    assert value("prompt_tokens_total") == num_prompt
    assert value("generation_tokens_total") == num_generated
    assert value("iteration_tokens_total_sum") == num_prompt + num_generated
    assert value("request_generation_tokens_count") == num_sequences
    assert value("request_generation_tokens_sum") == num_generated
    assert value("request_params_max_tokens_count") == num_sequences
    assert value("request_params_max_tokens_sum") == MAX_TOKENS * num_sequences
    assert value("request_prompt_tokens_sum") == num_prompt + num_prompt_tokens[-1]
    assert value("request_params_n_count") == num_requests
    assert value("request_params_n_sum") == num_sequences
    assert value("request_max_num_generation_tokens_sum") == MAX_TOKENS * num_requests
    for phase in ("prefill", "decode", "inference", "queue"):
        assert value(f"request_{phase}_time_seconds_count") == num_sequences, phase
    assert value("request_time_per_output_token_seconds_count") == num_sequences
    # each sequence's inference time is its prefill time plus its decode time
    prefill, decode = (
        value("request_prefill_time_seconds_sum"),
        value("request_decode_time_seconds_sum"),
    )
    assert value("request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert value(f"{histogram}_seconds_count") == num_requests, histogram
    # probes and scrapes are not counted; other routes are, by template
    assert not [s for s in scrape.samples if s.labels.get("handler") in ("/metrics", "/health")]
    assert scrape.value("http_requests_total", handler="/tokenize", status="2xx") == 4
    assert scrape.value("http_request_duration_seconds_count", **completions) == num_requests + 1
    assert scrape.value("process_cpu_seconds_total") > 0
    assert scrape.value("process_resident_memory_bytes") > 0


def test_one_metrics_output(fresh_server: Any) -> None:
    """The engine's metrics, the HTTP metrics and the process's share one /metrics output,
    each name once."""
    response = httpx.get(f"{fresh_server.url}/metrics", timeout=30.0)
    types = [line.split()[2] for line in response.text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    for name in (
        "pagedserve:request_prefill_time_seconds",
        "http_requests_total",
        "http_request_duration_seconds",
        "http_request_duration_highr_seconds",
        "http_request_size_bytes",
        "http_response_size_bytes",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
    ):
        assert name in types, (name, types)
