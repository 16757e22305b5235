"""A spawned process whose join the members gave up dies, even while a C call holds its GIL (as
``MPI_Init`` does); its watcher ends when it is released or when the process dies."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.ft import spawn_start
from nanotron_recover.ft.abandoned_join import ENV, abandon, join_id, marker
from tests.helpers.mpirun_utils import process_exists

# A stand-in for a spawned process: it starts its watcher, says the watcher's pid, then runs what
# the test asks for (``HOLD``: a C call that keeps the GIL for 60 s, as MPI_Init waiting for parents).
STAND_IN = """
import ctypes, os, sys, time
from nanotron_recover.ft.abandoned_join import start_watcher
w = start_watcher(sys.argv[1], sys.argv[2], 0.05)
print(w.proc.pid, flush=True)
what = sys.argv[3]
if what == "hold":
    ctypes.PyDLL(None).sleep(60)
elif what == "release":
    w.release()
    print("released", flush=True)
    time.sleep(float(sys.argv[4]))
elif what == "die":
    os._exit(3)
"""


def stand_in(tmp_path: Path, join: str, what: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", STAND_IN, str(tmp_path), join, what, *extra],
        stdout=subprocess.PIPE,
        text=True,
    )


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_exists(pid):  # a zombie counts as gone
            return True
        time.sleep(0.05)
    return False


def test_join_names_are_alike_for_alike_inputs_and_differ_otherwise():
    assert join_id(0, 3, 41) == join_id(0, 3, 41) == "0-3-41"
    assert len({join_id(0, 3, 41), join_id(1, 3, 41), join_id(0, 4, 41), join_id(0, 3, 42)}) == 4


def test_the_marker_kills_a_process_whose_gil_is_held(tmp_path):
    proc = stand_in(tmp_path, "0-1-5", "hold")
    try:
        watcher = int(proc.stdout.readline())
        time.sleep(0.3)
        assert proc.poll() is None  # no marker: the process lives on
        assert abandon(tmp_path, "0-1-5") and marker(tmp_path, "0-1-5").exists()
        assert proc.wait(timeout=30) == -9
        assert wait_gone(watcher)
    finally:
        proc.kill()
        proc.wait()


def test_another_joins_marker_kills_nothing(tmp_path):
    proc = stand_in(tmp_path, "0-1-5", "hold")
    try:
        proc.stdout.readline()
        abandon(tmp_path, "0-1-6")
        abandon(tmp_path, "1-1-5")
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
    finally:
        proc.kill()
        proc.wait()


def test_a_released_process_outlives_a_later_marker(tmp_path):
    proc = stand_in(tmp_path, "0-2-9", "release", "1.0")
    try:
        watcher = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "released"
        assert wait_gone(watcher, timeout=10)
        abandon(tmp_path, "0-2-9")
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_the_watcher_ends_with_its_process(tmp_path):
    proc = stand_in(tmp_path, "0-2-9", "die")
    watcher = int(proc.stdout.readline())
    assert proc.wait(timeout=30) == 3
    assert wait_gone(watcher)


def test_an_unwritable_run_folder_is_reported_not_raised(tmp_path):
    (tmp_path / "joins").write_text("a file where the folder goes")
    assert abandon(tmp_path, "0-1-1") is False


def test_the_cli_starts_the_watcher_when_the_spawn_names_the_join(tmp_path):
    """``import nanotron_recover.cli`` with the spawn's variables: the process beats, its watcher
    runs (its command line is not the CLI's, so nothing counts it as a rank), both variables are
    gone from the environment, and the marker then kills the process."""
    code = (
        "import os, time, nanotron_recover.cli as c\n"
        "from nanotron_recover.ft import spawn_start\n"
        f"print(spawn_start._watcher.proc.pid, {ENV!r} in os.environ, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, spawn_start.ENV: spawn_start.beat_value(tmp_path, 0.1), ENV: "2-7-30"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        watcher, inherited = proc.stdout.readline().split()
        assert inherited == "False"
        cmdline = Path(f"/proc/{watcher}/cmdline").read_bytes().decode()
        assert "abandoned_join.py" in cmdline and "nanotron_recover.cli" not in cmdline
        assert any((tmp_path / "heartbeats").iterdir())
        abandon(tmp_path, "2-7-30")
        assert proc.wait(timeout=30) == -9
    finally:
        proc.kill()
        proc.wait()


def test_joined_members_releases_the_watcher(tmp_path, monkeypatch):
    class Recorder:
        released = 0

        def release(self) -> None:
            Recorder.released += 1

    monkeypatch.setattr(spawn_start, "_watcher", Recorder())
    spawn_start.joined_members()
    spawn_start.joined_members()  # once only
    assert Recorder.released == 1 and spawn_start._watcher is None
