"""The supervisor's rule for a job that lost every replica (``supervisor.py``): exit 1, and an
outcome record that says so (kind ``all_replicas_lost``, the last committed step), whether a rank
outlived the replicas and wrote it or nobody was left and the supervisor writes it; such a job is
relaunched like one without a record. Its edges: the relaunch's probe overlaps the cleanup, a
probe or a watch that raises costs no record, a command it cannot restrict to the answering hosts
is said once, a process it cannot reap is left behind. Fake jobs (a Python script standing in for
``mpirun``), no MPI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover import supervisor
from nanotron_recover.errors import ExitCode
from nanotron_recover.ft import prrte_fix, rank_fixes
from nanotron_recover.generation import read_relaunch
from nanotron_recover.hosts import HostPlan
from nanotron_recover.lost_hosts import LostHostWatch
from nanotron_recover.outcome import read_outcome
from nanotron_recover.supervisor import end_session, run_relaunching, supervise


def fake_job(tmp_path: Path, body: str) -> list[str]:
    """A script standing in for mpirun: it counts its launches (``n``), can ``commit(step)`` a
    metrics record and ``record(...)`` an outcome, as the ranks do."""
    script = tmp_path / "fake_job.py"
    script.write_text(
        "import json, sys, time\nfrom pathlib import Path\n"
        f"run_dir, tmp = Path({str(tmp_path / 'run')!r}), Path({str(tmp_path)!r})\n"
        "count = tmp / 'launches'\nn = int(count.read_text()) + 1 if count.exists() else 1\n"
        "count.write_text(str(n))\nrun_dir.mkdir(parents=True, exist_ok=True)\n"
        "def commit(step):\n"
        "    with open(run_dir / 'metrics.jsonl', 'a') as f:\n"
        "        f.write(json.dumps({'step': step, 'loss': 1.0}) + '\\n')\n"
        "def record(status, last_step, kind, exit_code, target_step=5):\n"
        "    r = dict(status=status, last_step=last_step, target_step=target_step, kind=kind,\n"
        "             message=f'{kind} after step {last_step}', exit_code=exit_code, time=time.time())\n"
        "    (run_dir / 'outcome.json').write_text(json.dumps(r))\n" + body
    )
    return [sys.executable, str(script)]


def launches(tmp_path: Path) -> int:
    return int((tmp_path / "launches").read_text())


@pytest.mark.parametrize("mode", ["plain", "forward"])
def test_a_job_that_ends_without_a_record_is_recorded_as_every_replica_lost(tmp_path, capfd, mode):
    cmd = fake_job(tmp_path, "commit(1); commit(2)\n")  # every rank gone after step 2, no record
    run_dir = tmp_path / "run"
    if mode == "plain":
        code = supervise(cmd, run_dir, grace_s=1.0, target_step=5)
    else:  # no relaunch left: the record is how the run ended
        code = run_relaunching(cmd, run_dir, grace_s=1.0, relaunches=0, target_step=5)

    assert code == ExitCode.FAILED == 1
    outcome = read_outcome(run_dir)
    assert outcome is not None
    assert (outcome["status"], outcome["kind"], outcome["last_step"], outcome["target_step"]) == (
        "stopped",
        "all_replicas_lost",
        2,
        5,
    )
    assert outcome["exit_code"] == 1
    assert outcome["message"].startswith("every replica lost: the job ended without an outcome record")
    assert outcome["message"].endswith("last committed step 2 of 5")
    err = capfd.readouterr().err
    assert f"nanotron-recover launch: run ended without completing: {outcome['message']}" in err


def test_a_rank_that_outlived_every_replica_records_the_same_and_exits_1(tmp_path):
    cmd = fake_job(tmp_path, "commit(1)\nrecord('stopped', 1, 'all_replicas_lost', 1)\n")
    code = supervise(cmd, tmp_path / "run", grace_s=1.0, target_step=5)

    assert code == 1
    outcome = read_outcome(tmp_path / "run")
    assert outcome is not None
    assert (outcome["kind"], outcome["last_step"], outcome["message"]) == (
        "all_replicas_lost",
        1,
        "all_replicas_lost after step 1",  # the rank's record, not replaced
    )


def test_a_job_lost_with_a_record_is_relaunched_like_one_without(tmp_path):
    body = (
        "if n == 1:\n    commit(1); commit(2); record('stopped', 2, 'all_replicas_lost', 1)\n"
        "else:\n    commit(3); record('completed', 3, None, 0, target_step=3)\n"
    )
    code = run_relaunching(
        fake_job(tmp_path, body), tmp_path / "run", grace_s=1.0, relaunches=2, target_step=3
    )

    assert code == 0
    assert launches(tmp_path) == 2
    outcome = read_outcome(tmp_path / "run")
    assert outcome is not None and outcome["status"] == "completed"


def test_a_stop_for_too_few_replicas_is_not_relaunched(tmp_path):
    body = "commit(n); record('stopped', n, 'too_few_replicas', 3)\n"
    code = run_relaunching(
        fake_job(tmp_path, body), tmp_path / "run", grace_s=1.0, relaunches=2, target_step=5
    )

    assert code == ExitCode.TOO_FEW_REPLICAS == 3
    assert launches(tmp_path) == 1
    outcome = read_outcome(tmp_path / "run")
    assert outcome is not None and outcome["kind"] == "too_few_replicas"


def test_a_job_stopped_to_regrow_that_does_not_exit_is_ended_after_the_grace_and_relaunched(tmp_path, capfd):
    """Seen in a campaign: every rank recorded the regrow stop, then a process hung on its way out
    and mpirun never exited (150 s, no commit deadline: a stopped record turned it off)."""
    body = (
        "if n == 1:\n    commit(1); commit(2); record('stopped', 2, 'regrow', 1); time.sleep(120)\n"
        "else:\n    commit(3); record('completed', 3, None, 0, target_step=3)\n"
    )
    code = run_relaunching(
        fake_job(tmp_path, body), tmp_path / "run", grace_s=1.0, relaunches=2, target_step=3
    )

    assert code == 0 and launches(tmp_path) == 2
    # Ended by the grace (without it the hung process's 120 s pass and it exits by itself).
    assert "the run stopped (step 2 of 5) but mpirun had not exited 1s later" in capfd.readouterr().err
    outcome = read_outcome(tmp_path / "run")
    assert outcome is not None and outcome["status"] == "completed"


def test_a_lost_job_record_written_by_the_supervisor_is_valid_json_with_every_key(tmp_path):
    supervise(fake_job(tmp_path, "pass\n"), tmp_path / "run", grace_s=1.0)
    record = json.loads((tmp_path / "run" / "outcome.json").read_text())
    assert set(record) == {
        "status",
        "last_step",
        "target_step",
        "kind",
        "message",
        "exit_code",
        "time",
        "token",
    }
    assert (record["last_step"], record["target_step"], record["exit_code"]) == (0, None, 1)


# -- the relaunch's edges ---------------------------------------------------------------------------
class Hosts(HostPlan):
    """The allocation's hosts; every probe answers ``answer`` after ``delay_s`` (or raises)."""

    def __init__(self, hosts: list[str], answer: list[str] | None = None, delay_s: float = 0.0, error=None):
        super().__init__(hosts)
        self.answer = list(hosts) if answer is None else answer
        self.delay_s, self.error, self.probes = delay_s, error, 0

    def answering(self) -> list[str]:
        self.probes += 1
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return list(self.answer)


LOST_THEN_DONE = (
    "if n == 1:\n    commit(1)\n"  # lost after step 1, no record
    "else:\n    commit(2); record('completed', 2, None, 0, target_step=2)\n"
)


def relaunch(tmp_path: Path, body: str, hosts: HostPlan, relaunches: int = 2) -> int:
    return run_relaunching(
        fake_job(tmp_path, body),
        tmp_path / "run",
        grace_s=1.0,
        relaunches=relaunches,
        hosts=hosts,
        timeout_s=120,
    )


def test_the_probe_runs_while_the_ended_job_is_cleaned_up(tmp_path):
    """The lost job leaves a process that ignores SIGTERM (ended 0.5 s + 1 s later, by SIGKILL);
    the probe takes 1 s. It starts when the job ends, so the relaunch starts after the longer of the
    two, not after both; each part still measures itself."""
    body = (
        "import subprocess\n"
        "if n == 1:\n"
        "    subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "    commit(1); time.sleep(0.5)\n"
        "else:\n    commit(2); record('completed', 2, None, 0, target_step=2)\n"
    )
    hosts = Hosts(["a"], delay_s=1.0)
    assert relaunch(tmp_path, body, hosts) == 0
    record = read_relaunch(tmp_path / "run")
    assert record is not None and hosts.probes == 1 and record.hosts_lost == []
    took = record.launched_at - record.ended_at
    print(f"cleanup_s {record.cleanup_s:.2f}, probe_s {record.probe_s:.2f}, end to relaunch {took:.2f} s")
    assert record.cleanup_s >= 1.0 and 1.0 <= record.probe_s < 1.5
    assert took < record.cleanup_s + record.probe_s - 0.5
    assert took >= max(record.cleanup_s, record.probe_s)


def test_a_probe_that_raises_relaunches_as_before_and_keeps_the_record(tmp_path, capfd):
    hosts = Hosts(["a", "b"], error=RuntimeError("sinfo output not understood"))
    assert relaunch(tmp_path, LOST_THEN_DONE, hosts) == 0
    err = capfd.readouterr().err
    assert (
        err.count(
            "probing the hosts failed (RuntimeError: sinfo output not understood): no host counted lost"
        )
        == 1
    )
    record = read_relaunch(tmp_path / "run")
    assert record is not None and record.cause == "job_lost" and record.hosts_lost == []
    assert (read_outcome(tmp_path / "run") or {}).get("status") == "completed"


def test_a_lost_host_watch_that_raises_stops_watching_and_keeps_the_record(tmp_path, capfd, monkeypatch):
    def broken(self):
        raise KeyError("rank")

    monkeypatch.setattr(LostHostWatch, "poll", broken)
    body = "if n == 1:\n    commit(1); time.sleep(1.5)\nelse:\n    commit(2); record('completed', 2, None, 0, target_step=2)\n"
    assert relaunch(tmp_path, body, Hosts(["a", "b"])) == 0
    err = capfd.readouterr().err
    assert err.count("the lost-host watch failed (KeyError: 'rank'): not watching this job") == 1
    assert (read_outcome(tmp_path / "run") or {}).get("status") == "completed"


def test_a_job_that_commits_nothing_on_a_host_that_does_not_answer_is_relaunched_without_it(tmp_path, capfd):
    """A cut-off process that no detector watches: no incident, no suspect, the job just stops
    committing. Once it has committed nothing for the probe interval, the supervisor asks its
    hosts; b does not answer, so the job is ended and relaunched without b long before the 60 s
    commit bound."""
    body = (
        "if n == 1:\n"
        "    (run_dir / 'ranks.json').write_text(json.dumps([{'rank': 0, 'host': 'a'}, {'rank': 1, 'host': 'b'}]))\n"
        "    commit(1); time.sleep(60)\n"
        "else:\n    commit(2); record('completed', 2, None, 0, target_step=2)\n"
    )
    hosts = Hosts(["a", "b"], answer=["a"])
    code = run_relaunching(
        fake_job(tmp_path, body),
        tmp_path / "run",
        grace_s=1.0,
        relaunches=2,
        hosts=hosts,
        timeout_s=120,
        deadline=supervisor.DeadlineArgs(fixed_s=60, probe_s=0.5),
    )
    assert code == 0
    err = capfd.readouterr().err
    assert "hosts b of the job do not answer while it commits no step" in err, err
    assert "the job stalled" not in err, err
    record = read_relaunch(tmp_path / "run")
    assert record is not None and record.cause == "node_lost" and record.hosts_lost == ["b"]
    assert (read_outcome(tmp_path / "run") or {}).get("status") == "completed"


def test_a_command_that_cannot_be_restricted_to_the_answering_hosts_is_said_once(tmp_path, capfd):
    """A job not started by an Open MPI launcher (here, Python itself) is relaunched as it was,
    twice, with host b lost: said once, not silently."""
    body = "commit(n)\nif n == 3:\n    record('completed', 3, None, 0, target_step=3)\n"
    assert relaunch(tmp_path, body, Hosts(["a", "b"], answer=["a"]), relaunches=3) == 0
    assert launches(tmp_path) == 3
    err = capfd.readouterr().err
    assert err.count("cannot restrict the relaunch to the hosts that answer") == 1
    assert f"{sys.executable} is not one of Open MPI's launchers (mpirun, mpiexec, prterun, orterun)" in err
    record = read_relaunch(tmp_path / "run")
    assert record is not None and record.hosts_lost == ["b"] and record.hosts == ["a"]


def test_a_relaunch_starts_on_the_hosts_the_last_ranks_ran_on(tmp_path):
    """Re-joins put the ranks on c and b (the rank table); every rank then dies. The relaunch lists
    c and b first, where the newest node-memory snapshots are, not the allocation's a, b, c: the
    runtime fills the hosts in that order. Seen on the emulated cluster: in allocation order the
    relaunch found only older snapshots and resumed from the disk checkpoint."""
    launcher = tmp_path / "bin" / "mpirun"  # an Open MPI launcher's name: its line is rewritten
    launcher.parent.mkdir()
    job = fake_job(
        tmp_path,
        "if n == 1:\n"
        + TABLE_C_B
        + "    commit(1)\n"
        + "else:\n    commit(2); record('completed', 2, None, 0, target_step=2)\n",
    )
    launcher.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(tmp_path / 'argv.jsonl')!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"exec(open({job[1]!r}).read())\n"
    )
    launcher.chmod(0o755)
    cmd = [str(launcher), "--map-by", "ppr:1:node", "-n", "2", "prog"]
    code = run_relaunching(
        cmd, tmp_path / "run", grace_s=1.0, relaunches=2, hosts=Hosts(["a", "b", "c"]), timeout_s=120
    )
    assert code == 0
    lines = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and "--host" not in lines[0]
    assert lines[1][lines[1].index("--host") + 1] == "c:1,b:1,a:1"


TABLE_C_B = (
    "    rows = [{'rank': 1, 'host': 'b', 'pid': 11}, {'rank': 0, 'host': 'c', 'pid': 10}]\n"
    "    (run_dir / 'ranks.json').write_text(json.dumps(rows))\n"
)


class Unreapable:
    """A session leader that SIGKILL does not end (uninterruptible sleep): ``wait`` never returns."""

    def __init__(self) -> None:
        with open("/proc/sys/kernel/pid_max") as f:
            self.pid = int(f.read()) + 1000  # no such process, nor process group
        self.args = ["stuck"]

    def poll(self) -> None:
        return None

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            raise AssertionError("a wait without a bound")
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("stuck", timeout)


@pytest.mark.skipif(not os.path.exists("/proc/sys/kernel/pid_max"), reason="Linux /proc")
def test_a_process_that_cannot_be_reaped_is_left_behind_and_said(monkeypatch):
    monkeypatch.setattr(supervisor, "REAP_WAIT_S", 0.3)
    proc = Unreapable()
    lines: list[str] = []
    start = time.monotonic()
    ended = end_session(proc, term_wait_s=0.2, log=lines.append)  # type: ignore[arg-type]
    assert time.monotonic() - start < 2.0
    assert ended == [f"pid {proc.pid} (stuck)"]
    assert lines == [
        f"pid {proc.pid} (stuck) not ended 0.3s after SIGKILL (stuck in the kernel?): left behind"
    ]


@pytest.mark.skipif(prrte_fix.compiler() is None, reason="needs a C compiler")
def test_mpirun_is_started_with_the_runtime_fix_and_the_ranks_are_told(tmp_path, monkeypatch):
    """A command that starts mpirun goes through ``fresh_session.sh`` with the PRRTE fix built and
    preloaded (``ft/prrte_fix.py``), and the launch's environment names it and the ranks' Open MPI fixes
    (``ft/rank_fixes.py``); a command that starts no mpirun gets none, even where the supervisor's
    own environment named them."""
    monkeypatch.setenv(prrte_fix.ENV, "/stale/from/an/outer/launch.so")
    monkeypatch.setenv(rank_fixes.ENV, "/stale/from/an/outer/launch.so")
    job = fake_job(tmp_path, "commit(1); record('completed', 1, None, 0, target_step=1)\n")
    shown = tmp_path / "environment"
    mpirun = tmp_path / "mpirun"  # a stand-in: says what it was given, then runs the fake job
    mpirun.write_text(
        f'#!/bin/sh\necho "$LD_PRELOAD|${prrte_fix.ENV}|${rank_fixes.ENV}" > {shown}\nexec {" ".join(job)}\n'
    )
    mpirun.chmod(0o755)
    run_dir = tmp_path / "run"
    assert supervise([str(mpirun)], run_dir, grace_s=1.0, target_step=1) == 0
    library = str(prrte_fix.library_path(run_dir.resolve()))
    ranks_fix = str(rank_fixes.library_path(run_dir.resolve()))
    assert shown.read_text().strip() == f"{library}|{library}|{ranks_fix}"

    (tmp_path / "launches").unlink()
    no_mpirun = tmp_path / "job.sh"
    no_mpirun.write_text(
        f'#!/bin/sh\necho "$LD_PRELOAD|${prrte_fix.ENV}|${rank_fixes.ENV}" > {shown}\nexec {" ".join(job)}\n'
    )
    no_mpirun.chmod(0o755)
    assert supervise([str(no_mpirun)], run_dir, grace_s=1.0, target_step=1) == 0
    assert shown.read_text().strip() == "||"
