"""The supervisor's watch of processes alone on their node: a frozen one is removed (a repair), or
the job is relaunched when it cannot be; a healthy or shared-host process is never touched."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover import fencing
from nanotron_recover.frozen_processes import FrozenProcessWatch, Watched
from nanotron_recover.ft.liveness import heartbeat_file, rank_heartbeat_file
from nanotron_recover.ft.processes import ProcessInfo, _start_ticks
from nanotron_recover.ft.records import read_records
from nanotron_recover.ft.suspects import note_suspects


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rank_table(run_dir: Path, rows: list[tuple[int, str, int]]) -> None:
    table = [
        {"rank": r, "host": h, "pid": p, "start_ticks": _start_ticks(p), "replica": r} for r, h, p in rows
    ]
    # As the job writes it: aside, then renamed (a watch tells its launch's table by the new file).
    (run_dir / "ranks.json.tmp").write_text(json.dumps(table))
    os.replace(run_dir / "ranks.json.tmp", run_dir / "ranks.json")


def beat(run_dir: Path, host: str, pid: int, launched: bool = False, at: float | None = None) -> Path:
    path = heartbeat_file(run_dir, host, pid, launched)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    if at is not None:
        os.utime(path, (at, at))
    return path


def rank_beat(run_dir: Path, host: str, pid: int) -> Path:
    """A launch rank's own beat file (``.rank``), as it writes it."""
    path = rank_heartbeat_file(run_dir, host, pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


@pytest.fixture
def sleepers():
    """Starts idle processes (stand-ins for ranks) on call; every one is ended after the test."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def sleeper(sleepers):
    return sleepers()


def test_a_frozen_process_alone_on_this_host_is_recorded_and_killed(tmp_path, sleeper):
    here = socket.gethostname()
    beat(tmp_path, here, sleeper.pid, at=1000.0)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, "node-a", 11), (1, "node-a", 12), (2, here, sleeper.pid)])
    assert watch.poll() is None  # first sight: its age starts now, whatever the file's clock says
    clock.now = 7.9  # 5 s timeout + 3 periods (one, and two for the ranks' own monitors)
    assert watch.poll() is None and sleeper.poll() is None and watch.lost_at is None
    clock.now = 8.1
    assert watch.poll() is None  # removed: a repair, no relaunch
    assert watch.lost_at == 8.1  # the commit deadline's repair bound starts here
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    (record,) = read_records(tmp_path, [2])
    assert (record["kind"], record["pid"], record["time"]) == ("hang", sleeper.pid, 1000.0)
    assert "removed by the supervisor" in record["message"]
    assert watch.poll() is None  # once


def test_when_every_process_is_silent_the_job_is_relaunched_at_once(tmp_path, sleepers):
    """Every rank of the table silent (all SIGKILLed at once, and mpirun did not end): no member
    can repair the step, so the watch asks for the relaunch instead of a repair bound."""
    here = socket.gethostname()
    procs = [sleepers() for _ in range(3)]
    for p in procs:
        beat(tmp_path, here, p.pid, at=1000.0)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(r, here, p.pid) for r, p in enumerate(procs)])
    assert watch.poll() is None
    beat(tmp_path, here, procs[2].pid)  # one still beats: a member is left
    clock.now = 13.2  # past the shared-host bound (two timeouts + three periods)
    assert watch.poll() is None
    assert [p.wait(timeout=10) for p in procs[:2]] == [-signal.SIGKILL] * 2
    clock.now = 30.0  # the last one went silent too
    said = watch.poll()
    assert said is not None and "every process of the job (3)" in said, said
    assert procs[2].wait(timeout=10) == -signal.SIGKILL


def test_the_last_member_silent_after_the_job_removed_the_others_is_a_relaunch(tmp_path, sleepers):
    """The job shrank one rank away (its file silent, marked removed), then its last member went
    silent too: nobody is left, so the watch asks for the relaunch."""
    here = socket.gethostname()
    gone, last = sleepers(), sleepers()
    beat(tmp_path, here, gone.pid, at=1000.0)
    marker = fencing.removed_marker(tmp_path, here, gone.pid)
    marker.parent.mkdir(exist_ok=True)
    marker.touch()
    beat(tmp_path, here, last.pid)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, here, gone.pid), (1, here, last.pid)])
    assert watch.poll() is None
    clock.now = 13.2
    said = watch.poll()
    assert said is not None and "every process of the job (2)" in said, said
    assert gone.wait(timeout=10) == -signal.SIGKILL and last.wait(timeout=10) == -signal.SIGKILL


def test_a_process_with_no_heartbeat_file_yet_keeps_the_job_from_being_relaunched(tmp_path, sleeper):
    """A rank that has not beaten yet (no file) is not a silent one: a repair may still come."""
    here = socket.gethostname()
    beat(tmp_path, here, sleeper.pid, at=1000.0)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, here, sleeper.pid), (1, "node-b", 12)])
    assert watch.poll() is None
    clock.now = 8.1
    assert watch.poll() is None and watch.lost_at == 8.1  # removed, a repair bound: no relaunch
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


def test_a_silent_process_the_job_removed_is_killed_with_no_loss_and_no_relaunch(tmp_path, sleeper):
    """A rank the job shrank away (the runtime reported its death) stays in the rank table until a
    re-join replaces it, and its file goes silent. The job may be re-joining its replacement right
    then (a spawn across hosts: about 11 s): no record, no repair bound, which used to end such a
    re-join as a stall; and one on a host the watch cannot reach is no reason to relaunch."""
    here = socket.gethostname()
    beat(tmp_path, here, sleeper.pid, at=1000.0)
    beat(tmp_path, "node-b", 12, at=1000.0)
    for host, pid in ((here, sleeper.pid), ("node-b", 12)):
        marker = fencing.removed_marker(tmp_path, host, pid)
        marker.parent.mkdir(exist_ok=True)
        marker.touch()
    clock = Clock()
    watch = FrozenProcessWatch(
        tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock, slurm_job=""
    )
    rank_table(tmp_path, [(0, "node-a", 11), (1, "node-b", 12), (2, here, sleeper.pid)])
    assert watch.poll() is None
    clock.now = 8.1
    assert watch.poll() is None  # node-b's process cannot be killed (no Slurm): not a relaunch
    assert watch.lost_at is None
    assert sleeper.wait(timeout=10) == -signal.SIGKILL  # in case it was frozen, not dead
    assert read_records(tmp_path) == []


def test_the_table_an_earlier_launch_left_is_not_watched(tmp_path, sleeper):
    """A relaunch's watch starts while the ended job's rank table is still there (the new job
    writes its own only once it has started: 28 s under load, measured). Those processes are gone
    and their files silent: nothing is recorded or killed for them, and the new table is watched
    as soon as it appears."""
    here = socket.gethostname()
    rank_table(tmp_path, [(0, here, sleeper.pid)])  # the ended launch's
    beat(tmp_path, here, sleeper.pid, at=1000.0)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    for now in (0.0, 10.0, 30.0):
        clock.now = now
        assert watch.poll() is None
    assert sleeper.poll() is None and read_records(tmp_path) == [] and watch.lost_at is None
    # This launch's (the same process, to test, and a node-mate elsewhere that is not silent).
    rank_table(tmp_path, [(0, here, sleeper.pid), (1, "node-a", 11)])
    watch.poll()
    clock.now = 40.0
    assert watch.poll() is None and watch.lost_at == 40.0
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


def test_a_beating_process_is_never_touched_whatever_its_clock(tmp_path, sleeper):
    here = socket.gethostname()
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, here, sleeper.pid)])
    for i in range(40):
        # A node whose clock is hours behind: every beat still changes the file's time.
        beat(tmp_path, here, sleeper.pid, at=1000.0 + i)
        clock.now = i * 1.0
        assert watch.poll() is None
    assert sleeper.poll() is None and read_records(tmp_path) == [] and watch.lost_at is None


def test_a_launch_rank_with_a_node_mate_gets_one_more_timeout_first(tmp_path, sleeper):
    """A launch rank's own beat (``.rank``): ULFM and its node-mates' monitors act within the
    timeout; the supervisor only after one more, should the news not have reached the others."""
    here = socket.gethostname()
    rank_beat(tmp_path, here, sleeper.pid)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, here, sleeper.pid), (1, here, os.getpid())])
    watch.poll()
    clock.now = 12.9  # 2 x 5 s + 3 periods
    assert watch.poll() is None and sleeper.poll() is None
    clock.now = 13.1
    assert watch.poll() is None
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    (record,) = read_records(tmp_path, [0])
    assert record["kind"] == "hang" and "13 s" in record["message"]


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "with_node_mates"])
def test_a_launch_rank_a_rank_named_failed_is_removed_after_the_timeout_alone(tmp_path, sleeper, alone):
    """A rank's ULFM detector declared the process failed and named it (``ft/suspects.py``): once
    its own file has not changed for the heartbeat timeout it is removed, without the periods'
    wait, since the other ranks may not have been told and wait for its death."""
    here = socket.gethostname()
    rank_beat(tmp_path, here, sleeper.pid)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rows = [(0, here, sleeper.pid), (1, "node-a", 11) if alone else (1, here, os.getpid())]
    rank_table(tmp_path, rows)
    watch.poll()
    clock.now = 5.5
    assert watch.poll() is None and sleeper.poll() is None  # silent, but nobody named it
    note_suspects(tmp_path, [ProcessInfo(0, here, sleeper.pid, None)], my_host="another-node")
    assert watch.poll() is None
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    (record,) = read_records(tmp_path, [0])
    assert record["kind"] == "hang" and "for 5 s" in record["message"], record
    assert watch.lost_at == 5.5


def test_a_named_launch_rank_that_died_gets_no_record_and_no_repair_bound(tmp_path, sleeper):
    """A crash the runtime reported (named too) that the job has not repaired yet, on a long step:
    no ``hang`` record (the incident stays a crash) and no repair bound."""
    here = socket.gethostname()
    rank_beat(tmp_path, here, sleeper.pid)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, here, sleeper.pid), (1, "node-a", 11)])
    watch.poll()
    sleeper.kill()
    sleeper.wait(timeout=10)
    note_suspects(tmp_path, [ProcessInfo(0, here, sleeper.pid, None)], my_host="another-node")
    clock.now = 5.5
    assert watch.poll() is None and watch.lost_at is None and read_records(tmp_path) == []
    clock.now = 30.0
    assert watch.poll() is None and read_records(tmp_path) == []  # once


def test_a_named_spawned_process_keeps_its_bound(tmp_path, sleeper):
    """The timeout alone holds for launch ranks' own files only: a spawned process is not watched
    by ULFM's detector, so its name comes from a death report, not a verdict."""
    here = socket.gethostname()
    beat(tmp_path, here, sleeper.pid)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, here, sleeper.pid), (1, "node-a", 11)])
    note_suspects(tmp_path, [ProcessInfo(0, here, sleeper.pid, None)], my_host="another-node")
    watch.poll()
    clock.now = 7.9
    assert watch.poll() is None and read_records(tmp_path) == [] and sleeper.poll() is None
    clock.now = 8.1
    assert watch.poll() is None
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.parametrize("there", [True, False], ids=["frozen", "dead"])
def test_a_named_remote_launch_rank_is_checked_on_its_node_first(tmp_path, monkeypatch, there):
    """On another node: one srun step tells whether the named process still runs (exit 3: gone);
    only a running one gets the record and the kill."""
    calls: list[list[str]] = []

    def srun(cmd, timeout_s, output=True):
        calls.append(cmd)
        if "kill -KILL" in cmd[-1]:
            return 0, ""
        return (0 if there else 3), ""

    monkeypatch.setattr("nanotron_recover.frozen_processes.run_bounded", srun)
    rank_beat(tmp_path, "node-b", 4242)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, 1.0, 5.0, slurm_job="77", local_host="batch", clock=clock)
    rank_table(tmp_path, [(0, "node-a", 11), (1, "node-b", 4242)])
    note_suspects(tmp_path, [ProcessInfo(1, "node-b", 4242, None)], my_host="node-a")
    watch.poll()
    clock.now = 5.5
    assert watch.poll() is None
    assert "exit 3" in calls[0][-1] and "p=4242" in calls[0][-1]
    if there:
        assert len(calls) == 2 and "kill -KILL $p" in calls[1][-1]
        (record,) = read_records(tmp_path, [1])
        assert record["kind"] == "hang" and watch.lost_at == 5.5
    else:
        assert len(calls) == 1 and read_records(tmp_path) == [] and watch.lost_at is None


def test_a_named_process_that_still_beats_is_never_touched(tmp_path, sleeper):
    """A detector's mistake (the process is healthy and beats): the name alone removes nothing."""
    here = socket.gethostname()
    path = beat(tmp_path, here, sleeper.pid)
    clock = Clock()
    watch = FrozenProcessWatch(tmp_path, period_s=1.0, timeout_s=5.0, local_host=here, clock=clock)
    rank_table(tmp_path, [(0, here, sleeper.pid)])
    note_suspects(tmp_path, [ProcessInfo(0, here, sleeper.pid, None)], my_host="another-node")
    for second in range(1, 30):
        clock.now = float(second)
        os.utime(path, (1000.0 + second, 1000.0 + second))
        assert watch.poll() is None
    assert sleeper.poll() is None and read_records(tmp_path) == []


def test_a_remote_process_is_killed_through_slurm_or_the_job_is_relaunched(tmp_path, monkeypatch):
    beat(tmp_path, "node-b", 4242, launched=True)  # a launch rank left alone in its launch world
    calls = []

    def srun(cmd, timeout_s, output=True):
        calls.append(cmd)
        return (0 if answer else 1), ""

    monkeypatch.setattr("nanotron_recover.frozen_processes.run_bounded", srun)
    clock = Clock()
    answer = True
    watch = FrozenProcessWatch(tmp_path, 1.0, 5.0, slurm_job="77", local_host="batch", clock=clock)
    rank_table(tmp_path, [(0, "node-a", 11), (1, "node-b", 4242)])
    watch.poll()
    clock.now = 9.0
    assert watch.poll() is None
    (cmd,) = calls
    assert cmd[:8] == ["srun", "--overlap", "--jobid=77", "-N", "1", "-n", "1", "-w"] and cmd[8] == "node-b"
    assert "kill -KILL $p" in cmd[-1] and "p=4242" in cmd[-1]

    # The node does not run the step (frozen or cut off as a whole): relaunch.
    rank_table(tmp_path, [(0, "node-a", 11), (1, "node-c", 4343)])
    beat(tmp_path, "node-c", 4343)
    answer = False
    watch.poll()
    clock.now = 20.0
    said = watch.poll()
    assert said is not None and "rank 1 (pid 4343 on node-c, alone on its node)" in said
    # Without Slurm a remote process cannot be reached: relaunch too.
    no_slurm = FrozenProcessWatch(tmp_path, 1.0, 5.0, slurm_job="", local_host="batch", clock=clock)
    rank_table(tmp_path, [(0, "node-a", 11), (1, "node-c", 4343)])  # its launch's table
    no_slurm.poll()
    clock.now = 40.0
    assert no_slurm.poll() is not None


def test_the_remote_kill_spares_a_reused_pid(tmp_path, sleeper, monkeypatch):
    """The shell line run on the node: a pid whose start time differs is not the frozen process."""
    scripts = []
    monkeypatch.setattr(
        "nanotron_recover.frozen_processes.run_bounded",
        lambda cmd, timeout_s, output=True: (scripts.append(cmd[-1]), (0, ""))[1],
    )
    watch = FrozenProcessWatch(tmp_path, 1.0, 5.0, slurm_job="1", local_host="batch")
    ticks = _start_ticks(sleeper.pid)
    assert ticks is not None
    assert watch._kill(Watched(1, 1, "node-b", sleeper.pid, ticks + 1))
    assert watch._kill(Watched(1, 1, "node-b", sleeper.pid, ticks))
    reused, same = scripts
    subprocess.run(["sh", "-c", reused], check=True, timeout=10)
    time.sleep(0.2)
    assert sleeper.poll() is None  # another start time: left alone
    subprocess.run(["sh", "-c", same], check=True, timeout=10)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
