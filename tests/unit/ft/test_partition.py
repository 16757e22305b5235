"""Which side of a cut network goes on: heartbeat files as the failed ranks' processes leave them,
a fake clock for the wait, and real beating and killed processes for the two cases that matter."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from nanotron_recover.ft.liveness import heartbeat_file, rank_heartbeat_file
from nanotron_recover.ft.partition import WATCH_PERIODS, PartitionGuard, is_smaller_side
from nanotron_recover.ft.processes import ProcessInfo

HOST = socket.gethostname()
PERIOD = 1.0


def infos(n: int) -> list[ProcessInfo]:
    return [ProcessInfo(rank=r, host=f"node{r}", pid=1000 + r, start_ticks=None) for r in range(n)]


def beat(run_dir: Path, info: ProcessInfo, at: float, spawned: bool = False) -> None:
    path = (
        heartbeat_file(run_dir, info.host, info.pid)
        if spawned
        else rank_heartbeat_file(run_dir, info.host, info.pid)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.utime(path, (at, at))


class FakeTime:
    def __init__(self, start: float) -> None:
        self.now, self.slept = start, 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s


def guard(run_dir: Path, t: FakeTime) -> PartitionGuard:
    return PartitionGuard(run_dir, PERIOD, clock=t.clock, sleep=t.sleep, host="here")


def test_a_majority_goes_on_at_once(tmp_path):
    t = FakeTime(100.0)
    for info in infos(3):
        beat(tmp_path, info, at=150.0)  # even beating after the failure
    verdict = guard(tmp_path, t).check([0, 1, 2], [1], infos(3), detected_at=100.0)
    assert not verdict.smaller and t.slept == 0.0


def test_a_minority_whose_failed_ranks_are_silent_goes_on_after_two_periods(tmp_path):
    """Two of three replicas crashed: their last beats are older than the failure."""
    t = FakeTime(100.0)
    procs = infos(3)
    beat(tmp_path, procs[1], at=99.5)
    beat(tmp_path, procs[2], at=99.9, spawned=True)  # a spawned process's file counts the same
    verdict = guard(tmp_path, t).check([0, 1, 2], [1, 2], procs, detected_at=100.0)
    assert not verdict.smaller and verdict.beating == ()
    assert t.now == pytest.approx(100.0 + WATCH_PERIODS * PERIOD)


def test_a_minority_whose_failed_ranks_still_beat_is_the_smaller_side(tmp_path):
    """A node cut off alone: the two others, declared failed by it, beat on."""
    t = FakeTime(100.0)
    procs = infos(3)
    beat(tmp_path, procs[0], at=100.4)
    beat(tmp_path, procs[2], at=100.6)
    verdict = guard(tmp_path, t).check([0, 1, 2], [0, 2], procs, detected_at=100.0)
    assert verdict.smaller and verdict.beating == (0, 2)
    assert t.slept == 0.0  # the beats were there at the first look


def test_one_failed_rank_beating_does_not_outweigh_a_side_of_two(tmp_path):
    """Four ranks, three declared failed from a side of one: only one of them beats (the others
    crashed), so the side of one is not outnumbered; a side of one facing two beating ones is."""
    t = FakeTime(100.0)
    procs = infos(4)
    beat(tmp_path, procs[3], at=101.0)
    assert not guard(tmp_path, t).check([0, 1, 2, 3], [1, 2, 3], procs, detected_at=100.0).smaller
    t2 = FakeTime(100.0)
    beat(tmp_path, procs[2], at=101.0)
    assert guard(tmp_path, t2).check([0, 1, 2, 3], [1, 2, 3], procs, detected_at=100.0).smaller


def test_failed_ranks_of_this_host_are_not_watched(tmp_path):
    """A process on this host is on this side of any cut: a job on one host never waits."""
    t = FakeTime(100.0)
    procs = [ProcessInfo(rank=r, host="here", pid=1000 + r, start_ticks=None) for r in range(3)]
    beat(tmp_path, procs[1], at=101.0)
    beat(tmp_path, procs[2], at=101.0)
    verdict = guard(tmp_path, t).check([0, 1, 2], [1, 2], procs, detected_at=100.0)
    assert not verdict.smaller and t.slept == 0.0


def test_a_tie_goes_to_the_side_with_the_lowest_rank():
    assert is_smaller_side(mine=[2, 3], beating=[0, 1])
    assert not is_smaller_side(mine=[0, 1], beating=[2, 3])
    assert not is_smaller_side(mine=[0], beating=[])


def test_real_processes_a_beating_one_and_a_killed_one(tmp_path):
    """Real heartbeat threads: a side of one facing one failed rank that beats on (a cut) and
    one that was SIGKILLed. Tie of one against one: the beating rank 0 holds the lowest rank."""
    from tests.unit.ft.test_liveness import beating_child

    alive = beating_child(tmp_path, 0.1)
    dead = beating_child(tmp_path, 0.1)
    try:
        dead.kill()
        dead.wait(timeout=10)
        detected_at = time.time()
        procs = [
            ProcessInfo(rank=0, host=HOST, pid=alive.pid, start_ticks=None),
            ProcessInfo(rank=1, host=HOST, pid=dead.pid, start_ticks=None),
            ProcessInfo(rank=2, host=HOST, pid=os.getpid(), start_ticks=None),
        ]
        real = PartitionGuard(tmp_path, 0.1, host="elsewhere")  # the children count as other hosts'
        verdict = real.check([0, 1, 2], [0, 1], procs, detected_at=detected_at)
        assert verdict.smaller and verdict.beating == (0,)
        assert not real.check([0, 1, 2], [1], procs, detected_at=detected_at).smaller
    finally:
        for child in (alive, dead):
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
