"""The supervisor: run a training job and decide how it ended; relaunch it when a node is lost.

:func:`run_supervised` runs a command (usually ``mpirun``) in a session of its own and turns
``<run_dir>/outcome.json`` (:mod:`.outcome`) into the exit status. ``mpirun``'s own status says
little under ULFM: ranks that leave by SIGKILL do not fail the job, so a job whose every replica
died can end with status 0. So the exit status is the outcome's (0 only when every requested step
was committed), and no record at all is a failure: the job lost every replica (the runtime ended
them after a lost node, they were killed from outside, or a plain run's ``mpirun`` ended them after
one rank was lost). The supervisor then writes the record no rank could write (:func:`report`): kind
``all_replicas_lost``, the last committed step, exit 1 -- the same record a rank that outlives every
replica writes itself.

The supervisor also ends what the run leaves behind. A rank that froze (SIGSTOP, a hung device) is
removed from the job by the survivors, but it still exists as a process and ``mpirun`` waits for it
forever. Once the run has recorded that it completed and ``mpirun`` has still not exited after a
grace period, the supervisor terminates ``mpirun``'s whole session (nothing else is touched) and
says which processes it ended. Its own waits are bounded: a process that SIGKILL does not end
within ``REAP_WAIT_S`` (stuck in the kernel, on a stopped node's file system) is named and left
behind, and the supervisor goes on.

A run may also give itself up (``<run_dir>/abandoned.json``, :func:`.outcome.write_abandoned`): a
re-join stuck past ``recover.rejoin.join_timeout_s``. The supervisor then ends ``mpirun``'s
session at once, and the job counts as lost without an outcome (relaunched, below).

Relaunching (forward recovery, :func:`run_relaunching`). Open MPI's runtime ends the whole job when
it loses a node's daemon (power, a cut link, a node rebooted): every healthy replica dies with it,
and the job ends without an outcome record. So does a job whose every replica was lost (or its
record says ``all_replicas_lost``: a rank outlived them). Then the
supervisor relaunches the job inside the same allocation, on the hosts that still answer
(:mod:`.hosts`; the probe starts the moment the job ends and runs while what is left of it is
ended, :mod:`.host_probe`), as generation ``n+1`` (:mod:`.generation`); the new job starts from the
replicas' node-memory snapshots (``data_parallel/forward/restore.py``) or, without them, from the latest disk
checkpoint. When the answering hosts cannot hold every replica (a node lost and no spare), the job
is relaunched with the whole replicas that fit, down to ``recover.min_replicas``; the same ``B`` is
shared by fewer replicas, as after an in-step repair. A relaunch happens only after the previous job committed a new step (a job that dies
before that would die again) or lost one more host (a node lost while the job restarts), at most
``recover.max_restarts`` times. The one exception is a start: a job lost before it committed
anything is started once more (a rank declared dead by mistake while busy nodes import, or a rank
lost then, costs a start, not the run); a second such loss in a row ends the run.

A job may also stall: no step commits, because a member is stuck where no rank-level deadline can
end it without taking a healthy replica down (``commit_deadline.py``). Under forward recovery the
supervisor ends a job that has committed nothing for a bound derived from its measured steps and
relaunches it like a lost one (incident kind ``stalled``): no stuck member can hold the job. And
a job whose lost ranks' host no longer answers a probe (a frozen or cut-off node) is ended and
relaunched without that host at once (``lost_hosts.py``), not when Open MPI's runtime gives up on
the node tens of seconds later. A probe that fails (an unexpected exception, in the watch or after
the job ended) is said in one line and counts as no host known lost: the job is relaunched as
before, and the run's outcome record is never lost to it. A command that is not one of Open MPI's
launchers cannot be restricted to the answering hosts: the supervisor says so once and relaunches
it as it was.

``python -m nanotron_recover.supervisor supervise --run-dir D [--relaunches N] -- CMD...`` runs
the supervisor around any command; the Slurm job script uses it that way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import fencing
from .commit_deadline import CommitWatch, DeadlineArgs, Stalled
from .commit_record import read_commit
from .errors import ExitCode
from .failures import Kind
from .frozen_processes import FrozenProcessWatch
from .ft import prrte_fix, rank_fixes
from .generation import Relaunch, clear_relaunch, write_relaunch
from .host_probe import ProbeRun
from .hosts import (
    LAUNCHERS,
    HostPlan,
    holders_first,
    launcher_at,
    rank_table_hosts,
    relaunch_command,
    relaunch_ranks,
)
from .logging.metrics import read_metrics
from .lost_hosts import LostHostWatch
from .outcome import (
    RELAUNCHES_LEFT_ENV,
    SUPERVISED_ENV,
    asks_regrow,
    clear_abandoned,
    clear_outcome,
    exit_code_of,
    is_lost_job,
    read_abandoned,
    read_outcome,
    write_outcome,
)
from .session_dirs import fresh_session

PREFIX = "nanotron-recover launch"
POLL_S = 0.5  # how often the supervisor looks for the outcome record while mpirun runs
TERM_WAIT_S = 5.0  # between SIGTERM and SIGKILL when ending leftover processes
LINGER_S = 3.0  # how long processes may outlive mpirun before they count as left behind
# After a job lost as a whole, its leftovers are stale: a short wait, then SIGKILL.
RELAUNCH_LINGER_S = 0.5
RELAUNCH_TERM_WAIT_S = 1.0
REAP_WAIT_S = 5.0  # after SIGKILL: what is not gone by then (stuck in the kernel) is left behind
GRACE_EXTRA_S = 10.0


def launch_env() -> dict[str, str]:
    """Ranks see pipes, not the terminal: tell the logging rank to draw its progress line anyway."""
    env = dict(os.environ)
    if sys.stderr.isatty():
        env.setdefault("NANOTRON_RECOVER_PROGRESS", "1")
    return env


def default_grace_s(heartbeat_timeout_s: float) -> float:
    """How long after the outcome record mpirun may take to exit: two detector timeouts (the
    survivors notice a frozen rank, then finalize past it) plus time to write and close files."""
    return 2 * heartbeat_timeout_s + GRACE_EXTRA_S


# -- the supervisor -----------------------------------------------------------------------------
@dataclass
class Supervised:
    """How one supervised command ended."""

    exit_code: int  # what the launcher reports: exit_code_of(outcome)
    returncode: int | None  # the command's own status; None when the supervisor had to end it
    outcome: dict[str, Any] | None
    ended: list[str] = field(default_factory=list)  # "pid N (name)" of leftovers the supervisor ended
    interrupted_by: int | None = None  # a SIGINT/SIGTERM from the user, forwarded to the command
    exited_at: float | None = None  # wall clock when the command exited (or was ended)
    stalled: Stalled | None = None  # the supervisor ended a job that stopped committing steps
    hosts_gone: str | None = None  # the supervisor ended a job whose lost ranks' hosts are gone
    start_s: float | None = None  # from the launch to its first commit (None: no commit)


def _log(prefix: str) -> Callable[[str], None]:
    def log(line: str) -> None:
        print(f"{prefix}: {line}", file=sys.stderr, flush=True)

    return log


def _session_members(sid: int) -> list[tuple[int, str]]:
    """(pid, name) of the live processes of session ``sid`` (Linux /proc; empty elsewhere)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp session ...": comm may itself hold spaces and parentheses.
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":  # a zombie needs no ending
            members.append((int(entry), name))
    return sorted(members)


def _signal_session(sid: int, sig: int) -> None:
    # The process group first (the session leader's group holds mpirun and, normally, its ranks),
    # then each member of the session one by one, for any that moved to a group of its own.
    try:
        os.killpg(sid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid, _ in _session_members(sid):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_session(
    proc: subprocess.Popen,
    term_wait_s: float = TERM_WAIT_S,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """SIGTERM every process of ``proc``'s session (``proc`` was started with
    ``start_new_session``), SIGKILL what is left ``term_wait_s`` later; "pid N (name)" of each.
    What SIGKILL has not ended ``REAP_WAIT_S`` later (a process in uninterruptible sleep, on a
    stopped node's file system) is named in one line and left behind: no wait without a bound."""
    sid = proc.pid
    members = _session_members(sid)
    if not members and proc.poll() is None:  # no /proc here: name the one process known
        members = [(proc.pid, _name_of(proc))]
    _signal_session(sid, signal.SIGTERM)
    deadline = time.monotonic() + term_wait_s
    while time.monotonic() < deadline:
        proc.poll()  # reap it, so that it does not stay behind as a zombie member
        if not _session_members(sid) and proc.poll() is not None:
            break
        time.sleep(0.1)
    _signal_session(sid, signal.SIGKILL)  # also ends a SIGSTOPped process, which SIGTERM cannot
    reap_by = time.monotonic() + REAP_WAIT_S
    try:
        proc.wait(timeout=REAP_WAIT_S)
        reaped = True
    except subprocess.TimeoutExpired:
        reaped = False
    _wait_empty(sid, max(0.0, reap_by - time.monotonic()))
    left = _session_members(sid)
    if not reaped and proc.pid not in {pid for pid, _ in left}:
        left.insert(0, (proc.pid, _name_of(proc)))
    if left:
        (log or _log(PREFIX))(
            f"{', '.join(f'pid {pid} ({name})' for pid, name in left)} not ended {REAP_WAIT_S:g}s "
            "after SIGKILL (stuck in the kernel?): left behind"
        )
    return [f"pid {pid} ({name})" for pid, name in members]


def _name_of(proc: subprocess.Popen) -> str:
    return Path(str(proc.args[0] if isinstance(proc.args, list) else proc.args)).name


def _wait_empty(sid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for session ``sid`` to have no process left; whether some remain."""
    deadline = time.monotonic() + timeout_s
    while _session_members(sid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)
    return False


def _install_forwarding(proc: subprocess.Popen, received: list[int]) -> dict[int, Any]:
    """Forward the user's SIGINT/SIGTERM to the command's process group: it runs in a session of
    its own, so a Ctrl-C at the terminal or a scancel reaches only the supervisor. A second signal
    SIGKILLs the whole session."""

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        _signal_session(proc.pid, signum if len(received) == 1 else signal.SIGKILL)

    previous: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    except ValueError:
        pass  # not the main thread: signals stay with whoever handles them there
    return previous


def run_supervised(
    cmd: list[str],
    run_dir: str | Path,
    *,
    grace_s: float,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    log: Callable[[str], None] | None = None,
    term_wait_s: float = TERM_WAIT_S,
    linger_s: float = LINGER_S,
    deadline: DeadlineArgs | None = None,
    previous_start_s: float | None = None,
    lost_hosts: LostHostWatch | None = None,
    frozen: FrozenProcessWatch | None = None,
    on_end: Callable[[], None] | None = None,
) -> Supervised:
    """Run ``cmd`` (usually mpirun) in a session of its own until it exits, or until ``grace_s``
    after the run recorded that it completed or stopped to regrow; then end whatever of it is left. With ``deadline``,
    a job that commits no step within its bound (``commit_deadline.py``) is ended too
    (:attr:`Supervised.stalled`); with ``lost_hosts``, so is one whose lost ranks' host no longer
    answers, or that has committed nothing for a while (``CommitWatch.overdue``) and one of whose
    hosts no longer answers (``lost_hosts.py``; :attr:`Supervised.hosts_gone`), and with ``frozen`` one whose frozen
    process alone on its node cannot be removed (``frozen_processes.py``). A watch that raises is said in one
    line and stops watching this job. ``on_end`` is called the moment the job has ended (mpirun
    exited) or the supervisor starts ending it, before what is left of it is ended.

    The outcome record of an earlier launch is cleared first, so only this run's counts. Raises
    :class:`subprocess.TimeoutExpired` (after ending the session) when ``timeout_s`` passes.
    """
    log = log or _log(PREFIX)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    clear_outcome(run_dir)
    clear_abandoned(run_dir)
    received: list[int] = []
    env = dict(os.environ if env is None else env)
    env[SUPERVISED_ENV] = "1"
    launch = fresh_session(cmd)
    env.pop(prrte_fix.ENV, None)  # the ranks read it as "the runtime has the fix": only if it does
    env.pop(rank_fixes.ENV, None)
    if launch != list(cmd):  # fresh_session.sh starts mpirun, and preloads the fix it is given
        env.update(prrte_fix.runtime_env(run_dir, log))  # mpirun's daemons can spawn across hosts
        env.update(rank_fixes.rank_env(run_dir, log))  # a death during a creation crashes no rank
    watch = CommitWatch(run_dir, deadline or DeadlineArgs(fixed_s=0), previous_start_s)
    stalled: Stalled | None = None
    hosts_gone: str | None = None
    # mpirun and its daemons first remove a killed predecessor's session folder of their pid.
    proc = subprocess.Popen(launch, env=env, start_new_session=True)
    previous = _install_forwarding(proc, received)
    started = time.monotonic()
    recorded_at: float | None = None
    ended: list[str] = []
    returncode: int | None = None
    exited_at: float | None = None

    def job_ended() -> float:
        """The moment the job ended: told to ``on_end`` (the relaunch's probe starts there)."""
        at = time.time()
        if on_end is not None and not received:  # the user's interrupt relaunches nothing
            try:
                on_end()
            except Exception as e:
                log(f"at the job's end: {type(e).__name__}: {e}")
        return at

    try:
        # The job's own length has no bound here (a training run); each wait in it does.
        while True:
            try:
                returncode = proc.wait(timeout=POLL_S)
                exited_at = job_ended()
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if timeout_s is not None and now - started > timeout_s:
                end_session(proc, term_wait_s, log)
                raise subprocess.TimeoutExpired(cmd, timeout_s)
            abandoned = read_abandoned(run_dir)
            if abandoned is not None and recorded_at is None:
                # The job gave itself up (a re-join stuck past its deadline): mpirun would wait for
                # the stuck process forever. Ended, it is a job lost without an outcome.
                exited_at = job_ended()
                ended = end_session(proc, term_wait_s, log)
                log(
                    f"the job gave itself up ({abandoned.get('reason')}): ended {', '.join(ended) or 'mpirun'}"
                )
                break
            outcome = read_outcome(run_dir) if recorded_at is None else None
            # A completed run, or one that stopped to regrow (agreed by every rank), is ending: the
            # grace below bounds its exit. Any other stopped record may come from one rank while
            # the others save their checkpoint or go on: the commit deadline still holds them.
            ending = outcome is not None and (outcome.get("status") == "completed" or asks_regrow(outcome))
            stalled = watch.poll(now) if recorded_at is None and not ending else None
            if stalled is not None:
                # A member stuck where no deadline of its own may end it: the job is relaunched.
                exited_at = job_ended()
                ended = end_session(proc, term_wait_s, log)
                log(f"the job stalled, {stalled.describe()}: ended {', '.join(ended) or 'mpirun'}")
                break
            hosts_gone = None
            if lost_hosts is not None and recorded_at is None:
                try:
                    hosts_gone = lost_hosts.poll()
                    if hosts_gone is None and not ending and watch.overdue(now):
                        # No commit for a while: a cut-off process nobody watches may hold the step.
                        hosts_gone = lost_hosts.poll_stalled()
                except Exception as e:  # the job's outcome matters more than the watch
                    log(f"the lost-host watch failed ({type(e).__name__}: {e}): not watching this job")
                    lost_hosts = None
            if frozen is not None and recorded_at is None and hosts_gone is None:
                try:
                    hosts_gone = frozen.poll()  # a frozen process removed, or one that cannot be
                    if frozen.lost_at is not None:
                        watch.note_loss(frozen.lost_at)  # from now on the repair bound holds
                except Exception as e:  # the job's outcome matters more than the watch
                    log(f"the frozen-process watch failed ({type(e).__name__}: {e}): not watching this job")
                    frozen = None
            if hosts_gone is not None:
                # Open MPI's runtime would abort the job when it gives up on the node, tens of
                # seconds later: the relaunch need not wait for it.
                exited_at = job_ended()
                ended = end_session(proc, term_wait_s, log)
                log(f"{hosts_gone}: ended {', '.join(ended) or 'mpirun'} to relaunch without them")
                break
            if recorded_at is None:
                if ending:
                    recorded_at = now
            elif now - recorded_at > grace_s:
                exited_at = job_ended()
                ended = end_session(proc, term_wait_s, log)
                outcome = read_outcome(run_dir)
                log(
                    f"the run {_describe(outcome)} but mpirun had not exited {grace_s:g}s later: "
                    f"ended {', '.join(ended) or f'process group {proc.pid}'}"
                )
                break
        # mpirun gone by itself: anything still in its session a moment later (an orphaned rank)
        # goes too. The moment lets helpers that exit with their parent (W&B's service) do so.
        if returncode is not None and _wait_empty(proc.pid, linger_s):
            ended = end_session(proc, term_wait_s, log)
            log(f"mpirun exited (status {returncode}) leaving processes behind: ended {', '.join(ended)}")
    except BaseException:
        if proc.poll() is None:
            end_session(proc, term_wait_s, log)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    outcome = read_outcome(run_dir)
    return Supervised(
        exit_code=exit_code_of(outcome),
        returncode=returncode,
        outcome=outcome,
        ended=ended,
        interrupted_by=received[0] if received else None,
        exited_at=exited_at,
        stalled=stalled,
        hosts_gone=hosts_gone,
        start_s=watch.start_s,
    )


def _describe(outcome: dict[str, Any] | None) -> str:
    if outcome is None:
        return "ended"
    steps = f"step {outcome.get('last_step')} of {outcome.get('target_step')}"
    return f"{'completed' if outcome.get('status') == 'completed' else 'stopped'} ({steps})"


def new_generation(run_dir: str | Path, nonce: str | None = None) -> fencing.Token:
    """Advance the run directory's fencing token (:mod:`.fencing`) and forget the previous job's
    fenced processes (``fence/``: per host and pid, which a new job's processes may reuse)."""
    token = fencing.advance(run_dir, nonce)
    shutil.rmtree(Path(run_dir) / fencing.REMOVED_DIR, ignore_errors=True)
    return token


def last_committed_step(run_dir: str | Path) -> int:
    """The last committed step: the commit record (:mod:`.commit_record`), or for a run directory
    without one, the last step in ``<run_dir>/metrics.jsonl`` (0 without either)."""
    record = read_commit(run_dir)
    if record is not None:
        return record.step
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((r["step"] for r in read_metrics(path)), default=0)


LOST_WITHOUT_RECORD = (
    "every replica lost: the job ended without an outcome record (no rank outlived the replicas to "
    "write one: ranks killed or failed, a lost node, or mpirun ending the job after a rank was lost)"
)


def record_lost_job(run_dir: str | Path, target_step: int | None = None) -> dict[str, Any]:
    """Write the record of a job that ended without one (not interrupted by the user): every
    replica was lost. Kind ``all_replicas_lost``, the last committed step, exit 1; the record."""
    last = last_committed_step(run_dir)
    of = f" of {target_step}" if target_step is not None else ""
    message = f"{LOST_WITHOUT_RECORD}; last committed step {last}{of}"
    write_outcome(
        run_dir,
        status="stopped",
        last_step=last,
        target_step=target_step,
        exit_code=ExitCode.FAILED,
        kind=Kind.ALL_REPLICAS_LOST,
        message=message,
    )
    return read_outcome(run_dir) or {"kind": str(Kind.ALL_REPLICAS_LOST), "message": message}


def report(
    result: Supervised,
    run_dir: str | Path,
    *,
    target_step: int | None = None,
    log: Callable[[str], None] | None = None,
) -> int:
    """Say in one line why a run did not complete (or why a non-zero mpirun status is not a
    failure); the exit status to report. A run that ended without a record, unless the user
    interrupted it, lost every replica: the record is written here (:func:`record_lost_job`)."""
    log = log or _log(PREFIX)
    outcome = result.outcome
    if result.exit_code == 0:
        if result.returncode not in (0, None):
            log(
                f"mpirun exited with status {result.returncode}, but the run {_describe(outcome)}: "
                "exit status 0"
            )
        return 0
    if outcome is None and result.interrupted_by is not None:
        last = last_committed_step(run_dir)
        of = f" of {target_step}" if target_step is not None else ""
        why = f"interrupted by {signal.Signals(result.interrupted_by).name}"
        log(f"run ended without completing: {why}; last committed step {last}{of}")
        return result.exit_code
    if outcome is None:
        outcome = record_lost_job(run_dir, target_step)
        log(f"run ended without completing: {outcome['message']}")
    elif outcome.get("message"):
        log(str(outcome["message"]).replace("\n", " "))
    else:
        log(f"run {_describe(outcome)}, exit status {result.exit_code}")
    return result.exit_code


def supervise(
    cmd: list[str],
    run_dir: str | Path,
    *,
    grace_s: float,
    target_step: int | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    prefix: str = PREFIX,
) -> int:
    """:func:`run_supervised` then :func:`report`: run ``cmd`` and return the run's exit status,
    0 only when its outcome record says every requested step was committed."""
    log = _log(prefix)
    env = dict(os.environ if env is None else env)
    env[fencing.ENV] = str(new_generation(run_dir, fencing.new_nonce()))
    result = run_supervised(cmd, run_dir, grace_s=grace_s, env=env, timeout_s=timeout_s, log=log)
    return report(result, run_dir, target_step=target_step, log=log)


def run_relaunching(
    cmd: list[str],
    run_dir: str | Path,
    *,
    grace_s: float,
    relaunches: int,
    target_step: int | None = None,
    env: dict[str, str] | None = None,
    hosts: HostPlan | None = None,
    timeout_s: float | None = None,
    prefix: str = PREFIX,
    replica_size: int = 1,
    min_replicas: int = 1,
    deadline: DeadlineArgs | None = None,
    heartbeat: tuple[float, float] | None = None,
) -> int:
    """Forward recovery's supervisor: :func:`run_supervised`, and while the job ends without an
    outcome record (or with an ``all_replicas_lost`` one, or stalled past ``deadline``) after
    committing a new step (or after one more host was lost), relaunch it (at most ``relaunches``
    times) on the hosts that still answer (``hosts``, default: the Slurm allocation, if any), with
    as many whole replicas of ``replica_size`` ranks as they hold (at least ``min_replicas``); the
    exit status. With ``heartbeat`` (period, timeout), a frozen process alone on its node is
    removed, or the job relaunched, on its heartbeat file's word (``frozen_processes.py``)."""
    log = _log(prefix)
    hosts = HostPlan.from_slurm() if hosts is None else hosts
    clear_relaunch(run_dir)
    token = new_generation(run_dir, fencing.new_nonce())
    generation, before, launch_cmd = 0, last_committed_step(run_dir), cmd
    lost_before: list[str] = []
    retried_start = False  # the last launch was a retried start (which is not retried again)
    start_s: float | None = None  # the last measured start: a relaunch's own start is bounded by it
    said_unrestricted = False  # a command that cannot be restricted to the answering hosts: said once
    deadline = deadline or DeadlineArgs()
    env = dict(os.environ if env is None else env)
    while True:
        env[RELAUNCHES_LEFT_ENV] = str(relaunches - generation)
        env[fencing.ENV] = str(token)
        watch_hosts = None
        if hosts is not None and len(hosts.hosts) > 1:
            watch_hosts = LostHostWatch(run_dir, hosts.hosts, hosts.answering, log=log)
        early = _EarlyProbe(run_dir, hosts, watch_hosts, log, wanted=generation < relaunches)
        fenced: list[fencing.Token] = []

        def job_ended(early: _EarlyProbe = early, fenced: list[fencing.Token] = fenced) -> None:
            # Fence the job first, the moment it ends or is being ended: one of its processes that
            # the runtime cannot end (a cut-off or frozen node) writes nothing from this instant,
            # not after the cleanup and the probe. A completed job's token moving on fences nothing
            # that still writes.
            fenced.append(new_generation(run_dir))
            early.start()

        frozen = None
        if heartbeat is not None:
            frozen = FrozenProcessWatch(run_dir, *heartbeat)
        # A job lost with a node leaves steps (srun) that SIGTERM cannot end: no long waits for them.
        result = run_supervised(
            launch_cmd,
            run_dir,
            grace_s=grace_s,
            env=env,
            timeout_s=timeout_s,
            log=log,
            term_wait_s=RELAUNCH_TERM_WAIT_S,
            linger_s=RELAUNCH_LINGER_S,
            deadline=deadline,
            previous_start_s=start_s,
            lost_hosts=watch_hosts,
            frozen=frozen,
            on_end=job_ended,
        )
        cleaned_at = time.time()  # what was left of the job is ended (or left behind)
        start_s = result.start_s or start_s
        # A job lost as a whole, with no record or with a rank's all_replicas_lost record, may be
        # relaunched, and so is one that stopped to regrow; any other record is how the run ended.
        regrow = asks_regrow(result.outcome)
        if not (is_lost_job(result.outcome) or regrow) or result.interrupted_by is not None:
            return report(result, run_dir, target_step=target_step, log=log)
        # Fenced when it ended (job_ended); the next job holds the newest token.
        token = fenced[-1] if fenced else new_generation(run_dir)
        after = last_committed_step(run_dir)
        if generation >= relaunches:
            log(f"not relaunching: recover.max_restarts={relaunches} relaunches used")
            return report(result, run_dir, target_step=target_step, log=log)
        ended_at = result.exited_at or cleaned_at
        cleanup_s = max(0.0, cleaned_at - ended_at)
        answering, probe_s = early.answer(result)
        lost = [h for h in hosts.hosts if h not in answering] if hosts is not None else []
        # The ranks land on the hosts in this order: those of the last rank table first, which
        # hold the newest node-memory snapshots (hosts.py).
        answering = holders_first(answering, rank_table_hosts(run_dir))
        # A job that dies before committing a new step would die again -- unless it died because
        # one more host was lost (a node lost while the job restarts): that is a new fault.
        newly_lost = [h for h in lost if h not in lost_before]
        # A start is retried once: a rank declared dead by mistake while the job starts (busy
        # nodes, a slow file system), or one lost then, ends a job that has no step to lose yet.
        start_retry = after <= before and not newly_lost and not retried_start
        if after <= before and not newly_lost and not start_retry:
            since = "launch" if generation == 0 else "last relaunch"
            log(f"not relaunching: no step committed since the {since}, and no host lost since")
            return report(result, run_dir, target_step=target_step, log=log)
        retried_start = start_retry
        lost_before = lost
        width = ""
        launch_cmd = cmd  # every host answers: full width again, whatever the last launch had
        if lost:
            ranks = relaunch_ranks(cmd, answering, replica_size)
            if ranks < max(1, min_replicas) * replica_size:
                log(
                    f"not relaunching: hosts {', '.join(lost)} lost, and the {len(answering)} that answer "
                    f"hold {ranks // replica_size} replica(s), below recover.min_replicas={min_replicas}"
                )
                return report(result, run_dir, target_step=target_step, log=log)
            if launcher_at(cmd) is not None:
                launch_cmd = relaunch_command(cmd, answering, ranks)
                width = f", {ranks // replica_size} replica(s) on {', '.join(answering)}"
            elif not said_unrestricted:
                said_unrestricted = True
                log(
                    f"cannot restrict the relaunch to the hosts that answer: {cmd[0]} is not one of "
                    f"Open MPI's launchers ({', '.join(LAUNCHERS)}): relaunched as it was, lost hosts "
                    "included"
                )
        elif hosts is not None and answering and launcher_at(cmd) is not None:
            # Full width, and still named: the job's own line lets the runtime read the allocation
            # from the environment, which may still list a node Slurm dropped from it since
            # (--no-kill), and starts its daemons without --overlap, which a step left by a cut-off
            # node's old daemons blocks. Its srun then failed (exit 1) and no relaunch could start:
            # two jobs lost so in a fault campaign on the emulated cluster.
            launch_cmd = relaunch_command(cmd, answering, relaunch_ranks(cmd, answering, replica_size))
        generation += 1
        cause = (
            Kind.NODE_LOST
            if lost
            else Kind.STALLED
            if result.stalled
            else Kind.REGROW
            if regrow
            else Kind.JOB_LOST
        )
        relaunch = Relaunch(
            generation, cause, ended_at, after, lost, answering, cleanup_s, probe_s, time.time()
        )
        write_relaunch(run_dir, relaunch)
        what = f"hosts {', '.join(lost)} lost" if lost else "every replica lost"
        if result.stalled is not None and not lost:
            what = "stalled: no step committed within its bound"
        if regrow and not lost:
            what = "a re-join could not be placed: relaunched at full width"
        if start_retry:
            what += ", before a first commit: its start is retried once"
        ended = "without an outcome" if result.outcome is None else "with every replica lost"
        if result.stalled is not None:
            ended = "by the supervisor"
        elif regrow:
            ended = "to regrow"
        log(
            f"the job ended {ended} after step {after} ({what}): relaunching it "
            f"(generation {generation}{width}, {relaunches - generation} relaunches left)"
        )
        before = after


class _EarlyProbe:
    """The relaunch's probe of which hosts answer, started the moment a job ends (``on_end`` of
    :func:`run_supervised`) so that it overlaps ending what is left of the job; only for a job
    that may be relaunched (``wanted``: a relaunch is left; its record says it was lost, or asks
    to regrow), and not when the lost-host watch probed a moment ago (the job was ended for it)."""

    def __init__(
        self,
        run_dir: str | Path,
        hosts: HostPlan | None,
        watch: LostHostWatch | None,
        log: Callable[[str], None],
        *,
        wanted: bool,
    ) -> None:
        self.run_dir, self.hosts, self.watch, self.log, self.wanted = run_dir, hosts, watch, log, wanted
        self.run: ProbeRun | None = None

    def start(self) -> None:
        if not self.wanted or self.hosts is None or (self.watch is not None and self.watch.lost):
            return
        outcome = read_outcome(self.run_dir)
        if is_lost_job(outcome) or asks_regrow(outcome):
            self.run = ProbeRun(self.hosts, self.log)

    def answer(self, result: Supervised) -> tuple[list[str], float]:
        """The hosts that answer and the probe's own seconds (0 for the watch's probe, which ran
        before the job ended); every host when a probe failed (no host known lost)."""
        watch = self.watch
        if result.hosts_gone is not None and watch is not None and watch.last_answering is not None:
            return watch.last_answering, 0.0
        if self.hosts is None:
            return [], 0.0
        return (self.run or ProbeRun(self.hosts, self.log)).answer()


# -- python -m nanotron_recover.supervisor supervise ... -- CMD ---------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``supervise --run-dir D [--grace-s G] [--target-step M] -- CMD...``: the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, cmd = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m nanotron_recover.supervisor",
        description="run a training command; exit with the status its outcome.json records",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "supervise", usage="%(prog)s --run-dir D [options] -- CMD...", help="run CMD under the supervisor"
    )
    p.add_argument("--run-dir", required=True, help="where the run writes outcome.json and metrics.jsonl")
    p.add_argument(
        "--grace-s",
        type=float,
        default=default_grace_s(5.0),
        help="seconds after the run recorded completion before leftovers are ended (default: %(default)s)",
    )
    p.add_argument("--target-step", type=int, help="the step the run was asked to reach (for messages)")
    p.add_argument("--prefix", default=PREFIX, help="what each line the supervisor prints starts with")
    p.add_argument(
        "--relaunches",
        type=int,
        default=0,
        help="relaunch a job that ended without an outcome (a lost node) up to this many times "
        "(forward recovery; default: %(default)s)",
    )
    p.add_argument(
        "--replica-size",
        type=int,
        default=1,
        help="ranks per data-parallel replica: a relaunch on fewer hosts runs whole replicas "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="no relaunch with fewer replicas than this (recover.min_replicas; default: %(default)s)",
    )
    p.add_argument(
        "--heartbeat-period-s",
        type=float,
        default=1.0,
        help="recover.heartbeat_period_s: how often the job's processes beat (default: %(default)s)",
    )
    p.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=5.0,
        help="recover.heartbeat_timeout_s: the commit deadline allows two for a repair, and a process "
        "alone on its node whose heartbeat file is older is removed (default: %(default)s)",
    )
    p.add_argument(
        "--commit-timeout-s",
        type=float,
        default=None,
        help="recover.commit_timeout_s: end and relaunch a job that commits no step for this long "
        "(default: derived from the measured steps; 0: never)",
    )
    args = parser.parse_args(own)
    if not cmd:
        p.error("no command after --")
    if args.replica_size < 1 or args.min_replicas < 0:
        p.error("--replica-size must be >= 1 and --min-replicas >= 0")
    if args.relaunches > 0:
        return run_relaunching(
            cmd,
            args.run_dir,
            grace_s=args.grace_s,
            relaunches=args.relaunches,
            target_step=args.target_step,
            prefix=args.prefix,
            replica_size=args.replica_size,
            min_replicas=args.min_replicas,
            deadline=DeadlineArgs(allowance_s=2 * args.heartbeat_timeout_s, fixed_s=args.commit_timeout_s),
            heartbeat=(args.heartbeat_period_s, args.heartbeat_timeout_s),
        )
    return supervise(
        cmd, args.run_dir, grace_s=args.grace_s, target_step=args.target_step, prefix=args.prefix
    )


if __name__ == "__main__":
    sys.exit(main())
