"""Heartbeat files for the processes that ULFM's detector does not watch.

ULFM's heartbeat detector (Open MPI 5.0, ``ompi/communicator/ft/comm_ft_detector.c``) runs on each
process's own ``MPI_COMM_WORLD`` only, its ranks arranged in a ring where each observes the next
alive one. Two kinds of process are outside every ring, and if one freezes (SIGSTOP, a node that
stops answering) the others wait for it forever (a crashed one is reported by the runtime, or, once
no process of the launch is left and the runtime reports no death, by its node-mates'
``death_notices.py`` and its peers' broken TCP connections):

- a process spawned by a re-join: it has a world of its own (measured: a SIGSTOPped spawned process
  was not reported to its parents within 40 s);
- a launch rank whose launch world has no other live process, the others having died and their
  places taken by spawned processes: the detector's ring walk then finds only itself, and Open MPI
  turns the detector off on that rank ("every other node is dead": no observer, no observed). Found
  by a fault campaign: dp=4, the launch ranks 0, then 1 and 2 killed and re-joined, then rank 3
  frozen: nothing committed until the supervisor's commit deadline relaunched the job.

The protocol has two sides:

- each such process runs a daemon thread that touches its heartbeat file every heartbeat period:
  a spawned process ``<run_dir>/heartbeats/<host>.<pid>`` from its start (:func:`start_heartbeat`),
  a launch rank ``<host>.<pid>.launch`` from the moment its world has no other live process
  (:func:`beat_once_alone`). A frozen process stops it, the same way it stops the failure watch
  that carries ULFM's heartbeats;
- every rank runs a monitor thread that, every period, looks at the files of the current grid's
  processes that run on *its own host*. A file older than the heartbeat timeout, whose process
  still runs, belongs to a frozen process.

The monitor writes the failure record that the frozen rank cannot write itself (kind ``hang``, at
the time of its last heartbeat), then SIGKILLs the process. The death is then reported as a crash
is (by the runtime, or by the node-mates' death notices), and forward recovery and re-join take
over. Several monitors on one host may act on the same process; a second SIGKILL and an identical
record change nothing.

A frozen process on a host where no other process of the job runs has no such monitor: the
supervisor watches its file and removes it on its node (``frozen_processes.py``). ``run_dir`` must
be on a file system that the watched process and the ranks on its host
share, as it must be for checkpoints.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .processes import ProcessInfo, still_running

LAUNCH_SUFFIX = ".launch"
# Every launch rank's own beat, from its start, read by the supervisor only (``frozen_processes.py``):
# ULFM's detector watches these ranks, but a freeze it finds on one node did not always reach the
# ranks of the others (measured on the emulated cluster: survivors spun in the reduction for
# minutes). The ranks' monitors do not look at it.
RANK_SUFFIX = ".rank"
NOT_SPAWNED = (LAUNCH_SUFFIX, RANK_SUFFIX)


def heartbeat_file(run_dir: str | Path, host: str, pid: int, launched: bool = False) -> Path:
    """A spawned process's heartbeat file, or (``launched``) a launch rank's: a name of its own, so
    that readers counting spawned processes (the join watch, ``watch``) do not count it."""
    return Path(run_dir) / "heartbeats" / f"{host}.{pid}{LAUNCH_SUFFIX if launched else ''}"


def rank_heartbeat_file(run_dir: str | Path, host: str, pid: int) -> Path:
    """A launch rank's own beat (:data:`RANK_SUFFIX`)."""
    return Path(run_dir) / "heartbeats" / f"{host}.{pid}{RANK_SUFFIX}"


def start_rank_heartbeat(run_dir: str | Path, period_s: float) -> threading.Thread:
    """A launch rank's beat from its start, for the supervisor (:data:`RANK_SUFFIX`)."""
    return start_heartbeat(
        run_dir, period_s, path=rank_heartbeat_file(run_dir, socket.gethostname(), os.getpid())
    )


def start_heartbeat(
    run_dir: str | Path, period_s: float, launched: bool = False, path: Path | None = None
) -> threading.Thread:
    """Touch this process's heartbeat file (or ``path``) every ``period_s`` from a daemon thread,
    starting now. A file this process already beats to keeps its thread (a spawned process
    starts beating in ``spawn_start.py``, before its imports, and again once it runs)."""
    path = path or heartbeat_file(run_dir, socket.gethostname(), os.getpid(), launched)
    key = os.path.abspath(path)
    if key in _beating and _beating[key].is_alive():
        return _beating[key]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()  # exists before this returns: a monitor may look at once

    def beat() -> None:
        while True:
            try:
                path.touch()
            except OSError:
                pass  # a full or missing disk: the monitors then see a stale file, as for a freeze
            time.sleep(period_s)

    thread = threading.Thread(target=beat, name="spawned-heartbeat", daemon=True)
    thread.start()
    _beating[key] = thread
    return thread


_beating: dict[str, threading.Thread] = {}  # heartbeat file -> the thread that touches it


def alone_in_world() -> bool:
    """Whether every other process of this process's ``MPI_COMM_WORLD`` is known to have failed:
    then ULFM's detector watches this process no more (see the module docstring)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    failed = world.Get_failed()
    try:
        return failed.Get_size() >= world.Get_size() - 1
    finally:
        failed.Free()


def beat_once_alone(
    run_dir: str | Path, period_s: float, alone: Callable[[], bool] = alone_in_world
) -> threading.Thread:
    """A launch rank's daemon thread: every ``period_s`` it asks ``alone()``; the first time it is
    true it starts this process's heartbeat (:func:`start_heartbeat`, ``launched``) and ends. The
    monitors then watch this rank like a spawned process. A file left under this pid by an earlier
    process (a recycled pid, in a run directory a relaunch reuses) is removed first: it would make a
    monitor take this rank for a frozen one."""
    for launched in (False, True):
        try:
            heartbeat_file(run_dir, socket.gethostname(), os.getpid(), launched).unlink()
        except OSError:
            pass

    def wait() -> None:
        while True:
            try:
                if alone():
                    start_heartbeat(run_dir, period_s, launched=True)
                    return
            except Exception as error:  # the watch must outlive a bad look
                print(f"[nanotron-recover] launch-rank heartbeat: {error}", file=sys.stderr, flush=True)
            time.sleep(period_s)

    thread = threading.Thread(target=wait, name="launch-heartbeat", daemon=True)
    thread.start()
    return thread


class SpawnedMonitor:
    """Finds the frozen processes of this host that ULFM does not watch and hands each one to
    ``on_frozen`` once.

    ``processes()`` gives the grid's current processes. Only those with a heartbeat file (a spawned
    process, a launch rank left alone in its world), and only those on this host are looked at.
    ``on_frozen(info, last_beat, age)`` is called from the monitor's thread.
    """

    def __init__(
        self,
        run_dir: str | Path,
        period_s: float,
        timeout_s: float,
        processes: Callable[[], list[ProcessInfo]],
        on_frozen: Callable[[ProcessInfo, float, float], None],
    ) -> None:
        self.run_dir, self.period_s, self.timeout_s = Path(run_dir), period_s, timeout_s
        self._processes, self._on_frozen = processes, on_frozen
        self._host = socket.gethostname()
        self._handled: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spawned-monitor", daemon=True)

    def start(self) -> SpawnedMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self, now: float | None = None) -> list[ProcessInfo]:
        """One look: the newly found frozen processes (each also passed to ``on_frozen``)."""
        found = []
        for info in list(self._processes()):
            if info.host != self._host or info.pid in self._handled or info.pid == os.getpid():
                continue
            last = self._last_beat(info)
            if last is None:
                continue  # a launch rank ULFM watches, or not started yet
            age = (time.time() if now is None else now) - last
            if age > self.timeout_s and still_running(info):
                self._handled.add(info.pid)
                found.append(info)
                self._on_frozen(info, last, age)
        return found

    def _last_beat(self, info: ProcessInfo) -> float | None:
        for launched in (False, True):
            try:
                return heartbeat_file(self.run_dir, info.host, info.pid, launched).stat().st_mtime
            except OSError:
                continue
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception as error:  # the monitor must outlive a bad look
                print(f"[nanotron-recover] spawned-process monitor: {error}", file=sys.stderr, flush=True)


class JoinWatch:
    """A member's watch over the processes its re-join spawned, while the join runs.

    The members wait for those processes inside ``Spawn`` and ``Intercomm_merge``, which no
    failure detector watches and no revoke interrupts (Open MPI 5.0): a process that dies or
    freezes there holds every member until the join's deadline (``recover.rejoin.join_timeout_s``,
    minutes). Each spawned process touches its heartbeat file from its first moments
    (:func:`start_heartbeat`), so the members look at the files that appeared since the join
    began: a file silent for the heartbeat timeout, or fewer files than processes spawned once
    ``start_s`` has passed, means the join cannot complete. ``on_lost(reason)`` is then called once,
    from the watch's thread (the mode gives the job up, and its supervisor relaunches it from node
    memory at once instead of at the deadline)."""

    def __init__(
        self,
        run_dir: str | Path,
        expected: int,
        period_s: float,
        timeout_s: float,
        start_s: float,
        on_lost: Callable[[str], None],
    ) -> None:
        self.dir = Path(run_dir) / "heartbeats"
        self.expected, self.period_s, self.timeout_s, self.start_s = expected, period_s, timeout_s, start_s
        self._on_lost = on_lost
        self._before = self._names()
        self.began = time.time()
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="join-watch", daemon=True)

    def _names(self) -> set[str]:
        """The spawned processes' heartbeat files (a launch rank's may appear during a join too)."""
        try:
            return {p.name for p in self.dir.iterdir() if not p.name.endswith(NOT_SPAWNED)}
        except OSError:
            return set()

    def check(self, now: float | None = None) -> str | None:
        """One look: why the join cannot complete, or None."""
        now = time.time() if now is None else now
        fresh = sorted(self._names() - self._before)
        for name in fresh:
            try:
                age = now - (self.dir / name).stat().st_mtime
            except OSError:
                continue
            if age > self.timeout_s:
                return f"spawned process {name} sent no heartbeat for {age:.1f} s during the re-join"
        if len(fresh) < self.expected and now - self.began > self.start_s:
            return (
                f"{len(fresh)} of the {self.expected} spawned processes started within "
                f"{now - self.began:.0f} s of the re-join"
            )
        return None

    def __enter__(self) -> JoinWatch:
        if self.expected > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                reason = self.check()
            except Exception as error:  # the watch must outlive a bad look
                print(f"[nanotron-recover] join watch: {error}", file=sys.stderr, flush=True)
                continue
            if reason is not None and not self._stop.is_set():
                self.lost = reason
                self._on_lost(reason)
                return
