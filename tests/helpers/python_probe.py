"""Run a few lines of Python in a fresh interpreter: what a module imports, or how a process ends,
can only be seen from a process that has not already imported the test's own modules."""

from __future__ import annotations

import subprocess
import sys

PROBE_TIMEOUT_S = 120


def probe_stdout(code: str) -> str:
    """The standard output of ``python -c code``, which must exit 0 (its output is in the failure)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
