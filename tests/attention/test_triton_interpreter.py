"""The Triton attention kernels on the CPU, under Triton's interpreter, in every CPU test run.

`tests/attention/test_triton_attention.py` marks its small-shape cases `gpu_or_interpreter`:
they run on a GPU, or on the CPU when TRITON_INTERPRET=1 is set before Triton is imported.
This test sets it for a child pytest over those cases (fp8 caches, sliding windows and soft
caps, Gemma-style alternating layers, split-KV with more splits than a request uses), so that
the kernels' indexing and split/combine logic is checked against the float64 reference without
a GPU (~30 s on 2 cores).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_CASES = "fp8 or sliding or alternates or uses_the_splits"


def test_triton_attention_kernels_under_the_interpreter() -> None:
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/attention/test_triton_attention.py",
            "-k",
            _CASES,
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        timeout=600,
    )
    summary = result.stdout.strip().splitlines()[-1:] or [""]
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    # The interpreter really ran them: these cases are skipped (not passed) without it.
    assert " passed" in summary[0] and "failed" not in summary[0], summary
    passed = int(summary[0].split(" passed")[0].split()[-1])
    assert passed >= 15, summary
