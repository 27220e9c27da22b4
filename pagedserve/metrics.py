"""Engine metrics: Prometheus collectors with vLLM's names (prefix `pagedserve:`) and the
periodic stats log line; and ours: the steps' roofline figures (MBU, MFU; see `roofline`)."""

import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from pagedserve.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from pagedserve.metrics_buckets import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    N_BUCKETS,
    TTFT_BUCKETS,
    UTILIZATION_BUCKETS,
    build_1_2_5_buckets,
)
from pagedserve.metrics_collectors import EngineCollectors
from pagedserve.outputs import RequestOutput
from pagedserve.roofline import Peaks, device_peaks

FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason


@dataclass(slots=True)
class _SequenceTimes:
    """One sequence (engine-core request), in the core's time.monotonic() seconds."""

    scheduled: float | None = None  # first scheduled
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0


@dataclass(slots=True)
class _RequestTimes:
    arrival: float  # time.monotonic() when the server accepted the request
    num_prompt_tokens: int
    max_tokens: int  # resolved
    child_ids: list[str]  # its sequences' engine-core request ids, by completion index
    last_token: float | None = None  # when its latest tokens arrived; None before the first


class EngineMetrics:
    """Counts what the engine does, per user request (a request with n > 1 counts its
    prompt once in `prompt_tokens` and `iteration_tokens_total`). As vLLM, the per-sequence
    series (`request_success_total`, `request_prompt_tokens`, `request_generation_tokens`,
    `request_params_max_tokens` and the prefill, decode, inference and time-per-output-token
    histograms) count each of the n sequences; `request_params_n` and
    `request_max_num_generation_tokens` count the request once.

    TTFT, inter-token latency and e2e latency are taken where the server sees them (from
    acceptance; between arrivals). Queue, prefill, decode and inference times are the core's:
    queue time from its arrival there to first scheduling (the start of that step); prefill
    from then to the end of the step that made the first token, decode from there to the end
    of the step that made the last token, inference the two together.
    `max_model_len` (tokens) bounds the buckets of token counts.

    `engine` (None: no such label) labels every series `engine="<engine>"`, as vLLM's
    metrics of data-parallel engine cores: make one EngineMetrics per core, each with its
    index, on one `registry`; the collectors are shared and summing over the label gives
    the whole server's figures (ValueError when engines of one registry differ in having
    the label).

    Roofline figures of each step that ran a forward (`record_step_cost`): MBU, the bytes it
    must read / its seconds / the device's peak bandwidth, and MFU, its FLOPs / its seconds /
    the peak FLOP/s (fractions; one rank's, on one device's peaks). `peaks` (default: the
    PAGEDSERVE_PEAK_* variables' only; AsyncLLMEngine sets the core's device's) may be
    replaced later. Without a peak (a CPU, an unlisted device) its histogram stays empty and
    its gauge NaN, and the log line leaves it out. A step's seconds are its forward's
    (`EngineCoreOutputs.step_seconds`: CUDA events on a GPU, the host's time in the forward's
    calls on a CPU), not the step's wall time, which with async scheduling holds the forward
    launched by the step before.
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        registry: CollectorRegistry | None = None,
        peaks: Peaks | None = None,
        engine: str | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = {"model_name": model_name}
        if engine is not None:
            # vLLM's label of data-parallel engine cores ("0", "1", ...): one EngineMetrics
            # per core, all in one registry; a sum over the label gives the server's figures.
            labels["engine"] = engine
        self.engine = engine
        collectors = EngineCollectors(self.registry, labels)
        gauge, counter, histogram = collectors.gauge, collectors.counter, collectors.histogram
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.num_swap_outs = counter(
            "num_swap_outs", "Preemptions that copied the request's KV blocks to CPU swap space."
        )
        self.num_swap_ins = counter(
            "num_swap_ins", "Swapped-out requests whose KV blocks were copied back to resume."
        )
        self.cpu_prefix_cache_hits = counter(
            "cpu_prefix_cache_hits",
            "Tokens found in the CPU tier of the prefix cache (part of prefix_cache_hits).",
        )
        success = collectors.family(
            Counter,
            "request_success",
            "Finished sequences, by finish reason.",
            ("finished_reason",),
        )
        self.request_success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in FINISHED_REASONS
        }
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished sequence.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens each finished sequence generated.", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Most tokens generated by one of a request's sequences.",
            token_buckets,
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each finished sequence.", token_buckets
        )
        self.request_params_n = histogram(
            "request_params_n", "The n of each finished request.", N_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Prompt and generated tokens counted per engine step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Decode time per token after the first, per sequence.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time waiting before first scheduled.", LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", LATENCY_BUCKETS
        )
        self.step_mbu = histogram(
            "step_mbu", "Memory-bandwidth utilization of each step (0..1).", UTILIZATION_BUCKETS
        )
        self.step_mfu = histogram(
            "step_mfu", "Model FLOPs utilization of each step (0..1).", UTILIZATION_BUCKETS
        )
        self.mbu = gauge("mbu", "Memory-bandwidth utilization of the steps of this log interval.")
        self.mfu = gauge("mfu", "Model FLOPs utilization of the steps of this log interval.")
        self.mbu.set(float("nan"))
        self.mfu.set(float("nan"))
        self.peaks = peaks if peaks is not None else device_peaks(None)
        self._requests: dict[str, _RequestTimes] = {}
        self._sequences: dict[str, _SequenceTimes] = {}  # by engine-core request id
        self._last_totals = SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self._log = _LogInterval(time.monotonic())

    def record_arrival(
        self,
        request_id: str,
        child_ids: list[str],
        num_prompt_tokens: int,
        max_tokens: int,
        now: float,
    ) -> None:
        """A request accepted at `now` (time.monotonic()), run as the engine-core requests
        `child_ids` (one per sequence, by completion index)."""
        self._requests[request_id] = _RequestTimes(
            now, num_prompt_tokens, max_tokens, list(child_ids)
        )
        for child_id in child_ids:
            self._sequences[child_id] = _SequenceTimes()

    def record_outputs(
        self,
        outputs: list[EngineCoreOutput],
        parent_of: Callable[[str], str | None],
        now: float,
        core_time: float,
    ) -> None:
        """One step's outputs (before the OutputProcessor forgets finished children),
        received at `now`; `core_time`: when the core made them (its time.monotonic())."""
        num_tokens_by_parent: dict[str, int] = {}
        for output in outputs:
            num_tokens = len(output.new_token_ids)
            sequence = self._sequences.get(output.request_id)
            if sequence is not None and num_tokens:
                if sequence.first_token is None:
                    sequence.first_token = core_time
                sequence.last_token = core_time
                sequence.num_generation_tokens += num_tokens
            parent = parent_of(output.request_id)
            if parent is not None:
                num_tokens_by_parent[parent] = num_tokens_by_parent.get(parent, 0) + num_tokens
        num_step_tokens = 0
        for parent, num_tokens in num_tokens_by_parent.items():
            times = self._requests.get(parent)
            if times is None or num_tokens == 0:
                continue
            if times.last_token is None:
                self.ttft.observe(now - times.arrival)
                self.prompt_tokens.inc(times.num_prompt_tokens)
                self._log.num_prompt_tokens += times.num_prompt_tokens
                num_step_tokens += times.num_prompt_tokens
            else:
                self.itl.observe(now - times.last_token)
            times.last_token = now
            self.generation_tokens.inc(num_tokens)
            self._log.num_generation_tokens += num_tokens
            num_step_tokens += num_tokens
        if outputs:  # as vLLM: every step that sent outputs
            self.iteration_tokens.observe(num_step_tokens)

    def record_finished(self, output: RequestOutput, now: float) -> None:
        times = self._requests.pop(output.request_id, None)
        most_tokens = 0
        for completion in output.outputs:
            reason = completion.finish_reason or "abort"
            self.request_success[reason if reason in FINISHED_REASONS else "abort"].inc()
            if times is None:
                continue
            child_id = times.child_ids[completion.index]
            sequence = self._sequences.pop(child_id, None) or _SequenceTimes()
            most_tokens = max(most_tokens, sequence.num_generation_tokens)
            self._record_sequence(times, sequence)
        if times is not None:
            self.e2e.observe(now - times.arrival)
            self.request_params_n.observe(len(times.child_ids))
            self.request_max_num_generation_tokens.observe(most_tokens)
            for child_id in times.child_ids:  # (all popped unless outputs were missing)
                self._sequences.pop(child_id, None)

    def _record_sequence(self, times: _RequestTimes, sequence: _SequenceTimes) -> None:
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(sequence.num_generation_tokens)
        self.request_params_max_tokens.observe(times.max_tokens)
        scheduled, first, last = sequence.scheduled, sequence.first_token, sequence.last_token
        if scheduled is None or first is None or last is None:
            return  # never scheduled, or no token: no phases to time
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)
        num_decoded = sequence.num_generation_tokens - 1  # the first token ends the prefill
        self.tpot.observe((last - first) / num_decoded if num_decoded > 0 else 0.0)

    def record_aborted(
        self, request_id: str, num_unfinished_sequences: int, reason: str = "abort"
    ) -> None:
        """A request ended early: "abort" (the caller left, the server stopped it) or
        "error" (an internal error ended it); its unfinished sequences count as `reason`."""
        times = self._requests.pop(request_id, None)
        if times is None:
            return
        self.request_success[reason].inc(num_unfinished_sequences)
        for child_id in times.child_ids:
            self._sequences.pop(child_id, None)

    def record_queue_times(self, queue_times: list[tuple[str, float]], scheduled_at: float) -> None:
        """Sequences first scheduled in the step that began at `scheduled_at` (the core's
        time.monotonic()): (engine-core request id, seconds from arrival in the core)."""
        for child_id, seconds in queue_times:
            self.queue_time.observe(seconds)
            sequence = self._sequences.get(child_id)
            if sequence is not None and sequence.scheduled is None:
                sequence.scheduled = scheduled_at

    def record_step_cost(self, message: EngineCoreOutputs) -> None:
        """A step's roofline cost (`step_bytes`, `step_flops`; 0 when no forward ran) over
        its forward's seconds on the device (`step_seconds`): its MBU and MFU where the peaks
        are known, and the interval's (total bytes or FLOPs over total seconds) in the
        gauges. (Not the step's wall time: with async scheduling a step returns the outputs of
        a forward launched by the step before.)"""
        step_bytes, step_flops = message.step_bytes, message.step_flops
        seconds = message.step_seconds
        if step_bytes <= 0 or seconds <= 0:
            return
        interval = self._log
        interval.step_bytes += step_bytes
        interval.step_flops += step_flops
        interval.step_seconds += seconds
        bandwidth, flops = self.peaks.bandwidth, self.peaks.flops
        if bandwidth is not None:
            self.step_mbu.observe(step_bytes / seconds / bandwidth)
            self.mbu.set(interval.step_bytes / interval.step_seconds / bandwidth)
        if flops is not None:
            self.step_mfu.observe(step_flops / seconds / flops)
            self.mfu.set(interval.step_flops / interval.step_seconds / flops)

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
        self.num_swap_outs.inc(max(stats.num_swap_outs_total - last.num_swap_outs_total, 0))
        self.num_swap_ins.inc(max(stats.num_swap_ins_total - last.num_swap_ins_total, 0))
        self.cpu_prefix_cache_hits.inc(
            max(stats.cpu_prefix_cache_hits - last.cpu_prefix_cache_hits, 0)
        )
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
        roofline = ""
        if interval.step_seconds > 0 and self.peaks.bandwidth is not None:
            mbu = interval.step_bytes / interval.step_seconds / self.peaks.bandwidth
            roofline += f", MBU: {100.0 * mbu:.1f}%"
        if interval.step_seconds > 0 and self.peaks.flops is not None:
            mfu = interval.step_flops / interval.step_seconds / self.peaks.flops
            roofline += f", MFU: {100.0 * mfu:.1f}%"
        prefix = "" if self.engine is None else f"Engine {int(self.engine):03d}: "  # vLLM's
        return (
            f"{prefix}Avg prompt throughput: {interval.num_prompt_tokens / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {interval.num_generation_tokens / seconds:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100.0 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%{roofline}"
        )


def engine_metrics(model_name: str, max_model_len: int, num_engines: int) -> list[EngineMetrics]:
    """One EngineMetrics per engine core, in one registry: unlabelled for one engine, else
    labelled engine="0", "1", ... (vLLM's data-parallel metrics)."""
    if num_engines == 1:
        return [EngineMetrics(model_name, max_model_len)]
    first = EngineMetrics(model_name, max_model_len, engine="0")
    return [first] + [
        EngineMetrics(model_name, max_model_len, first.registry, engine=str(i))
        for i in range(1, num_engines)
    ]


@dataclass(slots=True)
class _LogInterval:
    start: float
    prefix_cache_queries: int = 0  # running totals at the start
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    step_bytes: float = 0.0  # roofline cost of the interval's steps that ran a forward
    step_flops: float = 0.0
    step_seconds: float = 0.0
