"""Helpers the benchmark scripts share."""

import subprocess
from pathlib import Path


def git_commit() -> str:
    """`git describe --always --dirty` of this checkout, or "unknown" without git."""
    try:
        git = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        )
    except OSError:
        return "unknown"
    return git.stdout.strip() or "unknown"
