"""Structured outputs end to end on a tiny random Qwen3 (real Qwen3 tokenizer): outputs obey
their constraints (JSON schemas, regexes, choices, EBNF), constrained requests leave the
others alone, and the grammar state survives n > 1, seeds, preemption and async scheduling."""

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams

from .conftest import make_llm


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A bounded JSON schema (every output of it is short): nested objects, arrays, enums,
    integers and numbers with bounds, booleans, short strings, required fields."""
    kinds = ["integer", "number", "boolean", "enum", "string"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 4)}
    if kind == "array":
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    names = rng.sample(["id", "name", "size", "tags", "ok", "kind", "score"], rng.randint(1, 4))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    return {
        "type": "object",
        "properties": properties,
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


def constrained(max_tokens: int = 256, seed: int | None = 0, **constraint: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def texts(llm: LLM, prompts: list[str], params: Any) -> list[tuple[str, str | None]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


def test_100_random_json_schemas_validate(llm: LLM) -> None:
    rng = random.Random(17)
    schemas = [random_schema(rng) for _ in range(100)]
    params = [
        constrained(json=s, disable_any_whitespace=True, seed=i) for i, s in enumerate(schemas)
    ]
    outputs = texts(llm, [f"JSON {i}:" for i in range(100)], params)
    for schema, (text, finish_reason) in zip(schemas, outputs, strict=True):
        assert finish_reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    stats = llm.llm_engine.engine_core.structured_output_manager.stats()
    assert stats.num_cache_misses >= 1 and stats.compile_seconds > 0


def test_regex_choice_and_ebnf_outputs(llm: LLM) -> None:
    regex = r"[a-z]{2,5}-\d{1,3}(\.[A-Z])?"
    choices = ["yes", "no", "it depends", "ça va"]
    # sums of small numbers: the regex below is the same language
    ebnf = 'root ::= term (("+" | "*") term){0,3}\nterm ::= [1-9] [0-9]? | "(" root ")"'
    prompts = ["a", "b", "c", "d"]
    for text, finish in texts(llm, prompts, [constrained(regex=regex, seed=i) for i in range(4)]):
        assert finish == "stop" and re.fullmatch(regex, text), text
    for text, finish in texts(
        llm, prompts, [constrained(choice=choices, seed=i) for i in range(4)]
    ):
        assert finish == "stop" and text in choices, text
    outputs = texts(
        llm, prompts, [constrained(grammar=ebnf, seed=i, max_tokens=64) for i in range(4)]
    )
    for text, finish in outputs:
        assert finish == "stop", text
        assert _parses_arithmetic(text), text


def _parses_arithmetic(text: str) -> bool:
    """The EBNF's language by recursive descent: root = term (op term){0,3}."""
    pos = 0

    def root() -> bool:
        nonlocal pos
        if not term():
            return False
        for _ in range(3):
            if pos < len(text) and text[pos] in "+*":
                pos += 1
                if not term():
                    return False
        return True

    def term() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not root() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        match = re.match(r"[1-9][0-9]?", text[pos:])
        if match is None:
            return False
        pos += match.end()
        return True

    return root() and pos == len(text)


def test_constrained_requests_leave_unconstrained_greedy_outputs_unchanged(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["The cat", "Once upon", "1 2 3"]
    alone = texts(llm, prompts, greedy)
    mixed_params = [greedy, constrained(regex=r"\d{3}"), greedy, constrained(choice=["x"]), greedy]
    mixed = texts(llm, ["The cat", "q", "Once upon", "r", "1 2 3"], mixed_params)
    assert [mixed[0], mixed[2], mixed[4]] == alone
    assert re.fullmatch(r"\d{3}", mixed[1][0]) and mixed[3][0] == "x"


def test_n_and_seeds(llm: LLM) -> None:
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
              "minItems": 1, "maxItems": 4}  # fmt: skip
    params = SamplingParams(
        n=4, max_tokens=64, temperature=1.0, seed=7,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
    )  # fmt: skip
    first = texts(llm, ["numbers:"], params)
    again = texts(llm, ["numbers:"], params)
    assert first == again  # seeded: the same outputs
    assert len(first) == 4 and len({t for t, _ in first}) > 1  # each child its own matcher
    for text, finish in first:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "options",
    [{}, {"preemption_mode": "swap", "swap_space": 0.01, "async_scheduling": True}],
    ids=["recompute", "swap-async"],
)
def test_preemption_keeps_grammar_state(tiny_qwen3: Path, options: dict[str, Any]) -> None:
    """A cache of a few blocks preempts requests mid-output (recomputed, or swapped out and
    back with a token in flight); their grammars must match the kept tokens, so the outputs
    equal those of an unpreempted run."""
    schema = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
              "minItems": 4, "maxItems": 6}  # fmt: skip
    params = [
        constrained(json=schema, disable_any_whitespace=True, seed=i, max_tokens=48)
        for i in range(6)
    ]
    prompts = [f"list {i} " * 6 for i in range(6)]
    roomy = make_llm(tiny_qwen3)
    expected = texts(roomy, prompts, params)
    roomy.llm_engine.shutdown()
    tight = make_llm(
        tiny_qwen3,
        num_gpu_blocks_override=12,
        max_model_len=96,
        max_num_batched_tokens=96,
        **options,
    )
    got = texts(tight, prompts, params)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert (tight.llm_engine.scheduler.num_swap_outs_total > 0) == bool(options)
    tight.llm_engine.shutdown()
    assert got == expected
    for text, finish in got:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_async_scheduling_matches_sync(tiny_qwen3: Path) -> None:
    """Async scheduling (the next step planned while this one runs): a constrained request is
    scheduled ahead too, its bitmask filled once the step before has applied its tokens;
    the outputs equal the sync engine's."""
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
              "v": {"type": "integer", "minimum": 0, "maximum": 9999}},
              "required": ["k", "v"]}  # fmt: skip
    params = [
        constrained(json=schema, disable_any_whitespace=True, seed=1),
        SamplingParams(max_tokens=20, temperature=0.0),
        constrained(regex=r"(ab|cd){2,6}", seed=2),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3),
    ]
    prompts = ["x", "y", "z", "w"]
    results = []
    for async_scheduling in (False, True):
        engine = make_llm(tiny_qwen3, async_scheduling=async_scheduling)
        results.append(texts(engine, prompts, params))
        engine.llm_engine.shutdown()
    assert results[0] == results[1]
    jsonschema.validate(json.loads(results[1][0][0]), schema)


def test_async_constrained_requests_run_every_step(tiny_qwen3: Path) -> None:
    """Under async scheduling a constrained request samples at every step (its bitmask is
    filled while the forward runs), not every other step waiting for its token in flight:
    16 tokens take ~17 steps, not ~32. (The GPU figure: BENCHMARKS.md, issue 17.)"""
    engine = make_llm(tiny_qwen3, async_scheduling=True)
    try:
        core = engine.llm_engine.engine_core
        assert core.scheduler.defer_grammar
        steps = 0
        launch = core.executor.launch_forward

        def counted(scheduler_output: Any) -> Any:
            nonlocal steps
            steps += 1
            return launch(scheduler_output)

        core.executor.launch_forward = counted
        params = constrained(regex=r"(ab|cd){8}", seed=None, max_tokens=64)
        params.temperature = 0.0
        [output] = engine.generate(["x"], params, use_tqdm=False)
        num_tokens = len(output.outputs[0].token_ids)
        assert re.fullmatch(r"(ab|cd){8}", output.outputs[0].text)
        assert 0 < steps <= num_tokens + 2, (steps, num_tokens)
    finally:
        engine.llm_engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_waits_for_a_compile_instead_of_spinning(
    tiny_qwen3: Path, async_scheduling: bool
) -> None:
    """While its only request waits for its grammar, the engine blocks on the compile instead
    of calling `schedule` in a tight loop: a compile that takes 0.3 s costs some 15
    schedules (one per 20 ms wait at most), not ~115,000."""
    engine = make_llm(tiny_qwen3, async_scheduling=async_scheduling)
    try:
        core = engine.llm_engine.engine_core
        manager = core.structured_output_manager
        compile_once = manager._compiler._compile
        window: list[float] = []  # when the compile started and ended

        def slow_compile(params: Any, key: str) -> Any:
            window.append(time.monotonic())
            time.sleep(0.3)
            try:
                return compile_once(params, key)
            finally:
                window.append(time.monotonic())

        manager._compiler._compile = slow_compile
        during = 0  # schedules while the compile ran
        schedule = core.scheduler.schedule

        def counted() -> Any:
            nonlocal during
            if len(window) == 1:
                during += 1
            return schedule()

        core.scheduler.schedule = counted
        params = constrained(regex=r"(ab|cd){4}", seed=None, max_tokens=16)
        params.temperature = 0.0
        [output] = engine.generate(["y"], params, use_tqdm=False)
        assert re.fullmatch(r"(ab|cd){4}", output.outputs[0].text)
        # One schedule per 20 ms wait at most (fewer on a loaded machine), not a tight loop.
        assert during <= (window[1] - window[0]) / 0.02 + 3, (during, window)
    finally:
        engine.llm_engine.shutdown()


def test_compile_cache_hits(llm: LLM) -> None:
    manager = llm.llm_engine.engine_core.structured_output_manager
    before = manager.stats()
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"]}
    params = constrained(json=schema, disable_any_whitespace=True)
    texts(llm, ["a", "b", "c"], params)
    after = manager.stats()
    assert after.num_cache_misses - before.num_cache_misses == 1
    assert after.num_cache_hits - before.num_cache_hits == 2


@pytest.mark.parametrize(
    "constraint",
    [
        {"regex": "[a-z"},
        {"json": {"type": "nonsense"}},
        {"json": "{not json"},
        {"grammar": "root ::= undefined_rule"},
    ],  # fmt: skip
)
def test_invalid_constraints_are_refused_before_the_engine(
    llm: LLM, constraint: dict[str, Any]
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["x"], constrained(**constraint), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert not llm.llm_engine.has_unfinished_requests()
    assert texts(llm, ["x"], constrained(choice=["ok"])) == [("ok", "stop")]  # still serving


def test_chat_with_json_object(llm: LLM) -> None:
    params = constrained(json_object=True, disable_any_whitespace=True, max_tokens=200)
    outputs = llm.chat([{"role": "user", "content": "Reply in JSON"}], params, use_tqdm=False)
    text = outputs[0].outputs[0].text
    if outputs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random model may write a long object: it is still an object's prefix
        assert text.startswith("{")


@pytest.mark.parametrize(
    ("constraint", "text"),
    [({"choice": ["yes", "no"]}, ("yes", "no")), ({"regex": "ab"}, ("ab",)),
     ({"json": {"type": "boolean"}}, ("true", "false"))],
)  # fmt: skip
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_does_not_outlast_a_complete_grammar(
    llm: LLM, constraint: dict[str, Any], text: tuple[str, ...], temperature: float
) -> None:
    """Once the grammar is complete only EOS is allowed; min_tokens' EOS ban must not then
    ban every token (the output went on with garbage): the request ends with "stop"."""
    params = SamplingParams(
        max_tokens=12, min_tokens=6, temperature=temperature, seed=1,
        structured_outputs=StructuredOutputsParams(**constraint),
    )  # fmt: skip
    output = llm.generate(["Answer:"], params, use_tqdm=False)[0].outputs[0]
    assert output.text in text and output.finish_reason == "stop", output
    assert output.token_ids[-1] == llm.get_tokenizer().eos_token_id
