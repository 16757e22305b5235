"""Heartbeats of the processes ULFM does not watch (spawned ones, a launch rank left alone in its
world): real child processes, really frozen with SIGSTOP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nanotron_recover.ft.liveness import (
    LAUNCH_SUFFIX,
    JoinWatch,
    SpawnedMonitor,
    beat_once_alone,
    heartbeat_file,
    start_heartbeat,
)
from nanotron_recover.ft.processes import ProcessInfo, reap

HOST = socket.gethostname()


def beating_child(run_dir: Path, period_s: float, launched: bool = False) -> subprocess.Popen:
    """A process that beats like a spawned rank (``launched``: like a launch rank left alone in its
    world), then idles; started with a hard timeout."""
    code = (
        "import sys, time\n"
        "from nanotron_recover.ft.liveness import start_heartbeat\n"
        f"start_heartbeat({str(run_dir)!r}, {period_s}, launched={launched})\n"
        "print('beating', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "beating"
    return child


def info_of(child: subprocess.Popen, rank: int = 5) -> ProcessInfo:
    return ProcessInfo(rank=rank, host=HOST, pid=child.pid, start_ticks=None)


@pytest.fixture
def child(tmp_path):
    proc = beating_child(tmp_path, 0.05)
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def test_the_heartbeat_file_keeps_being_touched(tmp_path):
    start_heartbeat(tmp_path, 0.05)
    path = heartbeat_file(tmp_path, HOST, os.getpid())
    first = path.stat().st_mtime
    time.sleep(0.3)
    assert path.stat().st_mtime > first


def test_a_frozen_child_is_found_once_and_removed(tmp_path, child):
    found: list[tuple[int, float]] = []
    info = info_of(child)

    def on_frozen(frozen: ProcessInfo, last_beat: float, age: float) -> None:
        found.append((frozen.pid, age))
        reap(frozen)

    monitor = SpawnedMonitor(tmp_path, 0.05, 0.5, lambda: [info], on_frozen)
    assert monitor.check() == [], "a beating process is alive"
    os.kill(child.pid, signal.SIGSTOP)
    monitor.start()
    child.wait(timeout=10)  # SIGKILLed by the monitor
    monitor.stop()
    assert child.returncode == -signal.SIGKILL
    ((pid, age),) = found
    assert pid == child.pid and age > 0.5, "not before the timeout"


def test_a_launch_rank_beats_only_once_alone_in_its_world(tmp_path):
    alone = threading.Event()
    path = heartbeat_file(tmp_path, HOST, os.getpid(), launched=True)
    beat(tmp_path, path.name, 0.0)  # an earlier process's, under a recycled pid
    beat_once_alone(tmp_path, 0.05, alone.is_set)
    time.sleep(0.3)
    assert not path.exists(), "ULFM's detector watches a launch rank with a live peer in its world"
    alone.set()
    deadline = time.time() + 10
    while not path.exists() and time.time() < deadline:
        time.sleep(0.02)
    first = path.stat().st_mtime
    time.sleep(0.3)
    assert path.stat().st_mtime > first, "touched every period from then on"
    assert not heartbeat_file(tmp_path, HOST, os.getpid()).exists(), "not named like a spawned process"


def test_a_frozen_launch_rank_left_alone_is_found_and_removed(tmp_path):
    child = beating_child(tmp_path, 0.05, launched=True)
    try:
        found: list[int] = []

        def on_frozen(frozen: ProcessInfo, last_beat: float, age: float) -> None:
            found.append(frozen.pid)
            reap(frozen)

        monitor = SpawnedMonitor(tmp_path, 0.05, 0.5, lambda: [info_of(child)], on_frozen)
        assert monitor.check() == []
        os.kill(child.pid, signal.SIGSTOP)
        monitor.start()
        child.wait(timeout=10)
        monitor.stop()
        assert child.returncode == -signal.SIGKILL and found == [child.pid]
    finally:
        child.kill()
        child.wait(timeout=10)


def test_what_the_monitor_leaves_alone(tmp_path, child):
    calls = []
    beating = info_of(child, rank=1)
    stale = tmp_path / "heartbeats"
    # A launch rank (no heartbeat file), a process of another host, and a stale file whose process
    # is gone: none of them is this monitor's business.
    launch = ProcessInfo(rank=0, host=HOST, pid=os.getppid(), start_ticks=None)
    elsewhere = ProcessInfo(rank=2, host=HOST + "-other", pid=child.pid, start_ticks=None)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    dead = ProcessInfo(rank=3, host=HOST, pid=gone.pid, start_ticks=None)
    (stale / f"{HOST}.{gone.pid}").touch()
    os.utime(stale / f"{HOST}.{gone.pid}", (0, 0))
    monitor = SpawnedMonitor(
        tmp_path, 0.05, 0.5, lambda: [launch, elsewhere, dead, beating], lambda *found: calls.append(found)
    )
    assert monitor.check(now=time.time()) == [] and calls == []
    # The same beating process seen from far in the future is frozen.
    assert monitor.check(now=time.time() + 60) == [beating]
    assert [c[0] for c in calls] == [beating] and calls[0][2] > 59
    assert monitor.check(now=time.time() + 60) == [], "each process is handed over once"


def beat(run_dir: Path, name: str, at: float) -> None:
    path = run_dir / "heartbeats" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.utime(path, (at, at))


def join_watch(run_dir: Path, expected: int, lost: list[str]) -> JoinWatch:
    return JoinWatch(run_dir, expected, period_s=0.05, timeout_s=5.0, start_s=30.0, on_lost=lost.append)


def test_join_watch_finds_a_spawned_process_gone_silent_but_not_the_older_ones(tmp_path):
    now = time.time()
    beat(tmp_path, "host.100", now - 600)  # a process spawned by an earlier join, dead since
    watch = join_watch(tmp_path, expected=2, lost=[])
    beat(tmp_path, "host.201", now)
    beat(tmp_path, "host.202", now)
    assert watch.check(now + 4.0) is None
    beat(tmp_path, "host.201", now + 4.0)  # still beating; 202 is not
    reason = watch.check(now + 5.5)
    assert reason is not None and "host.202 sent no heartbeat for 5.5 s" in reason


def test_join_watch_does_not_count_a_launch_rank_that_began_to_beat(tmp_path):
    watch = join_watch(tmp_path, expected=1, lost=[])
    beat(tmp_path, f"host.100{LAUNCH_SUFFIX}", watch.began + 1.0)  # its last launch peer died
    assert (
        watch.check(watch.began + 31.0) == "0 of the 1 spawned processes started within 31 s of the re-join"
    )


def test_join_watch_finds_a_spawned_process_that_never_started(tmp_path):
    watch = join_watch(tmp_path, expected=2, lost=[])
    beat(tmp_path, "host.201", watch.began + 29.0)
    assert watch.check(watch.began + 29.5) is None  # the second may still be importing
    assert (
        watch.check(watch.began + 31.0) == "1 of the 2 spawned processes started within 31 s of the re-join"
    )


def test_join_watch_thread_reports_once_and_stops_with_the_join(tmp_path):
    lost: list[str] = []
    with join_watch(tmp_path, expected=1, lost=lost) as watch:
        beat(tmp_path, "host.301", time.time() - 10)  # appeared, then silent past the timeout
        deadline = time.time() + 10
        while not lost and time.time() < deadline:
            time.sleep(0.02)
    assert len(lost) == 1 and "host.301" in lost[0] and watch.lost == lost[0]
    lost.clear()
    with join_watch(tmp_path, expected=1, lost=lost):
        pass  # a join that completed at once: nothing reported after it
    time.sleep(0.2)
    assert lost == []
    with join_watch(tmp_path, expected=0, lost=lost) as idle:
        assert not idle._thread.is_alive()  # no process spawned (orphans reused): no watch
