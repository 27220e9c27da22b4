"""Saving a benchmark's result as vLLM does (`--save-result`, `--result-dir`, `--output-json`)."""

import argparse
import json
from datetime import datetime
from pathlib import Path
from typing import Any


def add_result_args(parser: argparse.ArgumentParser, output_json: bool = True) -> None:
    """`--save-result [--result-dir DIR] [--result-filename NAME]` (and vLLM's `--output-json
    PATH` of `bench throughput` / `bench latency`)."""
    group = parser.add_argument_group("result options")
    group.add_argument("--save-result", action="store_true", help="write the result as JSON")
    group.add_argument("--result-dir", default=None, help="its folder (default: the current one)")
    group.add_argument(
        "--result-filename",
        default=None,
        help="its file name (default: BENCH-...-YYYYMMDD-HHMMSS.json)",
    )
    if output_json:
        group.add_argument("--output-json", default=None, help="also write the result here")


def timestamp() -> str:
    """The run's date as vLLM's result file names carry it (YYYYMMDD-HHMMSS)."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def model_tag(model: str) -> str:
    """A model path or Hub id's last part, for file names."""
    return Path(model.rstrip("/")).name or "model"


def save_result(args: argparse.Namespace, result: dict[str, Any], default_name: str) -> list[Path]:
    """Write `result` to --output-json and, with --save-result, to --result-dir /
    (--result-filename or `default_name`); return the paths written."""
    paths = []
    if getattr(args, "output_json", None):
        paths.append(Path(args.output_json))
    if args.save_result:
        paths.append(Path(args.result_dir or ".") / (args.result_filename or default_name))
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"result saved to {path}")
    return paths
