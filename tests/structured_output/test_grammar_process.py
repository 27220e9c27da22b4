"""The grammar process (`use_grammar_process`) against the in-process matchers: step by step
the same masks, terminations and rollbacks, with the tokens sent late (through
`accept_tokens`) or early (`send_step_tokens`, before a preemption as the engine's deferred
step does); a prefetch waits for the tokens before it; a dead process fails the step."""

import functools
import gc
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedserve import SamplingParams
from pagedserve.engine.core import load_tokenizer
from pagedserve.request import Request
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_output import grammar_compiler
from pagedserve.structured_output.manager import StructuredOutputManager

from .conftest import QWEN3_VOCAB_SIZE, TOKENIZER_DIR, make_llm
from .test_batched import SCHEMA

CONSTRAINTS: list[dict[str, Any]] = [
    {"json": SCHEMA, "disable_any_whitespace": True},
    {"regex": r"[a-c]{2,6}\d"},
    {"choice": ["yes", "no", "maybe"]},
    {"grammar": 'root ::= "(" [0-9]+ ")"'},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(str(TOKENIZER_DIR), False)


def _managers(tokenizer: Any) -> tuple[StructuredOutputManager, StructuredOutputManager]:
    eos = [tokenizer.eos_token_id]
    local = StructuredOutputManager(lambda: tokenizer, QWEN3_VOCAB_SIZE, eos)
    remote = StructuredOutputManager(
        functools.partial(load_tokenizer, str(TOKENIZER_DIR), False), QWEN3_VOCAB_SIZE, eos
    )
    remote.use_grammar_process(None)
    return local, remote


def _ready(manager: StructuredOutputManager, index: int) -> Request:
    constraint = CONSTRAINTS[index % len(CONSTRAINTS)]
    params = SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(**constraint))
    request = Request(f"r{index}", [1, 2], params)
    manager.init_request(request)
    request.structured_output.compiled.result(timeout=120)  # type: ignore[union-attr]
    assert manager.is_ready(request)
    return request


def _allowed(row: np.ndarray) -> np.ndarray:
    """Token ids whose bits are set in one bitmask row."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:QWEN3_VOCAB_SIZE])


@pytest.mark.parametrize("early", [False, True])
def test_the_process_matches_in_process_matchers_step_by_step(tokenizer: Any, early: bool) -> None:
    """Random walks under the masks (with an occasional rollback of the last token, as a
    preemption that drops it would) give the same masks and terminations both ways. With
    `early`, each step's tokens go to the process before the scheduler applies them and
    before a preemption in between, as in the engine's deferred step."""
    local, remote = _managers(tokenizer)
    rng = np.random.default_rng(0)
    try:
        pairs = [(_ready(local, i), _ready(remote, i)) for i in range(8)]
        for step in range(40):
            live = [(a, b) for a, b in pairs if a.structured_output is not None]
            if not live:
                break
            if step % 7 == 3:  # a preemption that drops the last token (rolled back)
                for a, b in live:
                    if a.num_output_tokens:
                        del a.all_token_ids[-1]
                        del b.all_token_ids[-1]
                        local.sync_after_preemption(a)
                        remote.sync_after_preemption(b)
            mask = local.grammar_bitmask([a for a, _ in live])
            np.testing.assert_array_equal(mask, remote.grammar_bitmask([b for _, b in live]))
            tokens = []
            for row in range(len(live)):
                allowed = _allowed(mask[row])
                eos = tokenizer.eos_token_id
                # end soon where the grammar may end, else a random allowed token
                tokens.append(eos if eos in allowed and rng.random() < 0.3 else rng.choice(allowed))
            if early:
                remote.send_step_tokens([b.request_id for _, b in live], tokens)
                # a preemption that keeps every token, while the tokens are on their way:
                # nothing to roll back (the token sent counts as kept)
                for a, b in live:
                    local.sync_after_preemption(a)
                    remote.sync_after_preemption(b)
            applied = []
            for (a, b), token in zip(live, tokens, strict=True):
                a.append_output_token_ids([int(token)])
                b.append_output_token_ids([int(token)])
                applied.append(((a, int(token), None), (b, int(token), None)))
            ended_local = local.accept_tokens([x for x, _ in applied])
            ended_remote = remote.accept_tokens([y for _, y in applied])
            assert ended_local == ended_remote
            for a, b in live:
                if a.request_id in ended_local:
                    local.free_request(a)
                    remote.free_request(b)
        assert any(a.structured_output is None for a, _ in pairs)  # some terminated
    finally:
        local.shutdown()
        remote.shutdown()


def test_a_prefetch_waits_for_the_tokens_before_it(tokenizer: Any) -> None:
    """Rows asked for while the last fill's tokens are unsent are filled after them: the
    prefetched mask is the one after those tokens."""
    local, remote = _managers(tokenizer)
    try:
        a, b = _ready(local, 1), _ready(remote, 1)  # [a-c]{2,6}\\d
        remote.grammar_bitmask([b])  # handed out: its token is awaited
        remote.prefetch_fill([b], 1)  # not sent yet
        [token] = tokenizer.encode("ab", add_special_tokens=False)  # now a digit may end it
        remote.send_step_tokens([b.request_id], [token])  # then the prefetch
        rows = remote.prefetched_output([b])
        assert rows is not None and rows[0] == [b.request_id]
        a.append_output_token_ids([token])
        local.accept_tokens([(a, token, None)])
        np.testing.assert_array_equal(rows[1], local.grammar_bitmask([a]))
        assert not np.array_equal(rows[1], local.grammar_bitmask([_ready(local, 5)]))
    finally:
        local.shutdown()
        remote.shutdown()


def test_a_dead_grammar_process_fails_the_step(tokenizer: Any) -> None:
    """The engine gets a RuntimeError (it does not wait forever) once the process is gone."""
    _, remote = _managers(tokenizer)
    try:
        request = _ready(remote, 0)
        process = remote._remote._process  # type: ignore[union-attr]
        process._process.kill()  # type: ignore[union-attr]
        process._process.wait()  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match="grammar process exited"):
            remote.grammar_bitmask([request])
    finally:
        remote.shutdown()


def test_an_evicted_grammar_still_makes_the_matchers_of_waiting_requests(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request whose grammar was compiled but whose matcher is not made yet (it waits in the
    queue) must still get one after its key leaves the compile cache: in process the cache's
    future keeps the compiled grammar; the process must not drop it while a request needs it
    (it died of a KeyError on "add", failing every request)."""
    monkeypatch.setattr(grammar_compiler, "_CACHE_SIZE", 1)
    local, remote = _managers(tokenizer)
    try:
        pairs = []
        for index in (1, 2):  # the second evicts the first's key from the cache of one
            for manager in (local, remote):
                params = SamplingParams(
                    max_tokens=8,
                    structured_outputs=StructuredOutputsParams(**CONSTRAINTS[index]),
                )
                request = Request(f"r{index}", [1, 2], params)
                manager.init_request(request)
                request.structured_output.compiled.result(timeout=120)  # type: ignore[union-attr]
                pairs.append(request)
        a, b = pairs[0], pairs[1]  # r1 of each manager, made ready only now
        assert local.is_ready(a) and remote.is_ready(b)
        np.testing.assert_array_equal(local.grammar_bitmask([a]), remote.grammar_bitmask([b]))
    finally:
        local.shutdown()
        remote.shutdown()


def test_a_key_compiled_again_while_its_first_compile_runs_finishes_both(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key evicted from the compile cache and asked for again while its first compile is
    still running in the process (several compile threads: a host with 4+ cores) compiles
    twice; both requests' compiles must finish. (The process's compile futures were keyed by
    the constraint: the second replaced the first, whose request then waited forever.)"""
    monkeypatch.setattr(grammar_compiler, "_CACHE_SIZE", 1)
    remote = StructuredOutputManager(
        functools.partial(load_tokenizer, str(TOKENIZER_DIR), False),
        QWEN3_VOCAB_SIZE,
        [tokenizer.eos_token_id],
        max_workers=4,
    )
    remote.use_grammar_process(None)
    try:
        requests = []
        for index in (1, 2, 1):  # the first compile loads the tokenizer: it runs for seconds
            params = SamplingParams(
                max_tokens=8, structured_outputs=StructuredOutputsParams(**CONSTRAINTS[index])
            )
            request = Request(f"r{len(requests)}", [1, 2], params)
            remote.init_request(request)
            requests.append(request)
        for request in requests:
            request.structured_output.compiled.result(timeout=60)  # type: ignore[union-attr]
            assert remote.is_ready(request)
        rows = remote.grammar_bitmask(requests)
        np.testing.assert_array_equal(rows[0], rows[2])
    finally:
        remote.shutdown()


def test_a_dropped_engine_stops_its_grammar_process(tiny_qwen3: Path) -> None:
    """An LLM garbage-collected without `shutdown` must not leave its grammar process running
    nor its shared-memory bitmasks in /dev/shm (the process's reply thread kept it alive
    until the interpreter exited; the multiprocess executor has a finalizer for its workers
    for the same reason)."""
    llm = make_llm(tiny_qwen3, async_scheduling=True)
    remote = llm.llm_engine.engine_core.structured_output_manager._remote
    assert remote is not None
    params = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,6}\d")
    )
    llm.generate(["x"], params, use_tqdm=False)
    process = remote._process._process  # type: ignore[union-attr]
    names = [buffer.name for buffer in remote._buffers]
    assert names and process.poll() is None
    del llm, remote
    gc.collect()
    assert process.wait(timeout=30) is not None
    assert not set(names) & set(os.listdir("/dev/shm"))


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("PAGEDSERVE_GRAMMAR_PROCESS", "grammar_process"),
        ("PAGEDSERVE_FP8_KV_F16_DOTS", "fp8_kv_f16_dots"),
    ],
)
def test_on_off_switches_take_0_or_1_only(
    monkeypatch: pytest.MonkeyPatch, name: str, read: str
) -> None:
    """The two switches: unset or empty is on, "0" is off, anything else names the variable."""
    from pagedserve import envs

    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, read)() is True
    monkeypatch.setenv(name, "0")
    assert getattr(envs, read)() is False
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=name):
        getattr(envs, read)()
