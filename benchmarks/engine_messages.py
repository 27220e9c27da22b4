"""Engine-core message codec micro-benchmark (CPU only): encode + decode time per message.

Times one step's "outputs" message (1/64/256/512 EngineCoreOutputs, one token each, with and
without top-5 logprobs, plus the scheduler stats) and one "add" message (1/64 requests of 128
prompt tokens), each encoded and decoded back as the API server and the engine core do:

  new: pagedserve.messages (msgspec structs, one msgspec msgpack Encoder, typed Decoders)
  old: the codec of commit 715470b (engine/core_proc.py), kept here compactly as a reference:
       positional msgpack lists built by dataclasses.fields reflection; needs `msgpack`

Also times building a step's EngineCoreOutputs, as the scheduler does every step (keyword
arguments): the new msgspec struct against the old frozen dataclass. Prints a table (µs per
message, best of --repeats runs) and checks that both codecs round-trip.

  python benchmarks/engine_messages.py
"""

import argparse
import dataclasses
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from pagedserve import messages  # noqa: E402
from pagedserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

# ---- the old codec (commit 715470b), as a reference ----------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class OldSampleLogprobs:
    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class OldPromptLogprobs:
    first_position: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class OldOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: OldSampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    prompt_logprobs: OldPromptLogprobs | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class OldStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int


_OLD_NESTED = {  # field name -> dataclass, found by reflection as the old decode_output did
    name: arg
    for name, hint in typing.get_type_hints(OldOutput).items()
    for arg in typing.get_args(hint) or (hint,)
    if dataclasses.is_dataclass(arg)
}


def old_encode_outputs(outputs: list[OldOutput], stats: OldStats, queue_times: Any) -> bytes:
    import msgpack

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return [getattr(value, f.name) for f in dataclasses.fields(value)]
        return value

    encoded = [[plain(getattr(o, f.name)) for f in dataclasses.fields(o)] for o in outputs]
    message = ["outputs", encoded, list(dataclasses.astuple(stats)), queue_times]
    data: bytes = msgpack.packb(message, use_bin_type=True)
    return data


def old_decode_outputs(data: bytes) -> tuple[list[OldOutput], OldStats, list[Any]]:
    import msgpack

    _, outputs, stats, queue_times = msgpack.unpackb(data, raw=False, strict_map_key=False)
    decoded = []
    for values in outputs:
        kwargs = {}
        for f, value in zip(dataclasses.fields(OldOutput), values, strict=True):
            nested = _OLD_NESTED.get(f.name)
            kwargs[f.name] = nested(*value) if nested is not None and value is not None else value
        decoded.append(OldOutput(**kwargs))
    return decoded, OldStats(*stats), [(r, s) for r, s in queue_times]


def old_encode_add(requests: list[tuple[str, list[int], SamplingParams]]) -> bytes:
    import msgpack

    payload = []
    for request_id, prompt_token_ids, params in requests:
        values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
        values["output_kind"] = params.output_kind.value
        values["eos_token_ids"] = list(params.eos_token_ids)
        payload.append([request_id, prompt_token_ids, values, None, None])
    data: bytes = msgpack.packb(["add", payload], use_bin_type=True)
    return data


def old_decode_add(data: bytes) -> list[tuple[str, list[int], SamplingParams]]:
    import msgpack

    _, payload = msgpack.unpackb(data, raw=False, strict_map_key=False)
    requests = []
    for request_id, prompt_token_ids, values, _group, _fork_of in payload:
        values["output_kind"] = RequestOutputKind(values["output_kind"])
        values["eos_token_ids"] = tuple(values["eos_token_ids"])
        requests.append((request_id, prompt_token_ids, SamplingParams(**values)))
    return requests


# ---- workloads ---------------------------------------------------------------------------


def step_fields(num_outputs: int, with_logprobs: bool) -> list[dict[str, Any]]:
    """One decode step's outputs as keyword arguments (as the scheduler passes them)."""
    fields = []
    for i in range(num_outputs):
        logprobs = None
        if with_logprobs:  # logprobs=5: the sampled token, then the top 5
            token_ids = [1000 + i, *range(20 + i, 25 + i)]
            values = [-0.25, -0.5, -1.25, -2.0, -3.5, -4.0]
            logprobs = (token_ids, values, 2)
        fields.append(
            dict(
                request_id=f"cmpl-9f0c3b2a41d84e5fa1c7e0b6d2f4a8c1-{i}@{i}",
                new_token_ids=[1000 + i],
                logprobs=logprobs,
                finish_reason="length" if i % 97 == 0 else None,
                stop_reason=None,
                num_cached_tokens=16 if i % 3 == 0 else 0,
            )
        )
    return fields


def new_outputs(fields: list[dict[str, Any]]) -> list[messages.EngineCoreOutput]:
    return [
        messages.EngineCoreOutput(
            **{**f, "logprobs": f["logprobs"] and messages.SampleLogprobsData(*f["logprobs"])}
        )
        for f in fields
    ]


def old_outputs(fields: list[dict[str, Any]]) -> list[OldOutput]:
    return [
        OldOutput(**{**f, "logprobs": f["logprobs"] and OldSampleLogprobs(*f["logprobs"])})
        for f in fields
    ]


def time_us(run: Callable[[], Any], repeats: int) -> float:
    """The best of `repeats` runs of the mean µs per call (each run ~20 ms of calls): the
    least disturbed by other processes."""
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < 0.02:
        run()
        calls += 1
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"engine-core message codec, µs per encode + decode (commit {git_commit()})")
    print(f"{'message':<26}{'old µs':>10}{'new µs':>10}{'speedup':>9}{'old B':>9}{'new B':>9}")

    def row(name: str, old: Callable[[], Any] | None, new: Callable[[], Any], sizes: Any) -> None:
        old_us = time_us(old, args.repeats) if old is not None else float("nan")
        new_us = time_us(new, args.repeats)
        old_b, new_b = sizes
        print(
            f"{name:<26}{old_us:>10.1f}{new_us:>10.1f}{old_us / new_us:>8.1f}x{old_b:>9}{new_b:>9}"
        )

    try:
        import msgpack  # noqa: F401

        have_old = True
    except ImportError:
        have_old = False
        print("(msgpack is not installed: no old-codec figures)")

    stats_new = messages.SchedulerStats(256, 12, 0.42, 3, 40960, 12288)
    stats_old = OldStats(256, 12, 0.42, 3, 40960, 12288)
    for with_logprobs in (False, True):
        for num in (1, 64, 256, 512):
            fields = step_fields(num, with_logprobs)
            queue_times = [(f["request_id"], 0.01) for f in fields[: max(num // 16, 1)]]
            message = messages.EngineCoreOutputs(
                new_outputs(fields), stats_new, queue_times, 1.0, 1.01, 1.6e10, 4.2e12
            )
            new_data = messages.encode(message)
            assert messages.decode_to_server(new_data) == message
            old_out = old_outputs(fields)
            old_data = old_encode_outputs(old_out, stats_old, queue_times) if have_old else b""
            if have_old:
                assert old_decode_outputs(old_data) == (old_out, stats_old, queue_times)

            def run_new(m: Any = message) -> None:
                messages.decode_to_server(messages.encode(m))

            def run_old(o: Any = old_out, q: Any = queue_times) -> None:
                old_decode_outputs(old_encode_outputs(o, stats_old, q))

            name = f"outputs x{num}{' +logprobs' if with_logprobs else ''}"
            row(name, run_old if have_old else None, run_new, (len(old_data), len(new_data)))

    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256, eos_token_ids=(2,))
    for num in (1, 64):
        requests = [(f"cmpl-{i}@{i}", list(range(128)), params) for i in range(num)]
        add = messages.AddRequests([messages.EngineCoreRequest(*r) for r in requests])
        new_data = messages.encode(add)
        assert messages.decode_to_core(new_data) == add
        old_data = old_encode_add(requests) if have_old else b""
        if have_old:
            assert old_decode_add(old_data) == requests

        def run_new_add(m: Any = add) -> None:
            messages.decode_to_core(messages.encode(m))

        def run_old_add(r: Any = requests) -> None:
            old_decode_add(old_encode_add(r))

        row(
            f"add x{num} (128 tokens)",
            run_old_add if have_old else None,
            run_new_add,
            (len(old_data), len(new_data)),
        )

    print(f"{'build outputs (scheduler)':<26}{'old µs':>10}{'new µs':>10}")
    for num in (64, 512):
        fields = step_fields(num, False)

        def build_new(fs: Any = fields) -> None:
            for f in fs:
                messages.EngineCoreOutput(**f)

        def build_old(fs: Any = fields) -> None:
            for f in fs:
                OldOutput(**f)

        old_us, new_us = time_us(build_old, args.repeats), time_us(build_new, args.repeats)
        print(f"{f'  x{num}':<26}{old_us:>10.1f}{new_us:>10.1f}{old_us / new_us:>8.1f}x")


if __name__ == "__main__":
    main()
