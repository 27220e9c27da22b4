"""`pagedserve serve` and `python -m pagedserve.entrypoints.openai.api_server` share one parser."""

import argparse

import pytest

from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.cli import main as cli_main
from pagedserve.entrypoints.openai.api_server import run_server
from pagedserve.entrypoints.openai.cli_args import add_server_args, resolve_server_args
from pagedserve.entrypoints.openai.launch import read_chat_template

FLAGS = [
    "--host", "127.0.0.1", "--port", "9001", "--served-model-name", "tiny", "other",
    "--api-key", "k", "--chat-template", "t.jinja", "--dtype", "float32", "--max-model-len", "64",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--block-size", "8",
    "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "1000000",
    "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "1", "--seed", "3",
    "--load-format", "dummy", "--disable-log-requests", "--disable-log-stats",
]  # fmt: skip


def test_serve_and_api_server_parse_the_same_flags() -> None:
    serve = resolve_server_args(build_parser().parse_args(["serve", "/models/x", *FLAGS]))
    module = add_server_args(argparse.ArgumentParser())
    direct = resolve_server_args(module.parse_args(["--model", "/models/x", *FLAGS]))
    for name in vars(direct):
        assert getattr(serve, name) == getattr(direct, name), name
    assert serve.model == "/models/x" and serve.port == 9001
    assert serve.served_model_name == ["tiny", "other"]
    assert serve.enable_prefix_caching is False and serve.block_size == 8


def test_defaults(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    args = resolve_server_args(build_parser().parse_args(["serve"]))
    assert args.port == 8000 and args.api_key == ["from-env"]
    assert args.served_model_name == ["stories260k"] and "stories260k" in args.model
    assert resolve_server_args(build_parser().parse_args(["serve", "x"])).served_model_name == ["x"]
    assert build_parser().parse_args(["generate"]).command == "generate"


def test_an_empty_api_key_is_no_key(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """As vLLM: `--api-key ""` leaves the API open (not a key of nothing)."""
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    args = resolve_server_args(build_parser().parse_args(["serve", "--api-key", ""]))
    assert args.api_key is None
    args = resolve_server_args(build_parser().parse_args(["serve", "--api-key", "", "k"]))
    assert args.api_key == ["k"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--max-num-seqs", "0"], ["max_num_seqs must be positive"]),
        (["--max-model-len", "0"], ["max_model_len must be positive"]),
        (["--max-num-batched-tokens", "0"], ["max_num_batched_tokens must be positive"]),
        (["--block-size", "3"], ["block_size", "power of two"]),
        (["--device", "tpu"], ["device must be auto, cpu, cuda or cuda:N"]),
        (["--seed", str(2**80)], ["seed must fit in 64 bits"]),
        (["--tensor-parallel-size", "3"], ["num_attention_heads (8)", "tensor_parallel_size (3)"]),
        (["--chat-template", "/no/such/template.jinja"], ["neither a file nor a Jinja template"]),
        (["--chat-template", "{% for %}"], ["--chat-template does not compile"]),
        (["--host", "256.256.256.256"], ["cannot listen on 256.256.256.256"]),
        (["--kv-cache-memory-bytes", str(10**18)], ["does not fit on cpu", "kv_cache_memory"]),
    ],
)
def test_bad_serve_flags_end_with_one_line(flags: list[str], words: list[str]) -> None:
    """Each was a traceback, or (chat template) a server that started and then blamed every
    client; the kv-cache case fails inside the engine-core process and comes back by name."""
    args = build_parser().parse_args(["serve", "--device", "cpu", "--port", "0", *flags])
    with pytest.raises(SystemExit) as exit_info:
        run_server(args)
    message = str(exit_info.value.code)
    assert message.startswith("pagedserve serve: error: ") and "\n" not in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    "flags", [["--port", "99999"], ["--port", "-1"], ["--stats-log-interval", "0"],
              ["--stats-log-interval", "nan"]],
)  # fmt: skip
def test_out_of_range_server_flags_are_argparse_errors(flags: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *flags])
    assert exit_info.value.code == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err


def test_chat_templates_compile_as_transformers_does(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """transformers' templates may use loop controls and {% generation %}; a plain jinja2
    Environment refused both, and with them valid --chat-template files."""
    template = (
        "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    )
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == template
    assert read_chat_template(template) == template


def test_port_errors_name_the_flag(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "abc"])
    assert "invalid port value: 'abc'" in capsys.readouterr().err


def test_a_bad_max_n_sequences_variable_fails_at_start(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """It used to start, then fail every request with a 500."""
    monkeypatch.setenv("PAGEDSERVE_MAX_N_SEQUENCES", "many")
    args = build_parser().parse_args(["serve", "--device", "cpu", "--port", "0"])
    with pytest.raises(SystemExit, match="PAGEDSERVE_MAX_N_SEQUENCES must be a positive"):
        run_server(args)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--max-tokens", "0"], "SamplingParams.max_tokens must be at least 1"),
        (["--temperature", "-1"], "SamplingParams.temperature must be >= 0"),
        (["--max-num-seqs", "0"], "max_num_seqs must be positive"),
    ],
)
def test_bad_generate_flags_end_with_one_line(flags: list[str], words: str) -> None:
    """They printed a traceback (and the sampling ones only after loading the model)."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["generate", "--device", "cpu", *flags])
    message = str(exit_info.value.code)
    assert message.startswith("pagedserve generate: error: ") and words in message


def _unsupported_checkpoints(tmp_path) -> list[tuple[list[str], str]]:  # type: ignore[no-untyped-def]
    """(flags, words) of checkpoints refused with NotImplementedError: one when the config is
    read (a compressed-tensors layer left unquantized), one in the engine-core process when
    the model is built (online FP8 of a GPT-2)."""
    import json
    import shutil
    from pathlib import Path

    from tests.entrypoints.test_llm_greedy import CONFIGS, save_tiny_model

    fixture = Path(__file__).parents[1] / "quantization" / "fixtures" / "ct-fp8-dynamic"
    ct = tmp_path / "ct"
    shutil.copytree(fixture, ct)
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    (ct / "config.json").write_text(json.dumps(config))
    gpt2 = save_tiny_model(CONFIGS["gpt2"], tmp_path / "gpt2")
    return [
        ([str(ct)], "ignore lists 'model.layers.0.mlp.down_proj'"),
        ([str(gpt2), "--quantization", "fp8"], "GPT2LMHeadModel does not support quantized"),
    ]


def test_unsupported_checkpoints_end_serve_and_generate_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Both were tracebacks: NotImplementedError was not caught, and the engine-core process
    sent it back as a RuntimeError holding its whole stack."""
    for flags, words in _unsupported_checkpoints(tmp_path):
        args = build_parser().parse_args(["serve", *flags, "--device", "cpu", "--port", "0"])
        with pytest.raises(SystemExit) as exit_info:
            run_server(args)
        message = str(exit_info.value.code)
        assert message.startswith("pagedserve serve: error: ") and "\n" not in message
        assert words in message, message
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["generate", "--model", *flags, "--device", "cpu"])
        message = str(exit_info.value.code)
        assert message.startswith("pagedserve generate: error: ") and words in message


def test_a_refused_checkpoint_ends_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint the quantization code refuses (NotImplementedError, here a compressed-tensors
    INT8 kv_cache_scheme) printed a traceback from both commands."""
    import json
    import shutil
    from pathlib import Path

    fixture = Path(__file__).parents[1] / "quantization" / "fixtures" / "ct-fp8-dynamic"
    folder = tmp_path / "ct-kv"
    shutil.copytree(fixture, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "int"}
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = Path(__file__).parents[2] / "pagedserve" / "assets" / "stories260k"
    flags = ["--device", "cpu", "--tokenizer", str(tokenizer)]
    for command, argv in [
        ("generate", ["generate", "--model", str(folder), *flags]),
        ("serve", ["serve", str(folder), "--port", "0", *flags]),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        message = str(exit_info.value.code)
        assert message.startswith(f"pagedserve {command}: error: "), message
        assert "kv_cache_scheme" in message and "not supported" in message
        assert "\n" not in message


def test_generate_takes_generation_config_defaults_and_flags_win(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`pagedserve generate` logged the generation config's defaults but used its own flag
    defaults (64 tokens); now a flag wins, then the model's default, then the command's."""
    import json

    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    base = ["generate", "--device", "cpu", "--generation-config", str(tmp_path)]
    for flags, expected in [([], "5 tokens"), (["--max-tokens", "3"], "3 tokens")]:
        assert cli_main([*base, "--prompt", "Once upon a time", *flags]) == 0
        assert f"(finish_reason: length, {expected})" in capsys.readouterr().out
