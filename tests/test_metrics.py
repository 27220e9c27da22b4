"""EngineMetrics on hand-made engine-core messages: the per-request histograms get exactly the
phases, token counts and parameters of what ran; the steps' MBU and MFU their roofline cost
over their time and the peaks."""

import math

import pytest
from prometheus_client import CollectorRegistry

from pagedserve.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from pagedserve.metrics import EngineMetrics, build_1_2_5_buckets
from pagedserve.outputs import CompletionOutput, RequestOutput

MODEL = "m"


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    sample = registry.get_sample_value(f"pagedserve:{name}", {"model_name": MODEL, **labels})
    assert sample is not None, name
    return sample


def completion(index: int, num_tokens: int, reason: str) -> CompletionOutput:
    return CompletionOutput(index, "", [7] * num_tokens, None, None, reason)


def token(child_id: str) -> EngineCoreOutput:
    return EngineCoreOutput(child_id, [7])


def test_buckets_of_token_counts_are_vllms() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(1024)[-1] == 1000


def test_one_request_with_two_sequences() -> None:
    """Request "r" (n=2, 4 prompt tokens, max_tokens 3): sequence a is scheduled at 10.0 and
    makes tokens at 10.5, 10.75 and 11.5; sequence b is scheduled at 10.25 and makes tokens
    at 10.75 and 11.0, then a stop string ends it."""
    metrics = EngineMetrics(MODEL, max_model_len=100)
    registry = metrics.registry
    metrics.record_arrival("r", ["a", "b"], 4, 3, now=100.0)
    parent = {"a": "r", "b": "r"}.get
    metrics.record_queue_times([("a", 0.5)], scheduled_at=10.0)
    metrics.record_outputs([], parent, now=100.2, core_time=10.1)  # (a step sending nothing)
    metrics.record_outputs([token("a")], parent, now=100.5, core_time=10.5)
    metrics.record_queue_times([("b", 0.75)], scheduled_at=10.25)
    metrics.record_outputs([token("a"), token("b")], parent, now=101.0, core_time=10.75)
    metrics.record_outputs([token("b")], parent, now=101.25, core_time=11.0)
    metrics.record_outputs([token("a")], parent, now=102.0, core_time=11.5)
    output = RequestOutput("r", None, [1, 2, 3, 4], None, [], finished=True)
    output.outputs = [completion(0, 3, "length"), completion(1, 2, "stop")]
    metrics.record_finished(output, now=102.5)

    assert value(registry, "request_success_total", finished_reason="length") == 1
    assert value(registry, "request_success_total", finished_reason="stop") == 1
    assert value(registry, "request_success_total", finished_reason="error") == 0
    # the prompt once (at the first token), then each step's new tokens
    assert value(registry, "iteration_tokens_total_count") == 4
    assert value(registry, "iteration_tokens_total_sum") == 4 + 5
    assert value(registry, "prompt_tokens_total") == 4
    assert value(registry, "generation_tokens_total") == 5
    for name, expected in [
        ("request_prefill_time_seconds", 0.5 + 0.5),  # a: 10.0 -> 10.5; b: 10.25 -> 10.75
        ("request_decode_time_seconds", 1.0 + 0.25),  # a: 10.5 -> 11.5; b: 10.75 -> 11.0
        ("request_inference_time_seconds", 1.5 + 0.75),
        ("request_time_per_output_token_seconds", 1.0 / 2 + 0.25 / 1),
        ("request_queue_time_seconds", 0.5 + 0.75),
        ("request_prompt_tokens", 4 + 4),
        ("request_generation_tokens", 3 + 2),
        ("request_params_max_tokens", 3 + 3),
    ]:
        assert value(registry, f"{name}_count") == 2, name
        assert value(registry, f"{name}_sum") == expected, name
    assert value(registry, "request_params_n_count") == 1
    assert value(registry, "request_params_n_sum") == 2
    assert value(registry, "request_max_num_generation_tokens_sum") == 3
    assert value(registry, "e2e_request_latency_seconds_sum") == 2.5
    assert value(registry, "time_to_first_token_seconds_sum") == 0.5
    bucket = value(registry, "request_generation_tokens_bucket", le="2.0")
    assert bucket == 1  # b's 2 tokens; a's 3 fall in le="5.0"


def test_a_failed_request_counts_as_error_and_leaves_no_state() -> None:
    metrics = EngineMetrics(MODEL, max_model_len=100)
    metrics.record_arrival("r", ["a", "b"], 4, 3, now=1.0)
    metrics.record_queue_times([("a", 0.0)], scheduled_at=2.0)
    metrics.record_aborted("r", 2, "error")
    metrics.record_aborted("r", 2)  # already forgotten: not counted twice
    assert value(metrics.registry, "request_success_total", finished_reason="error") == 2
    assert value(metrics.registry, "request_success_total", finished_reason="abort") == 0
    assert value(metrics.registry, "request_prefill_time_seconds_count") == 0
    assert not metrics._requests and not metrics._sequences


def step(step_bytes: float, step_flops: float, start: float, end: float) -> EngineCoreOutputs:
    """A step whose forward ran on the device from `start` to `end`; the step's own wall
    time (scheduled_at to timestamp) is longer and is not what the figures divide by."""
    stats = SchedulerStats(1, 0, 0.5, 0, 0, 0)
    return EngineCoreOutputs(
        [token("a")], stats, [], start - 7.0, end + 3.0, step_bytes, step_flops, end - start
    )


@pytest.fixture
def peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peaks of 15,300 B/s and 212,800 FLOP/s (on a CPU, where no peak is known)."""
    monkeypatch.setenv("PAGEDSERVE_PEAK_BANDWIDTH", "15300")
    monkeypatch.setenv("PAGEDSERVE_PEAK_FLOPS", "212800")


@pytest.mark.usefixtures("peaks")
def test_step_mbu_and_mfu_with_peaks_from_the_environment() -> None:
    """Step 1: 6120 B and 10,640 FLOPs in 0.5 s: MBU 12,240 / 15,300 = 0.8, MFU 21,280 /
    212,800 = 0.1. A step that ran no forward counts nothing. Step 2: 7144 B, 199,808 FLOPs in
    1 s. The interval: 13,264 B in 1.5 s."""
    metrics = EngineMetrics(MODEL, max_model_len=100)
    registry = metrics.registry
    metrics.record_step_cost(step(6120, 10640, 1.0, 1.5))
    assert value(registry, "step_mbu_sum") == pytest.approx(0.8, rel=1e-12)
    assert value(registry, "step_mfu_sum") == pytest.approx(0.1, rel=1e-12)
    assert value(registry, "step_mbu_bucket", le="0.7") == 0
    assert value(registry, "step_mbu_bucket", le="0.8") == 1
    assert value(registry, "mbu") == pytest.approx(0.8, rel=1e-12)
    metrics.record_step_cost(step(0, 0, 2.0, 2.25))
    assert value(registry, "step_mbu_count") == 1
    metrics.record_step_cost(step(7144, 199808, 3.0, 4.0))
    assert value(registry, "step_mbu_count") == 2
    assert value(registry, "step_mbu_sum") == pytest.approx(0.8 + 7144 / 15300, rel=1e-12)
    assert value(registry, "mbu") == pytest.approx(13264 / 1.5 / 15300, rel=1e-12)
    assert value(registry, "mfu") == pytest.approx(210448 / 1.5 / 212800, rel=1e-12)


def test_without_peaks_no_utilization(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_PEAK_BANDWIDTH", raising=False)
    monkeypatch.delenv("PAGEDSERVE_PEAK_FLOPS", raising=False)
    metrics = EngineMetrics(MODEL, max_model_len=100)
    metrics.record_step_cost(step(6120, 10640, 1.0, 1.5))
    assert value(metrics.registry, "step_mbu_count") == 0
    assert value(metrics.registry, "step_mfu_count") == 0
    assert math.isnan(value(metrics.registry, "mbu"))
    assert math.isnan(value(metrics.registry, "mfu"))
    metrics.record_scheduler_stats(SchedulerStats(1, 0, 0.5, 0, 0, 0))
    line = metrics.log_line(now=time_after_start(metrics, 10.0))
    assert line is not None and "MBU" not in line and "MFU" not in line


def time_after_start(metrics: EngineMetrics, seconds: float) -> float:
    return metrics._log.start + seconds


@pytest.mark.usefixtures("peaks")
def test_log_line_has_the_intervals_mbu_and_mfu() -> None:
    metrics = EngineMetrics(MODEL, max_model_len=100)
    metrics.record_step_cost(step(6120, 10640, 1.0, 1.5))
    metrics.record_scheduler_stats(SchedulerStats(1, 0, 0.5, 0, 0, 0))
    line = metrics.log_line(now=time_after_start(metrics, 10.0))
    assert line is not None and line.endswith(", MBU: 80.0%, MFU: 10.0%")
    metrics.record_step_cost(step(3060, 0, 2.0, 2.5))  # the next interval's own figures
    line = metrics.log_line(now=time_after_start(metrics, 10.0))
    assert line is not None and line.endswith(", MBU: 40.0%, MFU: 0.0%")


def test_engines_of_one_registry_have_their_own_engine_label() -> None:
    """Data parallelism: one EngineMetrics per engine core in one registry (vLLM's
    engine="0", "1" label); each counts only its own core's, and the log line names it."""
    first = EngineMetrics(MODEL, max_model_len=100, engine="0")
    second = EngineMetrics(MODEL, max_model_len=100, registry=first.registry, engine="1")
    registry = first.registry
    for metrics, request_id in ((first, "r"), (second, "s")):
        metrics.record_arrival(request_id, [request_id], 4, 3, now=1.0)
    second.record_outputs([token("s")], lambda child: child, now=2.0, core_time=2.0)
    second.record_scheduler_stats(SchedulerStats(1, 2, 0.25, 0, 0, 0))
    assert value(registry, "prompt_tokens_total", engine="0") == 0
    assert value(registry, "prompt_tokens_total", engine="1") == 4
    assert value(registry, "num_requests_waiting", engine="1") == 2
    assert value(registry, "time_to_first_token_seconds_count", engine="1") == 1
    assert value(registry, "time_to_first_token_seconds_count", engine="0") == 0
    line = second.log_line(3.0)
    assert line is not None and line.startswith("Engine 001: Avg prompt throughput")
    with pytest.raises(ValueError, match="engine label"):
        EngineMetrics(MODEL, max_model_len=100, registry=registry)  # no label among labelled


def test_swap_and_cpu_tier_counters_take_the_increments_of_the_totals() -> None:
    metrics = EngineMetrics(MODEL, max_model_len=100)
    metrics.record_scheduler_stats(SchedulerStats(1, 0, 0.5, 3, 64, 32, 2, 1, 16))
    metrics.record_scheduler_stats(SchedulerStats(1, 0, 0.5, 5, 96, 48, 3, 3, 32))
    registry = metrics.registry
    assert value(registry, "num_preemptions_total") == 5
    assert value(registry, "num_swap_outs_total") == 3
    assert value(registry, "num_swap_ins_total") == 3
    assert value(registry, "cpu_prefix_cache_hits_total") == 32
    assert value(registry, "prefix_cache_hits_total") == 48
