"""nanotron_recover.launcher: the mpirun command line and the supervisor that turns a run's
``outcome.json`` into the exit status.

The supervisor is driven with small fake "mpirun" scripts written into the test's tmp folder: they
write an outcome record (or none), leave processes behind, or wait for a signal. Each runs under
``run_process`` (own session, hard timeout), and every process a test starts is checked by pid to
be gone afterwards. One test runs a real ``nanotron-recover launch`` whose every replica is killed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover import launcher, supervisor
from nanotron_recover.cli import main
from nanotron_recover.config import load_config
from nanotron_recover.errors import ExitCode
from nanotron_recover.outcome import read_outcome, write_outcome
from nanotron_recover.slurm import render_sbatch
from nanotron_recover.supervisor import LOST_WITHOUT_RECORD
from tests.helpers.mpirun_utils import REPO, run_cli, run_process, single_rank_env

TINY = str(REPO / "configs" / "tiny_cpu.yaml")
SUPERVISE = [sys.executable, "-m", "nanotron_recover.supervisor", "supervise"]
HEARTBEAT = ["recover.heartbeat_period_s=0.5", "recover.heartbeat_timeout_s=3"]
# The detector is for forward recovery only (a plain run's MPI_Finalize blocks with it on).
FORWARD = ["recover.enabled=true", *HEARTBEAT]


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its parent does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def fake_mpirun(tmp_path: Path, body: str) -> list[str]:
    """A Python script standing in for mpirun; ``body`` sees ``run_dir`` and ``tmp`` (Paths)."""
    script = tmp_path / "fake_mpirun.py"
    script.write_text(
        "import json, os, signal, subprocess, sys, time\n"
        "from pathlib import Path\n"
        "from nanotron_recover.outcome import write_outcome\n"
        f"run_dir, tmp = Path({str(tmp_path / 'run')!r}), Path({str(tmp_path)!r})\n"
        "Path(tmp, 'fake.pid').write_text(str(os.getpid()))\n" + body
    )
    return [sys.executable, str(script)]


def supervise(tmp_path: Path, cmd: list[str], *args: str, timeout: float = 120):
    run_dir = tmp_path / "run"
    return run_process([*SUPERVISE, "--run-dir", str(run_dir), *args, "--", *cmd], timeout=timeout)


def write_metrics(run_dir: Path, steps: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 1.0, "time": 100.0 + s}) for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


# -- the supervisor -------------------------------------------------------------------------------
LEFTOVER = {
    # A child that ignores SIGTERM: only the SIGKILL after TERM_WAIT_S ends it.
    "ignores_sigterm": "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n",
    # A frozen child, like a SIGSTOPped rank: SIGTERM stays pending, SIGKILL ends it.
    "frozen": "os.kill(os.getpid(), signal.SIGSTOP)\n",
}


@pytest.mark.parametrize("kind", list(LEFTOVER))
def test_leftover_process_after_completion_is_ended_and_the_status_is_0(tmp_path: Path, kind: str):
    child = (
        "import os, signal, sys, time\n"
        f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(os.getpid()))\n"
        + LEFTOVER[kind]
        + "time.sleep(600)\n"
    )
    cmd = fake_mpirun(
        tmp_path,
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "while not Path(tmp, 'child.pid').exists():\n"
        "    time.sleep(0.05)\n"
        "write_outcome(run_dir, status='completed', last_step=4, target_step=4, exit_code=0)\n"
        "child.wait()  # like mpirun waiting for a rank that will never exit\n",
    )
    start = time.monotonic()
    result = supervise(tmp_path, cmd, "--grace-s", "1")
    elapsed = time.monotonic() - start

    assert result.returncode == 0, result.output
    fake_pid = int((tmp_path / "fake.pid").read_text())
    child_pid = int((tmp_path / "child.pid").read_text())
    lines = [x for x in result.stderr.splitlines() if x.startswith("nanotron-recover launch: ")]
    assert len(lines) == 1, result.stderr
    assert "completed (step 4 of 4) but mpirun had not exited 1s later" in lines[0]
    assert f"pid {child_pid} (" in lines[0] and f"pid {fake_pid} (" in lines[0]
    assert elapsed < 60
    deadline = time.monotonic() + 10
    while (alive(child_pid) or alive(fake_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)  # the killed processes are reaped by whoever inherited them
    assert not alive(child_pid) and not alive(fake_pid)


def test_processes_that_outlive_mpirun_are_ended(tmp_path: Path):
    """mpirun exits by itself, but a process of its session stays behind: it is ended too."""
    child = f"import os, time\nopen({str(tmp_path / 'child.pid')!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    cmd = fake_mpirun(
        tmp_path,
        f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "while not Path(tmp, 'child.pid').exists():\n"
        "    time.sleep(0.05)\n"
        "write_outcome(run_dir, status='completed', last_step=4, target_step=4, exit_code=0)\n",
    )
    result = supervise(tmp_path, cmd, "--grace-s", "60")

    assert result.returncode == 0, result.output
    child_pid = int((tmp_path / "child.pid").read_text())
    assert result.stderr.startswith("nanotron-recover launch: mpirun exited (status 0) leaving processes ")
    assert f"ended pid {child_pid} (" in result.stderr and result.stderr.count("\n") == 1
    deadline = time.monotonic() + 10
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child_pid)


def test_exit_0_without_an_outcome_record_is_a_failure(tmp_path: Path):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, 3)
    # A record from an earlier launch must not count for this one.
    write_outcome(run_dir, status="completed", last_step=10, target_step=10, exit_code=0)
    result = supervise(tmp_path, fake_mpirun(tmp_path, "sys.exit(0)\n"), "--target-step", "10")

    assert result.returncode == ExitCode.FAILED, result.output
    assert result.stderr.splitlines() == [
        f"nanotron-recover launch: run ended without completing: {LOST_WITHOUT_RECORD}; "
        "last committed step 3 of 10"
    ]
    outcome = read_outcome(run_dir)  # the supervisor records the lost job
    assert outcome is not None
    assert (outcome["status"], outcome["kind"], outcome["last_step"], outcome["exit_code"]) == (
        "stopped",
        "all_replicas_lost",
        3,
        1,
    )


def test_stopped_outcome_gives_its_exit_code_and_one_line(tmp_path: Path):
    message = "disk full while writing checkpoints/step_4 (errno 28): free space or change checkpoints_path"
    cmd = fake_mpirun(
        tmp_path,
        f"write_outcome(run_dir, status='stopped', last_step=3, target_step=8, exit_code=5, kind='io', "
        f"message={message!r})\n"
        "sys.exit(0)\n",
    )
    result = supervise(tmp_path, cmd)

    assert result.returncode == ExitCode.IO == 5
    assert result.stderr.splitlines() == [f"nanotron-recover launch: {message}"]
    assert result.output.count(message) == 1


def test_mpirun_failing_after_a_completed_run_is_still_success(tmp_path: Path):
    cmd = fake_mpirun(
        tmp_path,
        "write_outcome(run_dir, status='completed', last_step=8, target_step=8, exit_code=0)\nsys.exit(3)\n",
    )
    result = supervise(tmp_path, cmd)

    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "nanotron-recover launch: mpirun exited with status 3, but the run completed (step 8 of 8): exit status 0"
    ]


def test_sigterm_is_forwarded_to_the_command(tmp_path: Path):
    cmd = fake_mpirun(tmp_path, "time.sleep(600)\n")
    proc = subprocess.Popen(
        [*SUPERVISE, "--run-dir", str(tmp_path / "run"), "--", *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=single_rank_env(),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "fake.pid").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the fake mpirun never started"
            time.sleep(0.05)
        time.sleep(0.5)  # let the supervisor's handlers be in place
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    fake_pid = int((tmp_path / "fake.pid").read_text())
    assert proc.returncode == ExitCode.FAILED
    assert "run ended without completing: interrupted by SIGTERM; last committed step 0" in err
    assert not alive(fake_pid)


def test_run_supervised_reports_the_leftovers_it_ended(tmp_path: Path):
    """The library call: the record, mpirun's status (None: ended by the supervisor) and the pids."""
    cmd = fake_mpirun(
        tmp_path,
        "write_outcome(run_dir, status='completed', last_step=2, target_step=2, exit_code=0)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n",
    )
    lines: list[str] = []
    result = supervisor.run_supervised(
        cmd, tmp_path / "run", grace_s=0.5, log=lines.append, term_wait_s=0.5, timeout_s=60
    )
    fake_pid = int((tmp_path / "fake.pid").read_text())
    assert (result.exit_code, result.returncode) == (0, None)
    assert result.outcome["status"] == "completed"
    assert len(result.ended) == 1 and result.ended[0].startswith(f"pid {fake_pid} (python")
    assert len(lines) == 1 and f"pid {fake_pid}" in lines[0]
    assert not alive(fake_pid)


def test_run_supervised_timeout_ends_the_command(tmp_path: Path):
    cmd = fake_mpirun(tmp_path, "time.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        supervisor.run_supervised(cmd, tmp_path / "run", grace_s=1, timeout_s=2, term_wait_s=0.5)
    assert not alive(int((tmp_path / "fake.pid").read_text()))


# -- a real launch --------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize(
    "tp, faults",
    [
        (1, "[{step: 2, replica: 0}, {step: 2, replica: 1}]"),
        # One rank of each replica: their tp peers still run when no replica is left, and may
        # write the record themselves; the record and the status are the same either way.
        (2, "[{step: 2, rank: 0}, {step: 2, rank: 2}]"),
    ],
)
def test_launch_where_every_replica_dies_exits_1_and_says_so(tmp_path: Path, tp: int, faults: str):
    """Every replica SIGKILLed at step 2 and no relaunch allowed: mpirun itself exits 0 under ULFM,
    the launch exits 1 with a record of the lost job (with relaunches,
    tests/integration/test_supervisor.py)."""
    run_dir = tmp_path / "run"
    sets = [
        "tokens.train_steps=4",
        f"parallelism.tp={tp}",
        "recover.enabled=true",
        "recover.max_restarts=0",
        f"recover.faults={faults}",
    ]
    args = ["launch", "--config", TINY, "--run-dir", str(run_dir)]
    result = run_cli(args + [a for s in sets for a in ("--set", s)], timeout=300)

    assert result.returncode == ExitCode.FAILED, result.output[-3000:]
    outcome = read_outcome(run_dir)
    assert outcome is not None, result.output[-3000:]
    assert (outcome["status"], outcome["kind"], outcome["last_step"], outcome["exit_code"]) == (
        "stopped",
        "all_replicas_lost",
        1,
        1,
    ), result.output[-3000:]
    assert outcome["message"] in result.stderr
    assert "every replica lost" in outcome["message"]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").glob("step_*"))
    assert "--mca mpi_ft_detector true" in result.stdout


@pytest.mark.mpi
def test_a_lost_job_with_no_relaunch_left_gives_its_node_memory_back(tmp_path: Path):
    """Every replica SIGKILLed at step 3, after two steps snapshotted in node memory, and no
    relaunch allowed: the ranks died without removing their snapshots, and no job will start from
    them. ``launch`` removes them on its host once the supervisor is done, and says how much."""
    run_dir, shm = tmp_path / "run", tmp_path / "node_memory"
    sets = [
        "tokens.train_steps=4",
        "recover.enabled=true",
        *HEARTBEAT,
        "recover.max_restarts=0",
        "recover.faults=[{step: 3, replica: 0}, {step: 3, replica: 1}]",
        f"recover.snapshot.dir={shm}",
    ]
    args = ["launch", "--config", TINY, "--run-dir", str(run_dir)]
    result = run_cli(args + [a for s in sets for a in ("--set", s)], timeout=300)

    assert result.returncode == ExitCode.FAILED, result.output[-3000:]
    outcome = read_outcome(run_dir)
    assert (outcome["kind"], outcome["last_step"]) == ("all_replicas_lost", 2), outcome
    assert "not relaunching: recover.max_restarts=0" in result.stderr
    # Step 2's optimizer waited for step 1's snapshot: both ranks' slots existed when they died.
    removed = [line for line in result.stderr.splitlines() if "node-memory snapshots of run" in line]
    assert len(removed) == 1 and removed[0].startswith("nanotron-recover launch: "), result.stderr[-3000:]
    assert " removed " in removed[0] and " bytes) of node-memory snapshots of run " in removed[0]
    assert shm.is_dir() and [p for p in shm.rglob("*") if not p.is_dir()] == []


# -- heartbeat flags ------------------------------------------------------------------------------
DETECTOR = (
    "--mca mpi_ft_detector true --mca mpi_ft_detector_thread false "
    "--mca mpi_ft_detector_period 0.5 --mca mpi_ft_detector_timeout 3"
)


def test_launch_puts_the_configs_heartbeat_on_the_mpirun_line(monkeypatch, capsys, tmp_path: Path):
    calls = []

    def fake_supervise(cmd, run_dir, **kwargs):
        calls.append((cmd, run_dir, kwargs))
        return 0

    monkeypatch.setattr(launcher, "run_relaunching", fake_supervise)
    sets = [a for s in FORWARD for a in ("--set", s)]
    assert main(["launch", "--config", TINY, "--run-dir", str(tmp_path / "r"), *sets]) == 0

    printed = capsys.readouterr().out.splitlines()[0]
    ((cmd, run_dir, kwargs),) = calls
    assert printed == " ".join(cmd)
    assert DETECTOR in printed and "--with-ft ulfm" in printed
    assert run_dir == tmp_path / "r"
    assert kwargs["grace_s"] == 2 * 3 + 10 and kwargs["target_step"] == 20
    assert kwargs["relaunches"] == 100  # recover.max_restarts: forward recovery relaunches a lost job


def test_no_heartbeat_without_ulfm():
    """The checkpoint-restart baseline runs plain MPI, which has no such detector."""
    restart = ["recover.enabled=true", "recover.mode=checkpoint_restart", "checkpoints.checkpoint_interval=2"]
    cfg = load_config(TINY, [*restart, *HEARTBEAT])
    cmd = " ".join(launcher.launch_command(cfg, TINY, "r", [], 2))
    assert "--with-ft" not in cmd and "mpi_ft_detector" not in cmd
    plain_cfg = load_config(TINY, HEARTBEAT)
    assert "mpi_ft_detector" not in " ".join(launcher.launch_command(plain_cfg, TINY, "r", [], 2))
    plain = " ".join(launcher.train_command(TINY, "r", [], 2, heartbeat=None))
    assert "--with-ft ulfm" in plain and "mpi_ft_detector" not in plain
    single = launcher.train_command(TINY, "r", [], 1, heartbeat=(1.0, 5.0))
    assert single[1:3] == ["-m", "nanotron_recover.cli"], "one rank needs no mpirun"


def test_sbatch_script_turns_the_heartbeat_on_and_exits_with_the_outcome(tmp_path: Path):
    cfg = load_config(TINY, FORWARD, check_paths=False)
    script = render_sbatch(cfg, TINY, nodes=1, gpus_per_node=0, partition=None, time="10",
                           job_name="t", run_dir="runs/t", overrides=FORWARD)  # fmt: skip
    flat = " ".join(script.replace("\\\n", " ").split())  # bash line continuations joined
    assert DETECTOR in flat
    assert (
        '-m nanotron_recover.supervisor supervise --run-dir "$RUN_DIR" --grace-s 16 --target-step 20'
    ) in flat
    assert "set -eo pipefail" in script and 'exit "$status"' in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)


@pytest.mark.mpi
def test_the_mpirun_line_leaves_the_libfabric_btl_out_and_still_reduces(tmp_path: Path):
    """Open MPI's libfabric BTL (one-sided traffic only, which the project never uses) closes with
    a one-second sleep inside every MPI_Init where libfabric has no provider: the product's mpirun
    line leaves it out, and its ranks still reduce over the BTLs that remain."""
    program = (
        "from mpi4py import MPI\n"
        "import numpy as np\n"
        "out = np.zeros(1)\n"
        "MPI.COMM_WORLD.Allreduce(np.ones(1), out)\n"
        "print('sum', int(out[0]), flush=True)\n"
    )
    cmd = launcher.mpirun_command(2, [sys.executable, "-c", program])
    done = run_process(cmd, timeout=120, env={**single_rank_env(), "OMPI_MCA_btl_base_verbose": "100"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert output.count("sum 2") == 2, output[-3000:]
    assert "found loaded component tcp" in output and "found loaded component sm" in output
    assert "found loaded component ofi" not in output, output[-3000:]
