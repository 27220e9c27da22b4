"""Starting pagedserve's own processes (tensor-parallel workers, the engine core) so that they
never run the user's main script again.

multiprocessing's 'spawn' and 'forkserver' start methods import the parent's `__main__` in
every child, to find what it pickled from there. A script without an
`if __name__ == "__main__":` guard then builds an engine again inside the child, which fails
("worker rank 1 died"), and a script read from standard input cannot be imported at all. Our
children run pagedserve functions on plain data (EngineConfig, EngineArgs as a dict) and need
nothing from `__main__`, so their start leaves it out; scripts work with or without the guard,
whatever the start method (vLLM gets the same with 'fork', but fork is unsafe once CUDA or
torch's OpenMP pool exists in the parent, which 'spawn'/'forkserver' are not).
"""

import contextlib
import multiprocessing
import os
import threading
from collections.abc import Iterator
from multiprocessing import spawn
from typing import Any

_LOCK = threading.Lock()

REIMPORTED_MAIN_MESSAGE = (
    "pagedserve cannot start an engine while a child process imports the main script "
    '(multiprocessing\'s "spawn" or "forkserver" start method): put the script\'s code under '
    '`if __name__ == "__main__":`'
)


@contextlib.contextmanager
def main_not_reimported() -> Iterator[None]:
    """Within this block, processes started with 'spawn' or 'forkserver' skip importing the
    parent's `__main__` (their target and arguments must not come from it). Processes other
    threads start meanwhile skip it too: keep the block to the `start()` calls."""
    with _LOCK:
        original = spawn.get_preparation_data

        def preparation_data(name: str) -> dict[str, Any]:
            data: dict[str, Any] = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            spawn.get_preparation_data = original


def check_not_importing_main() -> None:
    """Raise RuntimeError naming the fix (a main guard) when this process is a 'spawn' or
    'forkserver' child still importing the main script: a script without a guard, started by
    a process the user's own code made, would otherwise build a whole engine there."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(REIMPORTED_MAIN_MESSAGE)


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against
    /proc/uptime, at the clock-tick resolution); None where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            # after the ")" that ends the command name: field 3 (state) is index 0, so the
            # start time (field 22, in clock ticks after boot) is index 19
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None
