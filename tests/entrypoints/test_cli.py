"""`pagedserve serve` and `python -m pagedserve.entrypoints.openai.api_server` share one parser."""

import argparse

from pagedserve.entrypoints.cli import build_parser
from pagedserve.entrypoints.openai.cli_args import add_server_args, resolve_server_args

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
    assert args.port == 8000 and args.api_key == "from-env"
    assert args.served_model_name == [args.model] and "stories260k" in args.model
    assert build_parser().parse_args(["generate"]).command == "generate"
