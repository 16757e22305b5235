"""The Slurm job script's end (``templates/nanotron_recover.sbatch.in``, rendered by ``slurm.py``):
whatever way the script ends (the training's end, ``scancel --batch --signal=TERM``, the signal
Slurm sends before the time limit), it stops the training, removes the run's node-memory snapshots
on this node and on every other node of the allocation (one bounded ``srun`` step each), and exits
with the training's status.

The rendered script runs for real under bash with fakes on ``PATH``: the interpreter (standing in
for the supervisor and for ``nanotron-recover snapshots clean``), ``srun`` and ``scontrol``, each
recording how it was called. No Slurm, no MPI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nanotron_recover import slurm as slurm_module
from nanotron_recover.config import load_config
from nanotron_recover.slurm import render_sbatch, time_limit_s

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny_cpu.yaml"
FORWARD = ["recover.enabled=true"]

FAKE_PYTHON = r"""#!/bin/bash
# The job's interpreter: the supervisor, and `nanotron-recover snapshots clean` on this node.
if [[ $1 == -m && $2 == nanotron_recover.supervisor ]]; then
    echo "supervisor started" >>"$FAKE_LOG"
    terms=0
    on_term() {
        terms=$((terms + 1))
        echo "supervisor got TERM $terms" >>"$FAKE_LOG"
        if ((terms >= ${FAKE_TERMS_TO_STOP:-1})); then exit "${FAKE_STATUS_AFTER_TERM:-1}"; fi
    }
    trap on_term TERM
    if [[ -n ${FAKE_STARTED:-} ]]; then  # trains until it is stopped
        touch "$FAKE_STARTED"
        while :; do sleep 0.05; done
    fi
    exit "${FAKE_STATUS:-0}"
fi
if [[ $1 == -m && $2 == nanotron_recover.cli ]]; then
    shift 2
    echo "local $*" >>"$FAKE_LOG"
    exit 0
fi
echo "unexpected python $*" >>"$FAKE_LOG"
exit 99
"""

FAKE_SRUN = r"""#!/bin/bash
echo "srun $*" >>"$FAKE_LOG"
for arg in "$@"; do
    if [[ $arg == "--nodelist=${FAKE_DEAD_NODE:-}" ]]; then exec sleep 300; fi  # never answers
done
"""

FAKE_SCONTROL = r"""#!/bin/bash
if [[ $1 == show && $2 == hostnames && $3 == "n[1-3]" ]]; then printf '%s\n' n1 n2 n3; fi
"""


def render(run_dir: Path, sets: list[str] = FORWARD, **kwargs) -> str:
    cfg = load_config(REPO / CONFIG, sets, check_paths=False)
    args = dict(nodes=2, gpus_per_node=0, partition=None, time="24:00:00", job_name=None)
    args.update(kwargs)
    return render_sbatch(cfg, CONFIG, run_dir=str(run_dir), overrides=sets, **args)


class Job:
    """The rendered script started under bash, in a folder of fakes."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slurm: bool = True, **fake: str):
        self.tmp, self.run_dir, self.log = tmp_path, tmp_path / "run", tmp_path / "calls.log"
        monkeypatch.setattr(slurm_module, "CLEANUP_TIMEOUT_S", 2)
        monkeypatch.setattr(slurm_module, "STOP_WAIT_S", 1)
        self.script = tmp_path / "job.sbatch"
        self.script.write_text(render(self.run_dir))
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, text in (("python", FAKE_PYTHON), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        self.python = str(bin_dir / "python")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "NANOTRON_RECOVER"))}
        env.update(
            PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(self.log), NANOTRON_RECOVER_PYTHON=self.python
        )
        env.update(NANOTRON_RECOVER_MPIRUN="mpirun-not-run", **fake)
        if slurm:
            env.update(
                SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n[1-3]", SLURM_JOB_NUM_NODES="3", SLURMD_NODENAME="n1"
            )
        self.proc = subprocess.Popen(
            ["bash", str(self.script)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait_started(self, started: Path) -> None:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "the supervisor never started"
            time.sleep(0.02)

    def finish(self) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        return self.proc.returncode, out, err

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines()

    def clean_args(self) -> str:
        return f"snapshots clean --config {CONFIG} --run-dir {self.run_dir} --set recover.enabled=true"

    def cleanups(self) -> list[str]:
        """The cleanup calls, in order: this node's, then one step per other node."""
        return [c for c in self.calls() if c.startswith(("local ", "srun "))]

    def expected_cleanups(self, nodes: tuple[str, ...] = ("n2", "n3")) -> list[str]:
        step = f"{self.python} -m nanotron_recover.cli {self.clean_args()}"
        return [f"local {self.clean_args()}"] + [
            f"srun --overlap --nodes=1 --ntasks=1 --nodelist={n} {step}" for n in nodes
        ]


def test_the_script_ends_by_cleaning_every_node_and_keeps_the_trainings_status(tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, FAKE_STATUS="3")  # the run stopped: too few replicas

    code, out, err = job.finish()

    assert code == 3, (out, err)
    assert job.calls()[0] == "supervisor started"
    # This node without a step; the others (n1 is this one) with one step each.
    assert sorted(job.cleanups()) == sorted(job.expected_cleanups()), job.calls()
    assert job.cleanups()[0].startswith("local ")
    assert "job 77 finished" in out and "exit status 3" in out
    assert "exit status 3" in (job.run_dir / "logs" / "job-77" / "command.txt").read_text()


def test_outside_slurm_only_this_host_is_cleaned(tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, slurm=False)

    code, out, err = job.finish()

    assert code == 0, (out, err)
    assert job.cleanups() == job.expected_cleanups(nodes=())


def test_a_sigterm_to_the_script_stops_the_training_then_cleans_every_node(tmp_path, monkeypatch):
    """What Slurm sends before the time limit (``--signal=B:TERM@...``) and ``scancel --batch
    --signal=TERM``: the script alone gets it. It stops the supervisor (which ends mpirun), then
    cleans while the job may still start steps, and exits with the supervisor's status."""
    started = tmp_path / "started"
    job = Job(tmp_path, monkeypatch, FAKE_STARTED=str(started), FAKE_STATUS_AFTER_TERM="1")
    job.wait_started(started)

    os.kill(job.proc.pid, signal.SIGTERM)  # the batch shell only
    code, out, err = job.finish()

    assert code == 1, (out, err)
    assert "job 77: SIGTERM at " in err and "stopping the training" in err
    calls = job.calls()
    assert calls.index("supervisor got TERM 1") < min(calls.index(c) for c in job.cleanups())
    assert sorted(job.cleanups()) == sorted(job.expected_cleanups())
    assert "exit status 1" in out


def test_a_supervisor_that_does_not_stop_is_asked_again_and_a_dead_node_holds_nothing_up(
    tmp_path, monkeypatch
):
    """The supervisor stops only at its second SIGTERM (its rule: the second one SIGKILLs the
    job's session), which the script sends after STOP_WAIT_S; then node n3 never answers its
    cleanup step, which its timeout ends: the script still ends, with the training's status."""
    started = tmp_path / "started"
    job = Job(
        tmp_path,
        monkeypatch,
        FAKE_STARTED=str(started),
        FAKE_TERMS_TO_STOP="2",
        FAKE_STATUS_AFTER_TERM="137",
        FAKE_DEAD_NODE="n3",
    )
    job.wait_started(started)
    start = time.monotonic()

    os.kill(job.proc.pid, signal.SIGTERM)
    code, out, err = job.finish()

    assert code == 137, (out, err)
    assert "supervisor got TERM 2" in job.calls()
    assert sorted(job.cleanups()) == sorted(job.expected_cleanups())
    assert "a snapshot cleanup step failed (status 124)" in err
    assert time.monotonic() - start < 30


def test_the_script_asks_for_a_signal_before_the_time_limit_and_traps_it(tmp_path):
    script = render(tmp_path)
    lines = script.splitlines()
    assert "#SBATCH --signal=B:TERM@120" in lines
    for line in ("trap 'stop_training TERM' TERM", "trap 'stop_training INT' INT", "trap finish EXIT"):
        assert line in lines, line
    assert "CLEAN_SNAPSHOTS=1" in lines
    assert "timeout -k 5 60 srun --overlap --nodes=1 --ntasks=1" in script
    # A limit too short for the lead gets no signal; one the user asked for replaces ours.
    assert "--signal" not in render(tmp_path, time="5").split("set -eo")[0]
    own = render(tmp_path, extra_sbatch=["--signal=B:USR1@300"])
    assert "#SBATCH --signal=B:USR1@300" in own and "#SBATCH --signal=B:TERM@120" not in own
    # Without forward recovery there are no snapshots to clean.
    assert "CLEAN_SNAPSHOTS=0" in render(tmp_path, sets=[]).splitlines()


@pytest.mark.parametrize(
    "time, seconds",
    [
        ("10", 600),
        ("10:30", 630),
        ("1:00:00", 3600),
        ("2-00:00:00", 172800),
        ("1-2", 93600),
        ("1-2:30", 95400),
    ],
)
def test_time_limits_in_seconds(time, seconds):
    assert time_limit_s(time) == seconds
    assert time_limit_s("UNLIMITED") is None
