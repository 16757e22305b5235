"""A killed mpirun's session folder, met again by a later mpirun that got the same pid
(``session_dirs.py``): without the fresh start it cannot start at all; with it, it runs.

The stale folder is planted for the very pid mpirun will have: a shell makes it for its own pid
(``$$``) and then ``exec``s the launch, which keeps the pid. ``TMPDIR`` points at the test's own
folder, where Open MPI puts its session folders, so nothing outside the test is touched."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nanotron_recover.launcher import mpirun_command
from nanotron_recover.session_dirs import fresh_session
from tests.helpers.mpirun_utils import single_rank_env

pytestmark = pytest.mark.mpi

# What SIGKILL leaves of an mpirun: its folder with the PMIx rendezvous files named for its pid.
PLANT_STALE = (
    'd="$TMPDIR/ompi.$$"; mkdir -p "$d"; h=$(uname -n); '
    'echo stale > "$d/pmix.$h.tool"; echo stale > "$d/pmix.$h.tool.$$"; exec "$@"'
)


def run_after_a_dead_one(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = single_rank_env({"TMPDIR": str(tmp_path)})
    return subprocess.run(
        ["sh", "-c", PLANT_STALE, "sh", *cmd], env=env, capture_output=True, text=True, timeout=120
    )


def test_mpirun_meeting_a_stale_folder_of_its_pid_does_not_start(tmp_path):
    """The cause, as Open MPI 5.0.11 behaves: this is what the fresh start exists for."""
    out = run_after_a_dead_one(mpirun_command(1, ["true"]), tmp_path)
    assert out.returncode != 0
    assert "listener thread failed to start" in out.stderr


def test_mpirun_started_fresh_runs_over_a_stale_folder_of_its_pid(tmp_path):
    out = run_after_a_dead_one(fresh_session(mpirun_command(2, ["sh", "-c", "echo rank-ran"])), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("rank-ran") == 2


def test_a_command_without_mpirun_is_left_as_it_is():
    assert fresh_session(["python", "-m", "x"]) == ["python", "-m", "x"]
    wrapped = fresh_session(["timeout", "9", "mpirun", "-n", "2", "p"])
    assert wrapped[:3] == ["timeout", "9", "sh"] and wrapped[4:] == ["ompi", "mpirun", "-n", "2", "p"]
