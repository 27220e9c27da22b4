"""vLLM's command-line habits (issue 21): short forms (-tp, -pp, -dp), underscore spellings,
human-readable sizes, `--config FILE.yaml`, `--version`, and `serve`'s own usage on a bad flag.
Each form parses to the same options as the long form."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.entrypoints.argv import human_int, normalize_argv
from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.cli import main as cli_main
from pagedserve.entrypoints.openai import api_server


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(normalize_argv(argv, parser))


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("32768", 32768), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 10**6),
        ("2M", 2 * 2**20), ("4GiB", 4 * 2**30), ("4GB", 4 * 10**9), ("512MiB", 512 * 2**20),
        ("-1", -1), ("1g", 10**9), ("1T", 2**40),
    ],
)  # fmt: skip
def test_human_readable_ints(text: str, value: int) -> None:
    assert human_int(text) == value


@pytest.mark.parametrize("text", ["3x", "1.5", "k", "", "1.5K7", "0.0001k"])
def test_bad_sizes_name_the_accepted_forms(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="size suffix"):
        human_int(text)


def test_short_underscore_and_human_forms_parse_as_the_long_forms() -> None:
    short = parse(
        ["serve", "m", "-tp", "2", "-pp", "1", "-dp", "1", "--max_num_seqs=12",
         "--max_model_len", "32k", "--kv_cache_memory_bytes", "4GiB", "--enable_prefix_caching"]
    )  # fmt: skip
    long = parse(
        ["serve", "m", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
         "--data-parallel-size", "1", "--max-num-seqs", "12", "--max-model-len", "32000",
         "--kv-cache-memory-bytes", str(4 * 2**30), "--enable-prefix-caching"]
    )  # fmt: skip
    assert vars(short) == vars(long)
    assert short.tensor_parallel_size == 2 and short.max_model_len == 32000


def test_config_file_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "max_num_seqs: 12\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
        "disable-log-stats: true\nenable-log-requests: false\nport: 9002\n"
        "hf-overrides: {max_position_embeddings: 512}\nmax-model-len: 1k\n"
    )
    args = parse(["serve", "m", "--config", str(config), "--max-num-seqs", "5"])
    assert args.max_num_seqs == 5  # the command line wins
    assert args.enable_prefix_caching is False and args.disable_log_stats is True
    assert args.enable_log_requests is False and args.port == 9002
    assert args.served_model_name == ["a", "b"] and args.max_model_len == 1000
    assert args.hf_overrides == {"max_position_embeddings": 512}
    assert parse(["serve", f"--config={config}"]).max_num_seqs == 12


@pytest.mark.parametrize(
    ("text", "value"),
    [("9007199254740.993k", 9007199254740993), ("1.5k", 1500), ("0.5K", 512),
     ("18014398509481.985k", 18014398509481985)],
)  # fmt: skip
def test_human_readable_ints_are_exact(text: str, value: int) -> None:
    assert human_int(text) == value  # a float product would round these


@pytest.mark.parametrize("text", ["1.0000000000000001k", "1.2345k", "0.3K"])
def test_human_readable_ints_that_are_not_whole_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a whole number"):
        human_int(text)


def test_config_file_model_lists_json_values_and_nulls(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/x\nserved-model-name: [a, b]\n"
        'allowed_origins: ["https://a.example", "https://b.example"]\n'
        "hf-overrides: {rope_scaling: {factor: 2.0}, tie: true}\n"
        "root-path: null\napi-key: null\nmax-model-len: 1.5k\n"
    )
    args = parse(["serve", "--config", str(config)])
    assert args.model == "/models/x" and args.model_tag is None  # the YAML's model is used
    assert args.served_model_name == ["a", "b"]
    # A JSON-valued flag gets the YAML list (or mapping) as one JSON value.
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    assert args.hf_overrides == {"rope_scaling": {"factor": 2.0}, "tie": True}
    assert args.root_path is None and args.api_key is None  # null: the default, not "None"
    assert args.max_model_len == 1500
    # The command line's positional model wins, and a list last in the file cannot take it.
    config.write_text("model: /models/x\nserved-model-name: [a, b]\n")
    args = parse(["serve", "m", "--config", str(config)])
    assert args.model_tag == "m" and args.served_model_name == ["a", "b"]


@pytest.mark.parametrize(
    ("content", "words"),
    [(None, "cannot read it as YAML"), ("[1, 2]", "want a YAML mapping"), ("a: [", "YAML")],
)
def test_a_bad_config_file_ends_with_one_line(
    tmp_path: Path, content: str | None, words: str
) -> None:
    config = tmp_path / "bad.yaml"
    if content is not None:
        config.write_text(content)
    with pytest.raises(SystemExit) as e:
        parse(["serve", "--config", str(config)])
    assert words in str(e.value) and str(config) in str(e.value)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve.version import __version__

    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pagedserve {__version__}"


def test_a_bad_serve_flag_prints_serves_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "usage: pagedserve serve" in err and "unrecognized arguments: --no-such-flag" in err


def test_pipeline_parallel_size_parses_in_both_forms() -> None:
    assert parse(["serve", "m", "-pp", "2"]).pipeline_parallel_size == 2
    assert parse(["serve", "m", "--pipeline-parallel-size", "3"]).pipeline_parallel_size == 3


def test_data_parallel_size_below_one_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="data_parallel_size must be at least 1, got 0"):
        cli_main(["generate", "-dp", "0"])


def test_api_server_module_takes_the_same_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(api_server, "run_server", seen.append)
    api_server.main(["--max_num_seqs=7", "-tp", "1", "--max-model-len", "2k"])
    assert seen[0].max_num_seqs == 7 and seen[0].max_model_len == 2000


def test_requests_are_not_logged_unless_asked() -> None:
    assert parse(["serve"]).enable_log_requests is False
    assert parse(["serve", "--enable-log-requests"]).enable_log_requests is True


def test_help_lists_the_short_forms() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp" in out
    assert "-pp PIPELINE_PARALLEL_SIZE" in out and "-dp DATA_PARALLEL_SIZE" in out
    assert "--config FILE.yaml" in out


@pytest.mark.parametrize("argv", [["serve", "/no/such/model"], ["generate", "--model", "./nope"]])
def test_a_missing_model_folder_fails_before_the_heavy_imports(argv: list[str]) -> None:
    """The early failure loads neither torch, transformers nor the web stack (what made it
    take seconds), nor aiohttp (only `bench serve` uses it; 0.2 s of every server's start
    before its engine core starts); its time is a figure in BENCHMARKS.md, not an assert here."""
    code = (
        "import sys\nfrom pagedserve.entrypoints.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    print(e)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'aiohttp')"
        " if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert "does not exist" in out[0] and f"pagedserve {argv[0]}: error" in out[0]
    assert out[1] == "[]"
