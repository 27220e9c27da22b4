"""`process_start.process_age_seconds`: the time since the process started, which the server's
"serving ... on ..." line reports as its time to ready."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_process_knows_how_long_ago_it_started() -> None:
    """A child that sleeps 1.5 s after its imports reports at least that much, and not much
    more (its interpreter start and imports take well under a minute)."""
    code = (
        "import time; from pagedserve.process_start import process_age_seconds; "
        "time.sleep(1.5); print(process_age_seconds())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    age = float(done.stdout)
    assert 1.5 <= age < 60
