"""EngineArgs takes every option's default and help from its config field: one definition each."""

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from pagedserve import config
from pagedserve.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from pagedserve.config_options import is_option, option, option_default
from pagedserve.engine import arg_utils
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.llm import LLM

CONFIGS = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    DeviceConfig,
    StructuredOutputsConfig,
)


def _config_options() -> dict[str, dataclasses.Field[Any]]:
    """Every option field of the configs by name; a name declared twice fails here."""
    found: dict[str, dataclasses.Field[Any]] = {}
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            if is_option(f):
                assert f.name not in found, f"{f.name} is declared by two configs"
                found[f.name] = f
    return found


def test_every_engine_arg_has_exactly_the_config_default_and_a_help() -> None:
    options = _config_options()
    assert [f.name for f in dataclasses.fields(EngineArgs)] == EngineArgs.field_names()
    assert set(EngineArgs.field_names()) == set(options)
    for f in dataclasses.fields(EngineArgs):
        source = options[f.name]
        assert f.default == option_default(source), f.name
        assert f.metadata["help"] and f.metadata == source.metadata, f.name
        if source.default is dataclasses.MISSING:  # derived: None, and the help says from what
            assert f.default is None and source.metadata["default_text"], f.name
    assert dataclasses.asdict(EngineArgs()) == {n: option_default(f) for n, f in options.items()}


def test_engine_args_source_writes_no_default() -> None:
    """Each EngineArgs field is `name: type = _FROM_CONFIG`: no literal there to drift."""
    tree = ast.parse(Path(inspect.getfile(arg_utils)).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    assigned = [n for n in body.body if isinstance(n, ast.AnnAssign)]
    assert len(assigned) == len(dataclasses.fields(EngineArgs))
    for node in assigned:
        assert isinstance(node.value, ast.Name) and node.value.id == "_FROM_CONFIG", node.lineno


def test_llm_keeps_the_engine_defaults_and_refuses_unknown_options() -> None:
    assert inspect.signature(LLM).parameters["model"].default == EngineArgs().model
    assert EngineArgs().model == config.DEFAULT_MODEL
    with pytest.raises(ValueError, match=r"unknown LLM option\(s\) \['max_num_seq'\]"):
        LLM(max_num_seq=4)


def test_options_from_refuses_a_missing_option_a_literal_default_or_a_wrong_type() -> None:
    """These checks run when arg_utils is imported: EngineArgs cannot drift from the configs."""
    options_from = arg_utils._options_from
    with pytest.raises(TypeError, match=r"missing \[.*'enable_prefix_caching'"):

        @options_from(CacheConfig)
        class Missing:
            block_size: int = arg_utils._FROM_CONFIG

    with pytest.raises(TypeError, match="block_size is declared by two configs"):
        options_from(CacheConfig, CacheConfig)
    fields = {f.name: f.type for f in dataclasses.fields(CacheConfig)}
    for name, kind, value in [
        ("block_size", int, 32),  # a second default
        ("block_size", float, arg_utils._FROM_CONFIG),  # another type
        ("kv_cache_memory_bytes", int, arg_utils._FROM_CONFIG),  # None dropped
    ]:
        annotations = {**fields, name: kind}
        body = {n: arg_utils._FROM_CONFIG for n in fields} | {name: value}
        cls = type("Drifted", (), {"__annotations__": annotations, **body})
        with pytest.raises(TypeError, match=f"Drifted.{name} must be"):
            options_from(CacheConfig)(cls)


def test_a_derived_option_must_say_how() -> None:
    with pytest.raises(ValueError, match="default_text"):
        option(help="no default, no text")


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: CacheConfig(block_size=3), "block_size must be a power of two"),
        (lambda: CacheConfig(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens must be"),
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size must be at least"),
        (lambda: ParallelConfig(distributed_executor_backend="x"), "distributed_executor_backend"),
        (lambda: DeviceConfig(device="tpu"), "device must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_the_configs_validate_their_own_options(make: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        make()


def test_model_options_are_checked_against_the_model() -> None:
    hf_config = arg_utils.load_hf_config(config.DEFAULT_MODEL)
    common: dict[str, Any] = {
        "tokenizer": "t",
        "hf_config": hf_config,
        "eos_token_ids": (),
        "quantization": None,
    }
    assert ModelConfig(max_model_len=512, **common).max_model_len == 512
    with pytest.raises(ValueError, match="larger than the model's context length"):
        ModelConfig(max_model_len=513, **common)
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        ModelConfig(max_model_len=8, seed=2**64, **common)
