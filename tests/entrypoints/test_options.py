"""The CLI flags and the docs' option tables are generated from the option fields."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from pagedserve.config_options import option_default
from pagedserve.engine.arg_utils import EngineArgs, engine_args_from_namespace
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.cli_args import (
    ServerArgs,
    add_server_args,
    engine_table,
    server_table,
)
from pagedserve.entrypoints.openai.cli_args import main as cli_args_main
from pagedserve.entrypoints.options import flag_name, marked_region

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python -m pagedserve.entrypoints.openai.cli_args --markdown"


@pytest.mark.parametrize("argv", [["serve"], ["generate"]])
def test_each_engine_flag_defaults_to_the_engine_arg_default(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    for f in dataclasses.fields(EngineArgs):
        assert getattr(args, f.name) == f.default, f.name
    assert engine_args_from_namespace(args) == EngineArgs()


def test_each_server_flag_defaults_to_its_field() -> None:
    args = add_server_args(argparse.ArgumentParser()).parse_args([])
    for f in dataclasses.fields(ServerArgs):
        assert getattr(args, f.name) == option_default(f), f.name
    assert set(vars(args)) == {f.name for f in dataclasses.fields(ServerArgs)} | set(
        EngineArgs.field_names()
    )


def test_flags_keep_vllm_spelling_and_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    args = parse(["serve", "--no-enable-prefix-caching", "--async-scheduling", "--enforce-eager"])
    assert (args.enable_prefix_caching, args.async_scheduling, args.enforce_eager) == (
        False,
        True,
        True,
    )
    args = parse(["serve", "--max-model-len", "64", "--gpu-memory-utilization", "0.5"])
    assert args.max_model_len == 64 and args.gpu_memory_utilization == 0.5
    args = parse(["serve", "--served-model-name", "a", "b", "--keep-alive-on-engine-death"])
    assert args.served_model_name == ["a", "b"] and args.keep_alive_on_engine_death is True
    with pytest.raises(SystemExit):  # store_true flags have no --no- form
        parse(["serve", "--no-disable-log-stats"])
    with pytest.raises(SystemExit):
        parse(["serve", "--uvicorn-log-level", "loud"])
    assert "invalid choice: 'loud'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["serve", "--help"])
    serve_help = capsys.readouterr().out
    for name in EngineArgs.field_names():
        assert flag_name(name) in serve_help, name
    assert "--max-request-body-bytes" in serve_help


@pytest.mark.parametrize(
    ("path", "name", "table", "kind"),
    [
        ("README.md", "engine-options", engine_table, "engine"),
        ("docs/serving.md", "server-options", server_table, "server"),
    ],
)
def test_the_docs_tables_are_the_generated_ones(
    path: str, name: str, table: object, kind: str
) -> None:
    text = (ROOT / path).read_text()
    assert callable(table)
    assert marked_region(text, name) == table(), (
        f"{path}'s table between the {name} markers is stale: replace it by the output of "
        f"`{REGENERATE} {kind}`"
    )


def test_the_generator_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_args_main(["--markdown", "engine"]) == 0
    printed = capsys.readouterr().out
    assert printed == engine_table() + "\n"
    assert "| `max_model_len` | `--max-model-len` | the model's context |" in printed
    assert "`--enable-prefix-caching`, `--no-enable-prefix-caching` | `True` |" in printed
