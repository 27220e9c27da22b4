"""The torch threads of a CPU rank (`worker.cpu_threads`): the cores it may run on, less the
reserved ones (the server's engine core leaves one to the API server's process), split between
the ranks; OMP_NUM_THREADS wins when set."""

import os

import pytest

from pagedserve import envs
from pagedserve.worker.worker import cpu_threads


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(envs.CPU_RESERVED, raising=False)


@pytest.mark.usefixtures("eight_cores")
def test_threads_split_the_unreserved_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_threads(1) == 8 and cpu_threads(2) == 4 and cpu_threads(3) == 2
    monkeypatch.setenv(envs.CPU_RESERVED, "1")
    assert cpu_threads(1) == 7 and cpu_threads(2) == 3
    monkeypatch.setenv(envs.CPU_RESERVED, "8")
    assert cpu_threads(1) == 1  # never fewer than one
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(1) is None  # torch took the user's setting at start-up


@pytest.mark.usefixtures("eight_cores")
@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_a_bad_reserved_count_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(envs.CPU_RESERVED, raw)
    with pytest.raises(ValueError, match=f"PAGEDSERVE_CPU_NUM_OF_RESERVED_CPU .*{raw!r}"):
        cpu_threads(1)
