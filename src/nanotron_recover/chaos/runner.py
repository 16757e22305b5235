"""Running a chaos campaign: start the job as ``launch`` does, send each fault from outside at its
moment, watch how the job reacts, and catch a hang.

The job is ``nanotron-recover launch`` itself, started in a session of its own: the supervisor
runs ``mpirun``, relaunches a job lost as a whole, and re-joins happen inside the job, exactly as
for a user. The runner only reads the run directory (:mod:`.watch`) and sends signals through a
:class:`~.targets.Target`.

Each fault of the schedule, in order:

1. *ready*: step ``fault.step - 1`` has committed, the previous fault's reaction was seen (a commit
   after it), and, with re-join on, the job is back at full width with no re-join in flight (or
   ``ready_timeout_s`` passed: the fault is then sent at the width the job has, and the report says
   so). Then ``delay`` x the step time;
2. *send*: the victims are looked up in the rank table at that moment (a drawn replica that is
   down is replaced by the next alive one) and signalled; composite kinds wait for their window
   first, from the records: a freeze not detected yet (no commit and no incident since it), a
   re-join in flight (the crash's incident written, a spawned process the rank table does not
   list yet), a checkpoint folder ``step_N.tmp``, a commit (the snapshot write that follows it).
   Whether the second signal landed in its window is recorded (``in_window``);
3. *reaction*: wait for the next commit.

**A hang** is no commit for longer than a bound derived from the step time,
``max(hang_floor_s, hang_factor x median step)``, while the job is not recovering; while it is,
the bound grows by what the recovery may take by the job's own bounds: after a fault, the failure
detector (2 x the heartbeat timeout), the supervisor's commit deadline (its 60 s floor) or a stuck
re-join's ``join_timeout_s``, and the relaunch either one makes (``start_allowance_s``); a start or
relaunch (``start_allowance_s``); a re-join in flight (its ``join_timeout_s``); after the run recorded completion, the supervisor's grace period. A hang, or
the campaign's own ``timeout_s``, ends the job: SIGKILL of the launch process's group and every
process below it, nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config
from .kinds import KINDS
from .schedule import PlannedFault, Schedule, Victim
from .strikes import Striker
from .targets import LocalTarget, RankProcess, Target, process_alive
from .watch import RunWatch

# The supervisor's commit deadline (``commit_deadline.py``) ends a job that commits nothing for its
# floor plus a few steps and relaunches it: a fault's recovery may take that long before a relaunch.
DEADLINE_FLOOR_S = 60.0


class JobExited(Exception):
    """The job's launch process exited."""


class TooLate(Exception):
    """The job reached its last step before the next fault could be sent."""


class HangFound(Exception):
    """The job made no progress for longer than its bound."""

    def __init__(self, info: dict[str, Any]):
        super().__init__(info.get("message", "hang"))
        self.info = info


@dataclass
class CampaignOptions:
    config: Path
    run_dir: Path
    sets: list[str]
    schedule: Schedule
    cfg: Config
    timeout_s: float = 1800.0
    hang_floor_s: float = 30.0
    hang_factor: float = 50.0
    start_allowance_s: float = 120.0
    ready_timeout_s: float = 90.0
    poll_s: float = 0.01
    # How the job is started: ``launch`` on this host by default; a cluster target's campaign gives
    # its own command (``sbatch --wait`` of the script ``nanotron-recover slurm`` renders) and the
    # environment it needs. The command's exit status is the job's.
    launch_cmd: list[str] | None = None
    launch_env: dict[str, str] | None = None
    log: Callable[[str], None] = field(
        default=lambda line: print(f"chaos: {line}", file=sys.stderr, flush=True)
    )


@dataclass
class CampaignRun:
    """What the runner did and saw; :mod:`.report` judges it."""

    launch_cmd: list[str]
    started_at: float
    ended_at: float = 0.0
    exit_code: int | None = None  # launch's; None when the runner ended the job
    sent: list[dict[str, Any]] = field(default_factory=list)
    unsent: list[dict[str, Any]] = field(default_factory=list)
    hang: dict[str, Any] | None = None
    left_behind: list[int] = field(default_factory=list)  # stopped processes still there at the end
    watch: RunWatch | None = None


def launch_command(config: Path, run_dir: Path, sets: list[str]) -> list[str]:
    """``nanotron-recover launch`` with the campaign's overrides."""
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "launch", "--config", str(config)]
    return cmd + ["--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]


class Campaign:
    def __init__(self, opts: CampaignOptions, target_factory: Callable[[Path, int], Target] = LocalTarget):
        self.o = opts
        self.cfg = opts.cfg
        self.target_factory = target_factory
        self.dp = self.cfg.parallelism.dp
        self.size = self.cfg.parallelism.replica_size
        self.target_step = self.cfg.tokens.train_steps
        rec = self.cfg.recover
        self.rejoin_on = rec.rejoin.mode == "spawn"
        self.hb_timeout = rec.heartbeat_timeout_s
        self.join_timeout = rec.rejoin.join_timeout_s
        self.kill_all_pending = False
        self.too_late = False

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> CampaignRun:
        o = self.o
        cmd = list(o.launch_cmd) if o.launch_cmd else launch_command(o.config, o.run_dir, o.sets)
        env = dict(os.environ if o.launch_env is None else o.launch_env)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        o.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_file = open(o.run_dir / "chaos_job.log", "w")  # noqa: SIM115 - closed in finally
        run = CampaignRun(launch_cmd=cmd, started_at=time.time())
        self.proc = subprocess.Popen(
            cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.target = self.target_factory(o.run_dir, self.proc.pid)
        self.watch = run.watch = RunWatch(o.run_dir, started_at=run.started_at)
        self.strike = Striker(self.target, self.watch, self.cfg, o.run_dir)
        self.run_record = run
        try:
            faults = list(o.schedule.faults)
            try:
                try:
                    while faults:
                        self._one(faults[0])
                        faults.pop(0)
                except TooLate:
                    self.too_late = True
                self._wait(lambda: False, "the job's end", interval=0.05)
            except JobExited:
                pass
            except HangFound as hang:
                run.hang = hang.info
                o.log(f"HANG: {hang.info['message']}: ending the job")
                self.target.end_job()
            done = {f["index"] for f in run.sent}
            for fault in (f for f in faults if f.index not in done):
                run.unsent.append(
                    {
                        "index": fault.index,
                        "kind": fault.kind,
                        "scheduled_step": fault.step,
                        "why": self._why_unsent(),
                    }
                )
            try:
                run.exit_code = self.proc.wait(timeout=60 if run.hang is None else 10)
            except subprocess.TimeoutExpired:
                self.target.end_job()
                self.proc.wait()
            if run.hang is not None:
                run.exit_code = None
        except BaseException:
            self.target.end_job()
            self.proc.wait()
            raise
        finally:
            self.log_file.close()
        run.ended_at = time.time()
        self.watch.poll()
        run.left_behind = self._left_behind()
        return run

    def _why_unsent(self) -> str:
        if self.run_record.hang is not None:
            return "the job hung before it"
        if self.too_late:
            return f"the job reached its last step ({self.target_step}) before it"
        if self.proc.poll() is not None:
            return f"the job ended (exit {self.proc.returncode}) at step {self.watch.last_step} before it"
        return "not reached"

    def _left_behind(self) -> list[int]:
        """Processes this campaign froze that still exist after the job ended: SIGKILLed here (each
        checked to still be a training process of this run directory)."""
        left = []
        for pid in self.strike.stopped:
            if not process_alive(pid):
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(self.o.run_dir.resolve()) in argv and "nanotron_recover.cli" in argv:
                left.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        return left

    # -- waiting ------------------------------------------------------------------------------------
    def _step_s(self) -> float:
        return self.watch.step_time_s() or 0.5

    def _base_bound(self) -> float:
        return max(self.o.hang_floor_s, self.o.hang_factor * self._step_s())

    def _tick(self) -> None:
        w = self.watch
        w.poll()
        self.target.tick()
        if self.proc.poll() is not None:
            raise JobExited()
        now = time.time()
        if now - w.started_at > self.o.timeout_s:
            raise HangFound(
                {
                    "message": f"the campaign's timeout of {self.o.timeout_s:g} s passed at step {w.last_step}",
                    "kind": "timeout",
                    "at": now,
                    "last_step": w.last_step,
                }
            )
        stalled = now - w.last_progress
        base = self._base_bound()
        if stalled <= base:
            return
        bound, why = self._bound(now, base)
        if stalled > bound:
            raise HangFound(
                {
                    "message": f"no commit for {stalled:.1f} s after step {w.last_step} "
                    f"(bound {bound:.1f} s: {why})",
                    "kind": "hang",
                    "at": now,
                    "last_step": w.last_step,
                    "stalled_s": stalled,
                    "bound_s": bound,
                    "state": why,
                    "step_s": self._step_s(),
                }
            )

    def _bound(self, now: float, base: float) -> tuple[float, str]:
        """The hang bound now, with what the job is doing."""
        w = self.watch
        if w.outcome is not None and w.outcome.get("status") == "completed":
            return 2 * self.hb_timeout + 10 + 30, "completed, waiting for mpirun to exit"
        allowances = [(0.0, "training")]
        last_commit = w.last_commit_at()
        if last_commit is None or any(at > last_commit for at, _ in w.generations):
            allowances.append((self.o.start_allowance_s, "starting (or relaunched)"))
        if self.strike.last_signal_at is not None and (
            last_commit is None or self.strike.last_signal_at > last_commit
        ):
            # Detection and repair; past them the job's own commit deadline (its floor and a few
            # steps) ends and relaunches a job held by a stuck member: that relaunch too.
            extra = 2 * self.hb_timeout + 10 + DEADLINE_FLOOR_S + self.o.start_allowance_s
            if self.rejoin_on:
                extra = max(extra, self.join_timeout + 10 + self.o.start_allowance_s)
            allowances.append((extra, "recovering from a fault"))
        if self.rejoin_on and self.target.unlisted():
            allowances.append((self.join_timeout + 10, "a re-join in flight"))
        extra, why = max(allowances)
        return base + extra, why

    def _wait(
        self, cond: Callable[[], bool], what: str, timeout: float | None = None, interval: float = 0.0
    ) -> bool:
        """Poll until ``cond()``; False when ``timeout`` passed first. Raises JobExited/HangFound."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = interval or self.o.poll_s
        while True:
            self._tick()
            if cond():
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(interval)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self._wait(lambda: time.monotonic() >= end, "a delay")

    def _full_width(self) -> bool:
        return self.watch.replicas == self.dp and not self.target.unlisted()

    # -- one fault ------------------------------------------------------------------------------------
    def _one(self, fault: PlannedFault) -> None:
        o, w = self.o, self.watch
        self._wait(lambda: w.last_step >= fault.step - 1, f"step {fault.step - 1}", interval=0.005)
        ready_note = None
        if self.rejoin_on and not self._full_width():
            t0 = time.time()
            ok = self._wait(self._full_width, "full width", timeout=o.ready_timeout_s, interval=0.05)
            ready_note = (
                f"waited {time.time() - t0:.1f} s for full width"
                if ok
                else f"not back at full width after {o.ready_timeout_s:g} s: sent at {w.replicas} replicas"
            )
        if w.last_step >= self.target_step - 1:
            raise TooLate()  # the job is in (or past) its last step
        self._sleep(fault.delay * self._step_s())
        record: dict[str, Any] = {
            "index": fault.index,
            "kind": fault.kind,
            "scheduled_step": fault.step,
            "delay": fault.delay,
            "role": fault.role,
            "replicas_at_send": w.replicas,
            "incidents_before": len(w.incidents),
            "generation_before": w.generation,
            "signals": [],
            "notes": [ready_note] if ready_note else [],
        }
        sender = getattr(self, f"_send_{fault.kind}")
        record["step"] = w.last_step + 1
        self.run_record.sent.append(record)
        sender(fault, record)
        sent = [s for s in record["signals"] if s["sent"]]
        if not sent:
            record["notes"].append("no signal could be sent")
            return
        record["sent_at"] = sent[0]["at"]
        o.log(
            f"fault {fault.index} {fault.kind}: "
            + ", ".join(
                f"{s.get('node_action') or signal.Signals(s['sig']).name} rank {s['rank']} pid {s['pid']}"
                + (f" on {s['node']}" if s.get("node") else "")
                for s in sent
            )
            + f" during step {record['step']}"
        )
        self._reaction(record)

    def _reaction(self, record: dict[str, Any]) -> None:
        """Wait for the first commit after the last signal (by the records' own clock). The step
        committed first after the first signal is the step the fault struck."""
        w = self.watch
        last = max(s["at"] for s in record["signals"] if s["sent"])
        self._wait(lambda: any(c.time > last for c in w.commits), "a commit after the fault", interval=0.005)
        first = next(c for c in w.commits if c.time > record["sent_at"])
        record["step"] = first.step
        record["to_next_commit_s"] = first.time - record["sent_at"]
        self.kill_all_pending = False

    # -- the kinds -------------------------------------------------------------------------------------
    def _send_node(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        self.strike.node_fault(fault, record)

    _send_node_power_off = _send_node
    _send_link_cut = _send_node
    _send_node_freeze = _send_node

    def _send_kill(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        (proc,) = self.strike.victims(fault, record)
        self.strike.signal(record, proc, signal.SIGKILL)

    def _send_freeze(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        (proc,) = self.strike.victims(fault, record)
        self.strike.signal(record, proc, signal.SIGSTOP)

    def _send_kill_two(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        for proc in self.strike.victims(fault, record):
            self.strike.signal(record, proc, signal.SIGKILL)

    def _send_kill_all(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        self.kill_all_pending = True
        for proc in sorted(self.target.ranks().values(), key=lambda p: p.rank or 0):
            if self.target.alive(proc):
                self.strike.signal(record, proc, signal.SIGKILL)

    def _send_kill_during_recovery(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        frozen, other = self.strike.victims(fault, record)
        if not self.strike.signal(record, frozen, signal.SIGSTOP):
            return
        w, t0 = self.watch, time.time()
        incidents = len(w.incidents)
        stall = max(3 * self._step_s(), 0.3)

        def waiting() -> bool:  # the survivors stopped committing: they wait on the frozen rank
            last = max(t0, w.last_commit_at() or t0)
            return time.time() - last >= stall or len(w.incidents) > incidents

        self._wait(waiting, "the survivors waiting on the frozen rank", timeout=2 * self.hb_timeout + 5)
        in_window = len(w.incidents) == incidents and w.generation == record["generation_before"]
        self.strike.signal(
            record, other, signal.SIGKILL, in_window=in_window, after_freeze_s=time.time() - t0
        )

    def _send_kill_during_rejoin(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        first, member = self.strike.victims(fault, record)
        if not self.strike.signal(record, first, signal.SIGKILL):
            return
        w, incidents = self.watch, len(self.watch.incidents)
        crash_seen = self._wait(lambda: len(w.incidents) > incidents, "the crash's incident", timeout=60)
        if not crash_seen:
            record["notes"].append("no incident for the first kill within 60 s")
            return
        spawned: list[RankProcess] = []

        def spawning() -> bool:
            spawned[:] = self.target.unlisted()
            return bool(spawned)

        timeout = self.cfg.recover.rejoin.after_steps * self._step_s() + 60
        if not self._wait(spawning, "a spawned replacement", timeout=timeout, interval=0.02):
            record["notes"].append(f"no re-join started within {timeout:.0f} s of the incident")
            return
        self._sleep(fault.delay * 0.5)
        rejoins = sum(1 for i in w.incidents if i.get("kind") == "rejoin")
        victim = spawned[0] if fault.role == "spawned" else member
        pending = {p.pid for p in self.target.unlisted()}
        in_window = bool(pending) and rejoins == sum(1 for i in w.incidents if i.get("kind") == "rejoin")
        if fault.role == "spawned" and victim is not None:
            in_window = in_window and victim.pid in pending
            victim = RankProcess(
                first.rank if first else None, first.replica if first else None, victim.host, victim.pid
            )
        self.strike.signal(record, victim, signal.SIGKILL, in_window=in_window, role=fault.role)

    def _send_kill_during_save(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        ck = self.cfg.checkpoints
        folder = Path(ck.checkpoints_path) if ck.checkpoints_path else self.o.run_dir / "checkpoints"
        interval = max(1, ck.checkpoint_interval)
        found = self._wait(
            lambda: any(folder.glob("step_*.tmp")),
            "a checkpoint being written",
            timeout=(interval + 2) * self._step_s() + 30,
            interval=0.001,
        )
        if not found:
            record["notes"].append("no checkpoint save seen in time")
        alive = sorted({p.replica for p in self.target.ranks().values() if self.target.alive(p)} - {None})
        writer = alive[0] if alive else 0
        proc = self.strike.resolve(Victim(writer, fault.victims[0].local_rank), set(), record["notes"])
        in_window = any(folder.glob("step_*.tmp"))
        self.strike.signal(record, proc, signal.SIGKILL, in_window=in_window, writer_replica=writer)

    def _send_kill_during_snapshot(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        (proc,) = self.strike.victims(fault, record)
        if proc is None:
            return
        w = self.watch
        commits = len(w.commits)
        self._wait(lambda: len(w.commits) > commits, "a commit", timeout=self._base_bound(), interval=0.001)
        unpublished = self.strike.unpublished_slot(proc)
        self.strike.signal(record, proc, signal.SIGKILL, in_window=unpublished)


def needs_of(kinds: list[str] | tuple[str, ...], cfg: Config, target: Target | None = None) -> list[str]:
    """What the config (or the target) lacks for these kinds: one line each (empty: all fine)."""
    rec = cfg.recover
    problems = []
    if not rec.forward:
        problems.append(
            "a chaos campaign needs forward recovery: --set recover.enabled=true (recover.mode: forward)"
        )
    for name in kinds:
        info = KINDS[name]
        if info.node_level and (target is None or not target.supports(name)):
            problems.append(
                f"fault kind {name} needs a multi-node cluster target (the emulated cluster's: "
                "tests/helpers/chaos_cluster.py): this command sends faults to the processes of one host only"
            )
        if info.needs_rejoin and rec.rejoin.mode != "spawn":
            problems.append(f"fault kind {name} needs re-join: --set recover.rejoin.mode=spawn")
        if info.needs_checkpoints and cfg.checkpoints.checkpoint_interval <= 0:
            problems.append(f"fault kind {name} needs checkpoints: --set checkpoints.checkpoint_interval=N")
        if info.needs_snapshots and rec.snapshot.interval <= 0:
            problems.append(
                f"fault kind {name} needs node-memory snapshots: --set recover.snapshot.interval=1"
            )
    return problems
