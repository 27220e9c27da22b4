"""Engine metrics: Prometheus collectors with vLLM's names (prefix `pagedserve:`) and the
periodic stats log line."""

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.messages import EngineCoreOutput, SchedulerStats
from pagedserve.outputs import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
_ITL_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
_LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
FINISHED_REASONS = ("stop", "length", "abort")


@dataclass(slots=True)
class _RequestTimes:
    arrival: float  # time.monotonic() when the server accepted the request
    num_prompt_tokens: int
    last_token: float | None = None  # when its latest tokens arrived; None before the first


class EngineMetrics:
    """Counts what the engine does, per user request (a request with n > 1 counts its
    prompt once; `request_success_total` counts each of its n sequences, as vLLM does).

    Times are taken where the server sees them: TTFT from acceptance to the first token's
    arrival, inter-token latency between arrivals; queue time is measured by the core.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"model_name": model_name}
        name = "pagedserve:"

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(name + metric, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(metric: str, doc: str) -> Counter:
            collector = Counter(name + metric, doc, list(labels), registry=self.registry)
            return collector.labels(**labels)

        def histogram(metric: str, doc: str, buckets: list[float]) -> Histogram:
            collector = Histogram(
                name + metric, doc, list(labels), buckets=buckets, registry=self.registry
            )
            return collector.labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        success = Counter(
            name + "request_success",
            "Finished sequences, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {
            reason: success.labels(model_name=model_name, finished_reason=reason)
            for reason in FINISHED_REASONS
        }
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before first scheduled.", _LATENCY_BUCKETS
        )
        self._requests: dict[str, _RequestTimes] = {}
        self._last_totals = SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self._log = _LogInterval(time.monotonic())

    def record_arrival(self, request_id: str, num_prompt_tokens: int, now: float) -> None:
        self._requests[request_id] = _RequestTimes(now, num_prompt_tokens)

    def record_outputs(
        self,
        outputs: list[EngineCoreOutput],
        parent_of: Callable[[str], str | None],
        now: float,
    ) -> None:
        """One step's outputs (before the OutputProcessor forgets finished children)."""
        num_tokens_by_parent: dict[str, int] = {}
        for output in outputs:
            parent = parent_of(output.request_id)
            if parent is not None:
                num_tokens = len(output.new_token_ids)
                num_tokens_by_parent[parent] = num_tokens_by_parent.get(parent, 0) + num_tokens
        for parent, num_tokens in num_tokens_by_parent.items():
            times = self._requests.get(parent)
            if times is None or num_tokens == 0:
                continue
            if times.last_token is None:
                self.ttft.observe(now - times.arrival)
                self.prompt_tokens.inc(times.num_prompt_tokens)
                self._log.num_prompt_tokens += times.num_prompt_tokens
            else:
                self.itl.observe(now - times.last_token)
            times.last_token = now
            self.generation_tokens.inc(num_tokens)
            self._log.num_generation_tokens += num_tokens

    def record_finished(self, output: RequestOutput, now: float) -> None:
        times = self._requests.pop(output.request_id, None)
        if times is not None:
            self.e2e.observe(now - times.arrival)
        for completion in output.outputs:
            reason = completion.finish_reason or "abort"
            self.request_success[reason if reason in FINISHED_REASONS else "abort"].inc()

    def record_aborted(self, request_id: str, num_unfinished_sequences: int) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.request_success["abort"].inc(num_unfinished_sequences)

    def record_queue_times(self, queue_times: list[float]) -> None:
        for seconds in queue_times:
            self.queue_time.observe(seconds)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last_totals
        # The core reports running totals; Prometheus counters take increments.
        self.num_preemptions.inc(max(stats.num_preemptions_total - last.num_preemptions_total, 0))
        self.prefix_cache_queries.inc(
            max(stats.prefix_cache_queries - last.prefix_cache_queries, 0)
        )
        self.prefix_cache_hits.inc(max(stats.prefix_cache_hits - last.prefix_cache_hits, 0))
        self._last_totals = stats

    def log_line(self, now: float) -> str | None:
        """The periodic stats line since the previous call; None when the engine was idle."""
        interval, stats = self._log, self._last_totals
        self._log = _LogInterval(now, stats.prefix_cache_queries, stats.prefix_cache_hits)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and interval.num_prompt_tokens == 0 and interval.num_generation_tokens == 0:
            return None
        seconds = max(now - interval.start, 1e-9)
        num_queries = stats.prefix_cache_queries - interval.prefix_cache_queries
        num_hits = stats.prefix_cache_hits - interval.prefix_cache_hits
        hit_rate = 100.0 * num_hits / num_queries if num_queries else 0.0
        return (
            f"Avg prompt throughput: {interval.num_prompt_tokens / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {interval.num_generation_tokens / seconds:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
        )


@dataclass(slots=True)
class _LogInterval:
    start: float
    prefix_cache_queries: int = 0  # running totals at the start
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
