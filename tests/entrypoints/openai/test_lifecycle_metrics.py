"""On the real server: client disconnects free their requests at once; /metrics counts exactly
what was sent."""

import time
from typing import Any

import httpx
import pytest

RUNNING = "pagedserve:num_requests_running"
WAITING = "pagedserve:num_requests_waiting"
KV_USAGE = "pagedserve:kv_cache_usage_perc"
ABORTED = 'pagedserve:request_success_total{finished_reason="abort"}'
LENGTH = 'pagedserve:request_success_total{finished_reason="length"}'
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.0}


def idle(metrics: dict[str, float]) -> bool:
    return metrics[RUNNING] == 0 and metrics[WAITING] == 0 and metrics[KV_USAGE] == 0.0


def test_metric_names(server: Any) -> None:
    names = set(server.metrics())
    for name in (
        RUNNING, WAITING, KV_USAGE, ABORTED, LENGTH,
        "pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total",
        "pagedserve:num_preemptions_total", "pagedserve:prefix_cache_queries_total",
        "pagedserve:prefix_cache_hits_total",
        'pagedserve:request_success_total{finished_reason="stop"}',
        "pagedserve:time_to_first_token_seconds_count",
        "pagedserve:inter_token_latency_seconds_count",
        "pagedserve:e2e_request_latency_seconds_count",
        "pagedserve:request_queue_time_seconds_count",
    ):  # fmt: skip
        assert name in names, name


def test_disconnect_mid_stream_frees_the_request(server: Any) -> None:
    """uvicorn's disconnect, through the engine core to /metrics (the chat and n > 1 forms of
    leaving: test_request_handling.py, in process)."""
    server.wait_metrics(idle)
    before = server.metrics()
    body: dict[str, Any] = {**LONG, "stream": True, "prompt": "Once upon a time"}
    server.leave_mid_stream("/v1/completions", body)
    after = server.wait_metrics(idle, timeout_s=5.0)
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[LENGTH] == before[LENGTH]


def test_disconnect_while_waiting_for_a_whole_response(server: Any) -> None:
    server.wait_metrics(idle)
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {"prompt": "Once", **LONG}, timeout=0.3)
    after = server.wait_metrics(idle, timeout_s=5.0)
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[LENGTH] == before[LENGTH]


def test_metrics_count_what_was_sent(server: Any) -> None:
    server.wait_metrics(idle)
    before = server.metrics()
    prompts = ["Once upon a time", "你好，世界", "Emoji 🎉"]
    max_tokens = [5, 3, 4]
    num_prompt_tokens = [len(server.tokenize(prompt=p)) for p in prompts]
    for prompt, num in zip(prompts, max_tokens, strict=True):
        body = {"prompt": prompt, "max_tokens": num, "ignore_eos": True}
        assert server.post("/v1/completions", body).status_code == 200
    stream_body = {"prompt": prompts[0], "max_tokens": 6, "ignore_eos": True, "stream": True}
    assert server.post("/v1/completions", stream_body).text.endswith("data: [DONE]\n\n")
    num_requests = 4
    num_generated = sum(max_tokens) + 6
    num_prompt = sum(num_prompt_tokens) + num_prompt_tokens[0]

    def counted(metrics: dict[str, float]) -> bool:
        return metrics[LENGTH] - before[LENGTH] == num_requests

    after = server.wait_metrics(counted)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("pagedserve:prompt_tokens_total") == num_prompt
    assert delta("pagedserve:generation_tokens_total") == num_generated
    assert delta(ABORTED) == 0
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"pagedserve:{histogram}_seconds_count") == num_requests, histogram
    # one inter-token gap per generated token after the first
    assert delta("pagedserve:inter_token_latency_seconds_count") == num_generated - num_requests
    assert delta("pagedserve:prefix_cache_queries_total") >= num_prompt
    assert idle(after)


def test_prefix_cache_hits_are_counted(server: Any) -> None:
    prompt = "The same long prompt, repeated word for word. " * 8  # several full blocks
    before = server.metrics()
    for _ in range(2):
        assert (
            server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1}).status_code == 200
        )
    after = server.metrics()
    num_prompt_tokens = len(server.tokenize(prompt=prompt))
    hits = (
        after["pagedserve:prefix_cache_hits_total"] - before["pagedserve:prefix_cache_hits_total"]
    )
    assert hits >= (num_prompt_tokens // 16 - 1) * 16 > 0


def test_stats_are_logged_periodically(server: Any) -> None:
    deadline = time.monotonic() + 5.0
    while "Avg prompt throughput" not in server.log():
        assert time.monotonic() < deadline, server.log()
        server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        time.sleep(0.5)
    line = next(line for line in server.log().splitlines() if "Avg prompt throughput" in line)
    for part in ("generation throughput", "Running:", "Waiting:", "KV cache usage", "hit rate"):
        assert part in line
