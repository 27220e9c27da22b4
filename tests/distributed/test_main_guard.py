"""Scripts without an `if __name__ == "__main__":` guard, run as real processes (issue 13,
item 17): the README's tensor-parallel form used to end in "tensor-parallel worker rank 1
... died", and AsyncLLMEngine's engine core died at start, because starting our processes
re-ran the script; from standard input the script could not be imported at all."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve import process_start
from pagedserve.process_start import check_not_importing_main, main_not_reimported
from tests.conftest import SHARED_MODELS

REPO = Path(__file__).resolve().parents[2]

# No main guard, on purpose: the form users save from the README.
SCRIPT = f"""
import asyncio
from pagedserve import LLM, SamplingParams
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.async_engine import AsyncLLMEngine

MODEL = {str(SHARED_MODELS / "stories260k")!r}
SMALL = dict(device="cpu", max_model_len=64, kv_cache_memory_bytes=2**20)
GREEDY = SamplingParams(max_tokens=4, temperature=0)

with LLM(MODEL, tensor_parallel_size=2, **SMALL) as llm:
    print("TP:" + llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].text)

engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=MODEL, **SMALL), log_stats=False)

async def main():
    async for output in engine.generate("Once upon a time", GREEDY, "r"):
        final = output
    print("ASYNC:" + final.outputs[0].text)

asyncio.run(main())
engine.shutdown()
"""


@pytest.mark.parametrize("form", ["file", "stdin"])
def test_a_script_without_main_guard_runs(form: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if form == "file":
        path = tmp_path / "script.py"
        path.write_text(SCRIPT)
        command, stdin = [sys.executable, str(path)], None
    else:
        command, stdin = [sys.executable, "-"], SCRIPT
    result = subprocess.run(
        command, input=stdin, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "TP:, there was a" in lines, result.stdout  # the greedy text of the default model
    assert "ASYNC:, there was a" in lines, result.stdout


def test_main_is_left_out_only_inside_the_block() -> None:
    original = process_start.spawn.get_preparation_data
    with main_not_reimported():
        data = process_start.spawn.get_preparation_data("x")
        assert "init_main_from_path" not in data and "init_main_from_name" not in data
        assert data["sys_path"] == sys.path  # the rest is kept: the child finds pagedserve
    assert process_start.spawn.get_preparation_data is original


def test_an_engine_built_while_importing_main_names_the_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a child started by the user's own spawn, re-running an unguarded script, gets."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=r'if __name__ == "__main__":'):
        check_not_importing_main()
