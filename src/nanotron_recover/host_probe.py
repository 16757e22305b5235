"""Which hosts answer: every host probed in parallel, retried once, every wait bounded.

:func:`probe_hosts` runs a probe (for a Slurm allocation, ``hosts.HostPlan._probe``: a one-task
``srun --overlap`` step on the host) for every host at once, ``PROBE_WORKERS`` at a time, and
returns as soon as every host has answered: its time is the answers' time, with no floor (three
hosts answering in 0.05 s take about 0.05 s; 512 hosts answering in 0.2 s each about 1.6 s with
64 workers). A host that does not answer is not waited for long: a try that fails, or that is
still silent ``PROBE_SLACK`` times as long as the slowest answer so far took (measured from the
try's own start, not from its wait in the pool's queue), is retried once; a late answer of the
first try still counts. A host whose tries all failed or stayed silent is lost, and so is one
still silent ``PROBE_TIMEOUT_S`` after the start. A probe still running then (a silent host's
``srun``) ends in the background at its own bound, ``PROBE_TRY_S`` (:func:`run_bounded`: unlike
``subprocess.run``, no wait without a bound, not even the reap after the kill).

:class:`ProbeRun` runs one probe in a thread of its own: the supervisor starts it the moment a
job ends, so that asking which hosts answer overlaps ending what is left of the job. A probe that
raises (a defect, not a host's answer) is said in one line and counts as no host known lost.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .hosts import HostPlan

PROBE_TIMEOUT_S = 15.0  # the whole probe, sinfo included
PROBE_TRY_S = 5.0  # one srun; a host slower than that to start a step is not one to relaunch on
PROBE_WORKERS = 64  # probes in flight at once
PROBE_SLACK = 4.0  # a try silent this many times the slowest answer so far is retried
PROBE_RETRIES = 1
PROBE_TICK_S = 0.05  # how often the probe looks at tries that started while it waited
REAP_WAIT_S = 2.0  # a command killed at its timeout that is not gone by then is left behind


def run_bounded(cmd: list[str], timeout_s: float, *, output: bool = True) -> tuple[int | None, str]:
    """Run ``cmd``: (its status, its stdout); (None, "") when it cannot start or does not end
    within ``timeout_s``. Killed then, and reaped for at most ``REAP_WAIT_S`` (a process stuck in
    the kernel is left behind): unlike ``subprocess.run``, no wait without a bound."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if output else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None, ""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(timeout=REAP_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        if proc.stdout is not None:
            proc.stdout.close()
        return None, ""


class _Try:
    """One probe of one host; ``started`` is set by the worker that runs it (monotonic)."""

    __slots__ = ("host", "started")

    def __init__(self, host: str) -> None:
        self.host = host
        self.started: float | None = None

    def run(self, probe: Callable[[str], bool]) -> tuple[bool, float]:
        self.started = time.monotonic()
        ok = bool(probe(self.host))
        return ok, time.monotonic() - self.started


def probe_hosts(
    hosts: list[str],
    probe: Callable[[str], bool],
    *,
    cap_s: float = PROBE_TIMEOUT_S,
    workers: int = PROBE_WORKERS,
    slack: float = PROBE_SLACK,
    retries: int = PROBE_RETRIES,
) -> list[str]:
    """The ``hosts`` whose ``probe`` returns true, in order: all probed in parallel (``workers``
    at a time); a try that fails or stays silent ``slack`` times the slowest answer so far is
    retried ``retries`` times; returns once every host answered or used its tries, at most
    ``cap_s`` after the start. A probe that raises ends the probe with its exception."""
    deadline = time.monotonic() + cap_s
    answered: set[str] = set()
    tries = dict.fromkeys(hosts, 0)
    given_up = dict.fromkeys(hosts, 0)  # tries that failed or went silent
    counted: set[_Try] = set()
    open_tries: dict[Future[tuple[bool, float]], _Try] = {}
    slowest: float | None = None
    pool = ThreadPoolExecutor(max_workers=max(1, min(workers, len(hosts))), thread_name_prefix="probe")

    def submit(host: str) -> None:
        tries[host] += 1
        attempt = _Try(host)
        open_tries[pool.submit(attempt.run, probe)] = attempt

    def give_up(attempt: _Try) -> None:
        counted.add(attempt)
        given_up[attempt.host] += 1
        host = attempt.host
        if host not in answered and tries[host] <= retries and time.monotonic() < deadline:
            submit(host)

    def settled(host: str) -> bool:
        return host in answered or (tries[host] > retries and given_up[host] >= tries[host])

    try:
        for host in hosts:
            submit(host)
        while open_tries and not all(settled(h) for h in hosts):
            now = time.monotonic()
            if now >= deadline:
                break
            wake = min(deadline, now + PROBE_TICK_S)
            if slowest is not None:
                for attempt in list(open_tries.values()):
                    if attempt in counted or attempt.started is None or attempt.host in answered:
                        continue
                    silent_at = attempt.started + slack * slowest
                    if now >= silent_at:
                        give_up(attempt)  # silent: retried (or lost); a late answer still counts
                    else:
                        wake = min(wake, silent_at)
            done, _ = wait(list(open_tries), timeout=max(0.0, wake - now), return_when=FIRST_COMPLETED)
            for future in done:
                attempt = open_tries.pop(future)
                ok, took = future.result()  # a probe that raised: a defect, not a lost host
                if ok:
                    answered.add(attempt.host)
                    slowest = took if slowest is None else max(slowest, took)
                elif attempt not in counted:
                    give_up(attempt)
    finally:
        # A try still running (a silent host) ends at its own timeout, in the background.
        pool.shutdown(wait=False, cancel_futures=True)
    return [h for h in hosts if h in answered]


class ProbeRun:
    """:meth:`HostPlan.answering` in a thread of its own, started at once and timed: the
    supervisor starts it when a job ends, so that it overlaps the job's cleanup."""

    def __init__(self, plan: HostPlan, log: Callable[[str], None]) -> None:
        self.plan = plan
        self.log = log
        self.started = time.monotonic()
        self._took: float | None = None
        self._answer: list[str] | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="host-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._answer = list(self.plan.answering())
        except Exception as e:  # reported by answer(), never lost
            self._error = e
        self._took = time.monotonic() - self.started

    def answer(self, limit_s: float = PROBE_TIMEOUT_S + 5.0) -> tuple[list[str], float]:
        """The hosts that answer and the probe's seconds (from its start to its answer). A probe
        that raised, or that has not answered ``limit_s`` after its start, is said in one line and
        counts as no host known lost: every host of the plan."""
        self._thread.join(max(0.0, self.started + limit_s - time.monotonic()))
        took = self._took if self._took is not None else time.monotonic() - self.started
        if self._error is not None:
            error = f"{type(self._error).__name__}: {self._error}"
            self.log(f"probing the hosts failed ({error}): no host counted lost")
        elif self._answer is None:
            self.log(f"probing the hosts did not end within {limit_s:g}s: no host counted lost")
        else:
            return self._answer, took
        return list(self.plan.hosts), took
