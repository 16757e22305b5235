"""The supervisor's relaunch (``supervisor.run_relaunching``): a job that ended without an outcome
record after committing new steps is relaunched as a new generation and goes on from the replicas'
node-memory snapshots (or, without them, from the disk checkpoint).

The rule is checked with fake "mpirun" scripts (fast, no MPI); then real ``launch`` jobs have every
rank SIGKILLed from outside at a moment the code does not choose, which ends the job the way a lost
node does on a cluster (Open MPI's runtime kills every rank). Each relaunched run must exit 0 with
every step committed, the fault-free run's micro-batch ids and losses, identical replicas, one
relaunch incident, and its snapshots removed at the end.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sys
from pathlib import Path

import pytest

from nanotron_recover.checkpoint import latest_step
from nanotron_recover.commit_record import read_commit
from nanotron_recover.generation import read_relaunch
from nanotron_recover.hosts import HostPlan
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome
from nanotron_recover.supervisor import run_relaunching
from tests.helpers.curves import assert_replicas_identical, assert_same_curve
from tests.helpers.mpirun_utils import (
    REPO,
    BackgroundJob,
    check,
    layout,
    process_exists,
    run_cli,
    run_process,
)

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 10
HEARTBEAT = ["recover.heartbeat_period_s=1", "recover.heartbeat_timeout_s=5"]
SUPERVISE = [sys.executable, "-m", "nanotron_recover.supervisor", "supervise"]


# -- the rule, with fake jobs ---------------------------------------------------------------------
def fake_job(tmp_path: Path, body: str) -> list[str]:
    """A script standing in for mpirun; it counts its launches in ``launches`` and sees ``run_dir``."""
    script = tmp_path / "fake_job.py"
    script.write_text(
        "import json\nfrom pathlib import Path\nfrom nanotron_recover.outcome import write_outcome\n"
        f"run_dir, tmp = Path({str(tmp_path / 'run')!r}), Path({str(tmp_path)!r})\n"
        "count = tmp / 'launches'\nn = int(count.read_text()) + 1 if count.exists() else 1\n"
        "count.write_text(str(n))\nrun_dir.mkdir(parents=True, exist_ok=True)\n"
        "def commit(step):\n"
        "    with open(run_dir / 'metrics.jsonl', 'a') as f:\n"
        "        f.write(json.dumps({'step': step, 'loss': 1.0}) + '\\n')\n" + body
    )
    return [sys.executable, str(script)]


def supervise(tmp_path: Path, cmd: list[str], relaunches: int):
    args = ["--run-dir", str(tmp_path / "run"), "--grace-s", "1", "--relaunches", str(relaunches)]
    return run_process([*SUPERVISE, *args, "--", *cmd], timeout=120)


def test_a_job_lost_after_new_steps_is_relaunched_as_the_next_generation(tmp_path):
    body = (
        "if n == 1:\n    commit(1); commit(2)\n"  # ends without an outcome, as a lost node's job does
        "else:\n    commit(3)\n"
        "    write_outcome(run_dir, status='completed', last_step=3, target_step=3, exit_code=0)\n"
    )
    result = supervise(tmp_path, fake_job(tmp_path, body), relaunches=2)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "launches").read_text() == "2"
    relaunch = read_relaunch(tmp_path / "run")
    assert relaunch is not None and relaunch.generation == 1
    assert relaunch.cause == "job_lost" and relaunch.last_committed == 2 and relaunch.hosts_lost == []
    assert (
        "ended without an outcome after step 2 (every replica lost): relaunching it (generation 1"
        in result.stderr
    )


@pytest.mark.parametrize("case", ["no_new_step", "no_relaunch_left"])
def test_no_relaunch_without_progress_or_past_the_limit(tmp_path, case):
    """A job that dies before committing a new step would die again (its start is retried once,
    then no more); the limit is a limit."""
    body = "commit(n)\n" if case == "no_relaunch_left" else "pass\n"
    result = supervise(tmp_path, fake_job(tmp_path, body), relaunches=1 if case == "no_relaunch_left" else 3)
    assert result.returncode == 1
    launches, why = (
        (2, "recover.max_restarts=1 relaunches used")
        if case == "no_relaunch_left"
        else (2, "no step committed since the last relaunch, and no host lost since")
    )
    assert (tmp_path / "launches").read_text() == str(launches)
    assert f"not relaunching: {why}" in result.stderr
    assert "every replica lost: the job ended without an outcome record" in result.stderr
    outcome = read_outcome(tmp_path / "run")
    assert outcome is not None and (outcome["kind"], outcome["exit_code"]) == ("all_replicas_lost", 1)


def test_a_job_lost_at_its_start_is_started_once_more(tmp_path):
    """A rank declared dead by mistake while the job starts (busy nodes) ends a job that has no step
    to lose: its start is retried once, and the run completes."""
    body = (
        "if n == 1:\n    pass\n"  # lost before its first commit
        "else:\n    commit(1)\n"
        "    write_outcome(run_dir, status='completed', last_step=1, target_step=1, exit_code=0)\n"
    )
    result = supervise(tmp_path, fake_job(tmp_path, body), relaunches=2)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "launches").read_text() == "2"
    assert (
        "(every replica lost, before a first commit: its start is retried once): relaunching it"
        in result.stderr
    )


class ScriptedHosts(HostPlan):
    """The allocation's hosts, answering as the test scripts it: one list per probe."""

    def __init__(self, hosts: list[str], answers: list[list[str]]):
        super().__init__(hosts)
        self.answers = answers

    def answering(self) -> list[str]:
        return self.answers.pop(0)


def test_a_host_lost_during_the_restart_is_a_new_fault_and_relaunches_again(tmp_path, capfd):
    """The relaunched job dies before committing a step, because one more host was lost while it
    started: relaunched once more, on the hosts left. Without a new lost host the same death stops
    the relaunches (the case above)."""
    body = (
        "if n == 1:\n    commit(1); commit(2)\n"  # the first node lost after step 2
        "elif n == 2:\n    pass\n"  # the second node lost while the relaunch starts: no commit
        "else:\n    commit(3)\n"
        "    write_outcome(run_dir, status='completed', last_step=3, target_step=3, exit_code=0)\n"
    )
    hosts = ScriptedHosts(["a", "b", "c", "d"], [["a", "c", "d"], ["a", "d"]])
    code = run_relaunching(
        fake_job(tmp_path, body), tmp_path / "run", grace_s=1, relaunches=3, hosts=hosts, timeout_s=120
    )
    err = capfd.readouterr().err
    assert code == 0, err
    assert (tmp_path / "launches").read_text() == "3"
    relaunch = read_relaunch(tmp_path / "run")
    assert relaunch.generation == 2 and relaunch.hosts_lost == ["b", "c"] and relaunch.hosts == ["a", "d"]
    assert relaunch.cause == "node_lost" and relaunch.last_committed == 2
    assert "after step 2 (hosts b, c lost): relaunching it (generation 2" in err


def test_a_relaunch_at_full_width_names_its_hosts_and_overlaps_the_old_steps(tmp_path):
    """Every host answers: the relaunch still names them, with the overlap. The job's own line
    would let the runtime start its daemons on the allocation the environment lists (which may
    still hold a node Slurm dropped from the job) without --overlap (which a cut-off node's old
    daemon step blocks): its srun failed and no relaunch could start."""
    launcher = tmp_path / "bin" / "mpirun"  # stands in for Open MPI's launcher: records its line
    launcher.parent.mkdir()
    body = (
        "(tmp / f'argv{n}.json').write_text(json.dumps(sys.argv[1:]))\n"
        "if n == 1:\n    commit(1); commit(2)\n"
        "else:\n    commit(3)\n"
        "    write_outcome(run_dir, status='completed', last_step=3, target_step=3, exit_code=0)\n"
    )
    job = fake_job(tmp_path, "import sys\n" + body)
    launcher.write_text(f"#!{sys.executable}\n" + Path(job[1]).read_text())
    launcher.chmod(0o755)
    cmd = [str(launcher), "-n", "2", "--map-by", "ppr:1:node", "python", "-m", "nanotron_recover.cli"]
    hosts = ScriptedHosts(["a", "b"], [["a", "b"]])
    code = run_relaunching(cmd, tmp_path / "run", grace_s=1, relaunches=2, hosts=hosts, timeout_s=120)
    assert code == 0
    first = json.loads((tmp_path / "argv1.json").read_text())
    second = json.loads((tmp_path / "argv2.json").read_text())
    # Every mpirun starts fresh (session_dirs.py): its daemons left attached, so they keep their pid.
    attached = ["--leave-session-attached"]
    assert first == attached + cmd[1:]
    assert second[:6] == [*attached, "--host", "a:1,b:1", "--prtemca", "plm_slurm_args", "--overlap"], second
    assert second[6:] == cmd[1:]
    assert read_relaunch(tmp_path / "run").hosts == ["a", "b"]


def test_a_frozen_host_is_relaunched_on_the_jobs_word_not_the_runtimes(tmp_path, capfd):
    """The job lost a rank to a hang and repaired it, and goes on waiting (as mpirun does for a
    node's daemon that stopped answering, until the runtime gives up on it tens of seconds
    later). The supervisor probes the lost rank's host at once; it does not answer, so the job is
    ended and relaunched without it."""
    body = (
        "import time\n"
        "ranks = [{'rank': r, 'host': h, 'pid': 1, 'replica': r} for r, h in enumerate('abc')]\n"
        "if n == 1:\n    (run_dir / 'ranks.json').write_text(json.dumps(ranks))\n    commit(1); commit(2)\n"
        "    with open(run_dir / 'incidents.jsonl', 'a') as f:\n"
        "        f.write(json.dumps({'step': 2, 'kind': 'hang', 'failed_ranks': [1]}) + '\\n')\n"
        "    time.sleep(600)\n"
        "else:\n    commit(3)\n"
        "    write_outcome(run_dir, status='completed', last_step=3, target_step=3, exit_code=0)\n"
    )
    hosts = ScriptedHosts(["a", "b", "c"], [["a", "c"]])  # one probe: the watch's, reused
    code = run_relaunching(
        fake_job(tmp_path, body), tmp_path / "run", grace_s=1, relaunches=2, hosts=hosts, timeout_s=120
    )
    err = capfd.readouterr().err
    assert code == 0, err
    assert (tmp_path / "launches").read_text() == "2"
    assert "hosts b of ranks the job lost do not answer: ended" in err
    relaunch = read_relaunch(tmp_path / "run")
    assert relaunch.cause == "node_lost" and relaunch.hosts_lost == ["b"] and relaunch.hosts == ["a", "c"]


def test_a_job_that_gives_itself_up_is_ended_and_relaunched(tmp_path):
    """A rank writes ``abandoned.json`` (a re-join stuck past its deadline) while mpirun would wait
    forever for a frozen process: the supervisor ends the job at once and relaunches it."""
    body = (
        "import time\nfrom nanotron_recover.outcome import write_abandoned\n"
        "if n == 1:\n    commit(1)\n    write_abandoned(run_dir, 'watchdog: phase rejoin hung')\n"
        "    time.sleep(600)\n"  # what a job waiting on a frozen process does
        "else:\n    commit(2)\n"
        "    write_outcome(run_dir, status='completed', last_step=2, target_step=2, exit_code=0)\n"
    )
    result = supervise(tmp_path, fake_job(tmp_path, body), relaunches=1)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "launches").read_text() == "2"
    assert "the job gave itself up (watchdog: phase rejoin hung): ended" in result.stderr
    assert "after step 1 (every replica lost): relaunching it (generation 1" in result.stderr
    assert not (tmp_path / "run" / "abandoned.json").exists()  # cleared before the relaunch


# -- real jobs, every rank killed from outside ------------------------------------------------------
def sets_for(run_dir: Path, extra: list[str]) -> list[str]:
    return [
        f"tokens.train_steps={STEPS}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        "checkpoints.save_final_state=false",
        "recover.watchdog_timeout_s=60",
        "recover.gate_timeout_s=30",
        f"recover.snapshot.dir={run_dir / 'node_memory'}",
        *extra,
    ]


def cli_args(command: str, run_dir: Path, sets: list[str]) -> list[str]:
    return [command, "--config", CONFIG, "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    """The fault-free reference: one process, G=8 (B=8)."""
    run_dir = tmp_path_factory.mktemp("plain")
    check(run_cli(cli_args("train", run_dir, sets_for(run_dir, layout(1, 1, 1, 8)))))
    return read_metrics(run_dir)


def kill_every_rank(job: BackgroundJob, after_step: int) -> tuple[int, list[int]]:
    """SIGKILL every rank of the job once it committed ``after_step``; (committed then, pids)."""
    job.wait_until(lambda: job.committed() >= after_step, f"step {after_step}")
    pids = [r["pid"] for r in json.loads((job.run_dir / "ranks.json").read_text())]
    # The supervisor's word on the last commit (commit.json is written just after the step's
    # metrics line: the two may differ by one at the kill).
    record = read_commit(job.run_dir)
    committed = job.committed() if record is None else record.step
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return committed, pids


@pytest.mark.mpi
@pytest.mark.parametrize("state", ["snapshot", "checkpoint", "newer_checkpoint"])
def test_every_rank_killed_from_outside_is_relaunched_and_goes_on(tmp_path, plain, state):
    """``snapshot``: the relaunched job restores the newest step every coordinate holds in node
    memory. ``checkpoint``: snapshots off, it resumes from the latest disk checkpoint instead.
    ``newer_checkpoint``: snapshots every 4 steps, checkpoints every step: the disk holds a newer
    step than node memory, and the relaunch resumes from it."""
    extra = ["recover.enabled=true", *HEARTBEAT, *layout(2, 1, 2, 4)]  # 2 replicas of tp=2: B=8
    if state == "checkpoint":
        extra += ["recover.snapshot.interval=0", "checkpoints.checkpoint_interval=2"]
    if state == "newer_checkpoint":
        extra += ["recover.snapshot.interval=4", "checkpoints.checkpoint_interval=1"]
    job = BackgroundJob(tmp_path, cli_args("launch", tmp_path, sets_for(tmp_path, extra)))
    if state == "newer_checkpoint":
        # Killed once step 5 is on disk, before step 8's snapshot: snapshot 4 < checkpoint 5..7.
        saved = lambda: (latest_step(tmp_path / "checkpoints") or 0) >= 5  # noqa: E731
        job.wait_until(saved, "the checkpoint of step 5")
    committed, pids = kill_every_rank(job, after_step=4)
    result = job.finish()

    assert result.returncode == 0, result.output[-4000:]
    outcome = read_outcome(tmp_path)
    assert outcome["status"] == "completed" and outcome["last_step"] == STEPS
    assert_same_curve(read_metrics(tmp_path), plain)
    assert_replicas_identical(tmp_path, [0, 1])
    assert not any(process_exists(p) for p in pids)
    (incident,) = [i for i in read_incidents(tmp_path) if i["kind"] in ("job_lost", "node_lost")]
    assert incident["kind"] == "job_lost" and incident["generation"] == 1 and incident["hosts_lost"] == []
    assert incident["state_from"] == state.removeprefix("newer_")
    restored = incident["restored_step"]
    if state == "newer_checkpoint":
        assert 5 <= restored <= committed and restored < 8, (restored, committed)
    elif state == "snapshot":
        # The kill may land before the newest commit's snapshot is published: one step older at most.
        assert committed - 1 <= restored <= committed
    else:
        # The newest checkpoint (every 2 steps): the kill may land before the last one is written.
        assert restored % 2 == 0 and committed - 3 <= restored <= committed
    assert incident["step"] == restored + 1 and incident["steps_redone"] >= committed - restored
    assert incident["restart_s"] > 0
    assert "relaunching it (generation 1" in result.output
    # Node memory is given back once the run completed.
    assert not list((tmp_path / "node_memory").rglob("*.bin"))


@pytest.mark.mpi
def test_a_replica_lost_while_a_relaunch_restores_is_repaired_not_relaunched_again(tmp_path, plain):
    """Every rank is killed from outside; the relaunched job loses replica 1 (both its ranks,
    SIGKILLed at the restore's start) while it restores from node memory. The survivor is repaired
    in place, like a rank lost at start-up, restores alone and trains to the end: one relaunch, not
    two, and the plain curve."""
    # Whatever step the relaunch starts with (the kill's moment, and whether commit.json already
    # had the last step, decide it), replica 1 dies there; phase start strikes only relaunches.
    faults = [{"step": step, "replica": 1, "phase": "start"} for step in range(1, STEPS + 1)]
    extra = ["recover.enabled=true", *HEARTBEAT, *layout(2, 1, 2, 4), f"recover.faults={json.dumps(faults)}"]
    job = BackgroundJob(tmp_path, cli_args("launch", tmp_path, sets_for(tmp_path, extra)))
    committed, _ = kill_every_rank(job, after_step=3)
    result = job.finish()

    assert result.returncode == 0, result.output[-4000:]
    outcome = read_outcome(tmp_path)
    assert outcome["status"] == "completed" and outcome["last_step"] == STEPS
    assert_same_curve(read_metrics(tmp_path), plain)
    incidents = read_incidents(tmp_path)
    relaunches = [i for i in incidents if i["kind"] in ("job_lost", "node_lost")]
    assert [(i["generation"], i["state_from"]) for i in relaunches] == [(1, "snapshot")], incidents
    assert committed - 1 <= relaunches[0]["restored_step"] <= committed
    (start,) = [i for i in incidents if i.get("phase") == "start"]
    assert start["failed_replicas"] == [1], start
    assert "replicas [1] lost while the job restored its state; going on with 1" in result.output


@pytest.mark.mpi
@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a private tmpfs"
)
def test_a_snapshot_folder_without_room_costs_the_snapshots_not_the_job(tmp_path, plain):
    """``recover.snapshot.dir`` on a tmpfs far too small for a rank's state (a container's 64 MiB
    /dev/shm against a real model): every rank warns once that its snapshot is skipped and the job
    trains every step as the plain run does. Before the slot's pages were reserved, every rank died
    of SIGBUS at step 1."""
    shm = tmp_path / "small_shm"
    shm.mkdir()
    extra = ["recover.enabled=true", *HEARTBEAT, *layout(1, 1, 2, 4), f"recover.snapshot.dir={shm}"]
    launch = [
        sys.executable,
        "-m",
        "nanotron_recover.cli",
        *cli_args("launch", tmp_path, sets_for(tmp_path, extra)),
    ]
    script = f"mount -t tmpfs -o size=64k tmpfs {shm} && exec {shlex.join(launch)}"
    result = run_process(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], timeout=300)

    assert result.returncode == 0, result.output[-4000:]
    assert_same_curve(read_metrics(tmp_path), plain)
    warnings = [line for line in result.output.splitlines() if "warning: node snapshot skipped" in line]
    assert len(warnings) == 2, warnings  # once per rank, not once per step
    assert "MiB free" in warnings[0], warnings


@pytest.mark.mpi
def test_a_job_frozen_whole_is_relaunched_on_the_commit_deadline(tmp_path, plain):
    """Every rank SIGSTOPped from outside after step 4 (a frozen node that holds the whole job, or
    members stuck where no rank-level deadline may end them): no rank is left to notice, mpirun
    waits forever. The supervisor sees no commit within ``recover.commit_timeout_s``, ends the
    job's session (the frozen processes included) and relaunches it from node memory; the run
    completes with the plain curve and one ``stalled`` incident."""
    extra = ["recover.enabled=true", *HEARTBEAT, *layout(1, 1, 2, 4), "recover.commit_timeout_s=12"]
    job = BackgroundJob(tmp_path, cli_args("launch", tmp_path, sets_for(tmp_path, extra)))
    job.wait_until(lambda: job.committed() >= 4, "step 4")
    pids = [r["pid"] for r in json.loads((tmp_path / "ranks.json").read_text())]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    frozen_after = job.committed()
    result = job.finish()

    assert result.returncode == 0, result.output[-4000:]
    assert "the job stalled, no step committed for" in result.output, result.output[-4000:]
    assert_same_curve(read_metrics(tmp_path), plain)
    assert_replicas_identical(tmp_path, [0, 1])
    assert not any(process_exists(p) for p in pids)  # the frozen processes were ended
    stalled = [i for i in read_incidents(tmp_path) if i["kind"] == "stalled"]
    assert len(stalled) == 1, read_incidents(tmp_path)
    (incident,) = stalled
    assert incident["generation"] == 1 and incident["state_from"] == "snapshot"
    # A step in flight when the last rank stopped may still commit (its record written a moment
    # after the test read the file): one step either side of what the test saw.
    assert frozen_after - 1 <= incident["restored_step"] <= frozen_after + 1, incident


def test_a_job_that_commits_nothing_after_a_process_went_silent_is_relaunched_on_the_repair_bound(tmp_path):
    """A rank goes silent (here a frozen process whose heartbeat file stopped) and the job, stuck
    as a survivor stuck in an Allreduce that no failure notice reached, commits nothing more. The
    supervisor's heartbeat-file watch removes the process; from then on the job has two heartbeat
    timeouts and ten typical steps to commit (the repair bound), not the 60 s fixed bound here."""
    body = (
        "import os, socket, subprocess, time\n"
        "if n == 1:\n"
        "    frozen = subprocess.Popen(['sleep', '600'])\n"
        "    host = socket.gethostname()\n"
        "    (run_dir / 'heartbeats').mkdir(exist_ok=True)\n"
        "    (run_dir / 'heartbeats' / f'{host}.{frozen.pid}.rank').write_text('')\n"
        "    table = [{'rank': 0, 'host': host, 'pid': os.getpid(), 'replica': 0},\n"
        "             {'rank': 1, 'host': host, 'pid': frozen.pid, 'replica': 1}]\n"
        "    (run_dir / 'ranks.json').write_text(json.dumps(table))\n"
        "    commit(1); commit(2)\n"
        "    time.sleep(600)\n"  # stuck: commits nothing more
        "else:\n    commit(3)\n"
        "    write_outcome(run_dir, status='completed', last_step=3, target_step=3, exit_code=0)\n"
    )
    args = ["--run-dir", str(tmp_path / "run"), "--grace-s", "1", "--relaunches", "2"]
    args += ["--heartbeat-period-s", "0.2", "--heartbeat-timeout-s", "1", "--commit-timeout-s", "60"]
    result = run_process([*SUPERVISE, *args, "--", *fake_job(tmp_path, body)], timeout=120)
    assert result.returncode == 0, result.stderr
    relaunch = read_relaunch(tmp_path / "run")
    assert relaunch is not None and relaunch.cause == "stalled" and relaunch.last_committed == 2
    m = re.search(
        r"the job stalled, no step committed for \d+ s after step 2 \(bound (\d+) s: a process went silent",
        result.stderr,
    )
    assert m, result.stderr
    # silence found (timeout + 3 periods, one more timeout for a node-mate) + 2 timeouts of repair
    assert int(m.group(1)) < 10, result.stderr
