"""Every fault kind ends in a forward repair or in one clean stop: real ``launch`` jobs on CPU.

Hangs are made the way they happen on a cluster: a rank stops (SIGSTOP) and never answers. Some
freezes are injected at exact points of a step (compute, reduce, agree); others are sent by the test
itself, from outside, at a moment the code does not choose. Kills land during checkpoint saves, a
real tmpfs fills up, one micro-batch raises every time. Each faulty run is compared with the plain
run of the same config (same micro-batch ids, loss within 1e-5 relative), and the launcher's exit
status must tell the truth.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nanotron_recover.checkpoint import CheckpointReader
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome
from tests.helpers.curves import assert_replicas_identical, assert_same_curve
from tests.helpers.mpirun_utils import REPO, BackgroundJob, Completed, check, layout, process_exists, run_cli

pytestmark = pytest.mark.mpi

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 10
# The heartbeat detector as short as 8 ranks on this 2-core machine allow: with a 2 s timeout, 1 in 5
# start-ups of 8 ranks had a rank declared failed inside MPI_Init (where Open MPI 5.0.11 crashed).
HEARTBEAT = ["recover.heartbeat_period_s=1", "recover.heartbeat_timeout_s=5"]
W4 = layout(1, 1, 4, 2)  # 4 replicas, G=2: B=8
W4_TP2 = layout(2, 1, 4, 2)  # 4 replicas of tp=2 (8 ranks)


def sets_for(run_dir: Path, extra: list[str]) -> list[str]:
    common = [
        f"tokens.train_steps={STEPS}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        "checkpoints.save_final_state=false",
        "recover.watchdog_timeout_s=60",
        "recover.gate_timeout_s=30",
    ]
    return common + extra


def cli_args(command: str, run_dir: Path, sets: list[str]) -> list[str]:
    args = [command, "--config", CONFIG, "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return args


def recover(faults: list[dict] | None = None) -> list[str]:
    return ["recover.enabled=true", *HEARTBEAT] + ([f"recover.faults={json.dumps(faults)}"] if faults else [])


def launch(run_dir: Path, extra: list[str], timeout: float = 240) -> Completed:
    return run_cli(cli_args("launch", run_dir, sets_for(run_dir, extra)), timeout=timeout)


class Job(BackgroundJob):
    """A ``launch`` running in the background, so the test can signal its ranks from outside."""

    def __init__(self, run_dir: Path, extra: list[str]):
        super().__init__(run_dir, cli_args("launch", run_dir, sets_for(run_dir, extra)))


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    """The fault-free reference: one process, G=8 (B=8), synthetic data."""
    run_dir = tmp_path_factory.mktemp("plain")
    check(run_cli(cli_args("train", run_dir, sets_for(run_dir, layout(1, 1, 1, 8)))))
    return read_metrics(run_dir)


def assert_curve(run_dir: Path, reference: list[dict], steps: int = STEPS) -> None:
    """The run committed steps 1..steps, each the reference's."""
    assert_same_curve(read_metrics(run_dir), reference[:steps])


def assert_completed(result: Completed, run_dir: Path) -> None:
    assert result.returncode == 0, result.output[-4000:]
    outcome = read_outcome(run_dir)
    assert outcome is not None and outcome["status"] == "completed" and outcome["last_step"] == STEPS


# -- hangs ------------------------------------------------------------------------------------
FREEZES = {
    "compute": [{"step": 4, "replica": 2, "phase": "forward", "microbatch": 1}],
    # Inside the cross-replica reduction, then (a second replica, later) at the commit's agree.
    "reduce+agree": [
        {"step": 4, "replica": 2, "phase": "reduce", "microbatch": 1},
        {"step": 7, "replica": 1, "phase": "agree", "microbatch": 0},
    ],
}


@pytest.mark.parametrize("where", list(FREEZES))
def test_injected_freeze_is_a_hang_repaired_forward(tmp_path, plain, where):
    """A replica freezes (SIGSTOP) at an exact point: the heartbeat detector declares it failed, the
    others go on, nobody healthy kills itself, and the frozen process is removed for good."""
    freezes = [dict(f, kind="freeze") for f in FREEZES[where]]
    result = launch(tmp_path, W4 + recover(freezes))
    assert_completed(result, tmp_path)
    assert_curve(tmp_path, plain)
    frozen = [f["replica"] for f in freezes]  # one rank per replica: rank == replica
    assert_replicas_identical(tmp_path, sorted(set(range(4)) - set(frozen)))
    incidents = read_incidents(tmp_path)
    assert [i["step"] for i in incidents] == [f["step"] for f in freezes]
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    for incident, replica in zip(incidents, frozen, strict=True):
        assert incident["kind"] == "hang" and incident["failed_replicas"] == [replica]
        assert incident["hung_ranks"] == [replica]
        assert incident["detect_method"] == "record" and 0 < incident["detect_s"] < 30
        assert not process_exists(ranks[replica]["pid"])
    assert "hung: open for" not in result.output, "no healthy rank may fire its watchdog for another's hang"


def test_rank_frozen_then_another_killed_from_outside(tmp_path, plain):
    """The test freezes one rank of replica 2 (tp=2) at a moment of its choosing, mid-run; 2 s later,
    while the others wait on it and before the heartbeat timeout (5 s) declares it failed, it
    SIGKILLs a rank of replica 1. The frozen rank's tp peer learns it from the failure watch and
    leaves, replica 1 is lost as a whole, and replicas 0 and 3 go on to the end with the plain curve;
    the frozen process is removed for good. Whether the two losses make one incident or two depends
    on the timing, which the test does not choose."""
    frozen_rank, killed_rank = 5, 2
    job = Job(tmp_path, W4_TP2 + recover())
    frozen, killed = job.pid(frozen_rank), job.pid(killed_rank)
    job.wait_until(lambda: job.committed() >= 3, "step 3")
    os.kill(frozen, signal.SIGSTOP)
    time.sleep(2.0)  # inside the detection window of the freeze
    os.kill(killed, signal.SIGKILL)
    result = job.finish()
    assert_completed(result, tmp_path)
    assert_curve(tmp_path, plain)
    assert_replicas_identical(tmp_path, [0, 3])
    incidents = read_incidents(tmp_path)
    assert {r for i in incidents for r in i["failed_replicas"]} == {1, 2}
    hung = {r for i in incidents for r in i["hung_ranks"]}
    assert frozen_rank in hung and killed_rank not in hung
    assert any(i["kind"] == "hang" for i in incidents)
    assert all(i["detect_s"] is not None and i["detect_method"] == "first_wait" for i in incidents)
    assert not process_exists(frozen) and not process_exists(killed)


def test_rank_frozen_from_outside_while_the_job_starts(tmp_path, plain):
    """The test SIGSTOPs replica 3's rank as soon as the rank table exists (a frozen node or GPU at
    start-up): the heartbeat finds it, the survivors repair it at start-up or in step 1 and train
    the plain curve with three replicas, and the frozen process is reaped, not left holding the
    job."""
    job = Job(tmp_path, W4 + recover())
    victim = job.pid(3)
    os.kill(victim, signal.SIGSTOP)
    result = job.finish()
    assert_completed(result, tmp_path)
    assert "mpirun had not exited" not in result.output
    assert_curve(tmp_path, plain)
    assert_replicas_identical(tmp_path, [0, 1, 2])
    (incident,) = [i for i in read_incidents(tmp_path) if i["failed_replicas"] == [3]]
    assert incident["step"] == 1 and incident["kind"] == "hang" and incident["hung_ranks"] == [3], incident
    assert not process_exists(victim)


def test_rank_killed_from_outside_while_the_job_starts(tmp_path, plain):
    """The test SIGKILLs replica 3's rank as soon as the rank table exists: the job is still
    starting (building the model, opening the data, agreeing that every rank started well). The
    start-up is repaired like any later failure and the three replicas left sum the same B = 8
    micro-batches from step 1 on: the plain curve, not a lost run."""
    job = Job(tmp_path, W4 + recover())
    victim = job.pid(3)
    os.kill(victim, signal.SIGKILL)
    killed_at_step = job.committed()
    result = job.finish()
    assert_completed(result, tmp_path)
    assert_curve(tmp_path, plain)
    assert_replicas_identical(tmp_path, [0, 1, 2])
    assert read_metrics(tmp_path)[-1]["replicas"] == 3
    repaired_at_start = "[3] lost while the job started; going on with 3" in result.output
    # Repaired at start-up or in step 1, the loss is one incident, never a silent narrowing.
    (incident,) = [i for i in read_incidents(tmp_path) if i["failed_replicas"] == [3]]
    assert incident["step"] == 1 and incident["kind"] == "crash", incident
    assert incident["phase"] == "start" if repaired_at_start else incident["phase"] != "start", incident
    assert incident["alive_replicas"] == [0, 1, 2] and incident["detect_s"] >= 0, incident
    assert not process_exists(victim)
    print(f"killed before step {killed_at_step + 1}; repaired at start-up: {repaired_at_start}")


@pytest.mark.parametrize(
    ("tp", "victim", "microbatch", "kind"),
    [(1, 3, 0, "kill"), (1, 0, 1, "kill"), (2, 2, 2, "kill"), (1, 3, 1, "freeze")],
    ids=["before_dup", "rank0_before_splits", "tp2_after_table", "frozen_before_splits"],
)
def test_rank_lost_while_the_first_world_is_built(tmp_path, plain, tp, victim, microbatch, kind):
    """A rank dies or freezes inside the communicator's construction (``phase: start``,
    ``step: 0``): before the launch communicator's ``Dup``, before the splits (rank 0, the logging
    rank; a frozen rank, found by the heartbeat), or after the process table (tp=2: its replica's
    other rank leaves, from inside the construction). The survivors repair it there: one incident of
    the start, the three replicas left sum the same B = 8 micro-batches from step 1 on, a frozen
    process is reaped by its node-mates (known from /proc when no table was gathered) and the rank
    table names no unknown process."""
    lost = victim // tp
    alive = [r for r in range(4) if r != lost]
    fault = {"step": 0, "phase": "start", "rank": victim, "microbatch": microbatch, "kind": kind}
    result = launch(tmp_path, (W4 if tp == 1 else W4_TP2) + recover([fault]))
    assert_completed(result, tmp_path)
    assert "mpirun had not exited" not in result.output  # nothing left behind holds the job
    assert_curve(tmp_path, plain)
    assert_replicas_identical(tmp_path, alive)
    assert f"replicas [{lost}] lost while the job started; going on with 3" in result.output
    if tp == 2:
        # Said by the leaving rank from inside the construction (not by a later start-up repair).
        assert "its replica lost a process while the job started (epoch 0 -> 1)" in result.output
    (incident,) = read_incidents(tmp_path)
    assert incident["failed_replicas"] == [lost] and incident["failed_ranks"] == [victim], incident
    assert incident["step"] == 1 and incident["phase"] == "start", incident
    assert incident["kind"] == ("hang" if kind == "freeze" else "crash"), incident
    assert incident["hung_ranks"] == ([victim] if kind == "freeze" else []), incident
    assert incident["alive_replicas"] == alive, incident
    # The table names the lost process where it was known: gathered before the fault, or (frozen:
    # still there when the survivors looked in /proc) a node-mate. A killed one before the table is
    # left out, never named with pid 0; one named is gone now.
    table = {r["rank"]: r for r in json.loads((tmp_path / "ranks.json").read_text())}
    known = kind == "freeze" or microbatch == 2
    assert set(table) == set(range(4 * tp)) - ({victim} if not known else set()), table
    assert all(r["pid"] > 0 for r in table.values()), table
    assert not known or not process_exists(table[victim]["pid"])


# -- faults during checkpoint saves ---------------------------------------------------------------
def assert_latest_checkpoint_sound(run_dir: Path, step: int) -> None:
    ckpts = run_dir / "checkpoints"
    reader = CheckpointReader(ckpts)
    reader.verify()
    assert reader.step == step
    assert not list(ckpts.glob("*.tmp")), "a torn save was left behind"


def test_writer_rank_killed_during_a_save(tmp_path, plain):
    """Rank 1 (replica 0, the checkpoint writer, tp 1) dies while saving step 4: that save is
    abandoned, training goes on, and replica 1 writes the next checkpoints."""
    fault = {"step": 4, "rank": 1, "phase": "save"}
    result = launch(tmp_path, W4_TP2 + recover([fault]) + ["checkpoints.checkpoint_interval=2"])
    assert_completed(result, tmp_path)
    assert_curve(tmp_path, plain)
    assert_replicas_identical(tmp_path, [1, 2, 3])
    assert_latest_checkpoint_sound(tmp_path, STEPS)
    (incident,) = read_incidents(tmp_path)
    assert incident["failed_replicas"] == [0] and incident["phase"] == "save"


def test_writer_rank_killed_from_outside_while_saving(tmp_path, plain):
    """The test kills rank 1 the moment a save's folder appears; whatever the save was doing, the
    run completes and the latest checkpoint is complete and loadable."""
    job = Job(tmp_path, W4_TP2 + recover() + ["checkpoints.checkpoint_interval=1"])
    pid = job.pid(1)
    ckpts = tmp_path / "checkpoints"
    job.wait_until(lambda: job.committed() >= 2 and any(ckpts.glob("step_*.tmp")), "a save in progress")
    os.kill(pid, signal.SIGKILL)
    result = job.finish()
    assert_completed(result, tmp_path)
    assert_curve(tmp_path, plain)
    assert_replicas_identical(tmp_path, [1, 2, 3])
    assert_latest_checkpoint_sound(tmp_path, STEPS)


# -- a full disk ------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 2.5 MB tmpfs: one checkpoint of the tiny model (about 1.8 MB) fits, a second does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("mode", ["recover", "plain"])
def test_full_disk_stops_once_and_keeps_the_previous_checkpoint(tmp_path, plain, small_disk, mode):
    run_dir = tmp_path / "run"
    extra = (W4 + recover()) if mode == "recover" else layout(1, 1, 2, 4)
    extra += [f"checkpoints.checkpoints_path={small_disk}", "checkpoints.checkpoint_interval=2"]
    result = launch(run_dir, extra)
    assert result.returncode == 5, result.output[-4000:]
    assert result.output.count("No space left on device") == 1, result.output[-4000:]
    assert "Traceback" not in result.output
    outcome = read_outcome(run_dir)
    assert outcome["status"] == "stopped" and outcome["kind"] == "io"
    reader = CheckpointReader(small_disk)
    reader.verify()
    assert reader.step == 2
    assert not list(small_disk.glob("*.tmp"))
    # The intact checkpoint resumes and the curve continues as if nothing had happened.
    resumed = tmp_path / "resumed"
    more = [
        f"checkpoints.resume_checkpoint_path={small_disk}",
        f"checkpoints.checkpoints_path={resumed / 'ck'}",
    ]
    check(run_cli(cli_args("train", resumed, sets_for(resumed, layout(1, 1, 1, 8)) + more)))
    for g, w in zip(read_metrics(resumed), plain[2:], strict=True):
        assert g["step"] == w["step"] and g["loss"] == pytest.approx(w["loss"], rel=1e-5)


# -- exceptions in compute -----------------------------------------------------------------------------
def test_deterministic_error_stops_once_naming_the_microbatch(tmp_path, plain):
    """Micro-batch 17 (step 3) raises in every replica that computes it: the first replica is lost
    (it could have been a flaky GPU), the second one proves it deterministic, the job stops."""
    fault = {"step": 3, "kind": "error", "id": 17, "persistent": True}
    result = launch(tmp_path, W4 + recover([fault]))
    assert result.returncode == 4, result.output[-4000:]
    stops = [ln for ln in result.output.splitlines() if "deterministic error" in ln]
    assert len(stops) == 1 and "micro-batch [17]" in stops[0], stops
    outcome = read_outcome(tmp_path)
    assert outcome["kind"] == "deterministic" and outcome["last_step"] == 2
    lost = {r for i in read_incidents(tmp_path) for r in i["failed_replicas"]}
    assert len(lost) <= 2, "not a cascade: at most the two replicas that met the error"
    assert_curve(tmp_path, plain, steps=2)


def test_transient_error_is_repaired_forward(tmp_path, plain):
    fault = {"step": 3, "kind": "error", "id": 17}
    result = launch(tmp_path, W4 + recover([fault]))
    assert_completed(result, tmp_path)
    assert_curve(tmp_path, plain)
    (incident,) = read_incidents(tmp_path)
    assert incident["kind"] == "error" and incident["step"] == 3


# -- bad input found after start-up ------------------------------------------------------------------
def test_damaged_inputs_are_one_line_printed_once(tmp_path, local_dataset):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in local_dataset.corpus_dir.iterdir():
        (corpus / f.name).write_bytes(f.read_bytes())
    tokens = sorted(corpus.glob("*.ds"))[0]  # a Nanoset file cut short, as by a failed copy
    with tokens.open("r+b") as f:
        f.truncate(tokens.stat().st_size // 2 + 1)
    data = [f"data_stages.0.data.dataset={{dataset_folder: {corpus}}}"]
    # Two replicas are enough to show that every rank finds the error and one line is printed.
    w2 = layout(1, 1, 2, 2)
    result = launch(tmp_path / "a", w2 + recover() + data)
    assert result.returncode == 2, result.output[-3000:]
    lines = [ln for ln in result.output.splitlines() if tokens.name in ln]
    assert len(lines) == 1, result.output[-3000:]
    assert "Traceback" not in result.output

    bad_ckpt = tmp_path / "ckpt" / "step_1"
    bad_ckpt.mkdir(parents=True)
    (bad_ckpt / "meta.json").write_text("{ not json")
    result = launch(tmp_path / "b", w2 + recover() + [f"checkpoints.resume_checkpoint_path={bad_ckpt}"])
    assert result.returncode == 2, result.output[-3000:]
    assert len([ln for ln in result.output.splitlines() if "meta.json" in ln]) == 1, result.output[-3000:]
    assert "Traceback" not in result.output
