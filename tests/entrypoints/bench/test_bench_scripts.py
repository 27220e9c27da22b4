"""benchmarks/throughput.py, now on `bench throughput`'s code, keeps its flags and output."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_throughput_script_on_a_preset() -> None:
    command = [sys.executable, "benchmarks/throughput.py", "--preset", "tiny-llama-4m",
               "--num-prompts", "3", "--input-len", "6:10", "--output-len", "4",
               "--device", "cpu", "--max-num-seqs", "4"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Throughput: " in done.stdout and "Total num output tokens:  12" in done.stdout
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "throughput" and result["num_prompts"] == 3
    ours = result["results"]["pagedserve"]
    assert ours["output_tokens"] == 12 and ours["seconds"] > 0
