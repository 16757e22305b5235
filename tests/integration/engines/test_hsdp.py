"""The HSDP engine (FSDP2 inside a replica) in the real trainer, plain and under faults.

``parallelism.dp_shard = 2`` makes each data-parallel replica two ranks that shard the model with
FSDP2; across replicas the gradient shards are summed exactly as the 3D engine's buffers are (plain
all-reduce, or forward recovery over ULFM). So an HSDP run must give the loss curve of one process,
and of the 3D engine, step by step; its faulty runs must equal its plain run; and its checkpoints
must resume on 3D layouts and back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_recover.checkpoint import CheckpointReader
from nanotron_recover.logging import read_incidents, read_metrics
from tests.helpers.curves import assert_replicas_identical, assert_same_curve
from tests.helpers.mpirun_utils import REPO, check, layout, run_cli

pytestmark = pytest.mark.mpi

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 8


def hsdp(shard: int, dp: int, g: int) -> list[str]:
    return [*layout(1, 1, dp, g), f"parallelism.dp_shard={shard}"]


def train(
    run_dir: Path, sets: list[str], nproc: int, steps: int = STEPS, stop_after: int | None = None
) -> None:
    args = ["train", "--config", CONFIG, "--run-dir", str(run_dir)]
    if stop_after is not None:
        args += ["--stop-after-step", str(stop_after)]  # saves that step, keeps the run's schedule
    common = [
        f"tokens.train_steps={steps}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        "checkpoints.save_final_state=false",
        "recover.heartbeat_period_s=1",
        "recover.heartbeat_timeout_s=5",
    ]
    for s in common + sets:
        args += ["--set", s]
    check(run_cli(args, nproc=nproc, timeout=300))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("one")
    train(run_dir, layout(1, 1, 1, 8), 1)
    return read_metrics(run_dir)


def test_hsdp_2x2_is_the_curve_of_one_process(tmp_path, one_process):
    """(The 3D engine's layouts give the same curve: tests/integration/test_trainer.py.)"""
    train(tmp_path, hsdp(2, 2, 4), 4)
    assert_same_curve(read_metrics(tmp_path), one_process, grad_norm_rel=1e-4)
    assert_replicas_identical(tmp_path, [0, 1])


# The phases are the transaction's, the same for both engines (tests/integration/data_parallel/forward/test_transaction.py covers each);
# these check that HSDP's buffers and groups go through them: a compute fault, one after the commit.
FAULTS = {
    "optimizer+forward": [
        {"step": 2, "replica": 0, "phase": "optimizer"},
        {"step": 3, "replica": 1, "phase": "forward", "microbatch": 1},
    ],
    # One rank of a replica (shard rank 1 of replica 1 computes micro-batches 1, 3, ... of its list):
    # its shard peer learns it and leaves, the replica is lost as a whole.
    "one_rank": [{"step": 5, "rank": 3, "phase": "backward", "microbatch": 1}],
}


@pytest.mark.parametrize("case", list(FAULTS))
def test_hsdp_under_faults_equals_its_plain_run(tmp_path, one_process, case):
    faults = FAULTS[case]
    sets = hsdp(2, 4, 2) + ["recover.enabled=true", f"recover.faults={json.dumps(faults)}"]
    train(tmp_path, sets, 8)
    assert_same_curve(read_metrics(tmp_path), one_process, grad_norm_rel=1e-4)
    lost = {f["replica"] if "replica" in f else f["rank"] // 2 for f in faults}
    assert_replicas_identical(tmp_path, sorted(set(range(4)) - lost))
    assert {r for i in read_incidents(tmp_path) for r in i["failed_replicas"]} == lost


def test_hsdp_spare_is_promoted(tmp_path):
    """4 replicas with G=1 (B=4): after replica 3 is lost, W=3 gives G=2, two Majors and a Spare that
    shadows Major 0; killing replica 0 promotes the Spare, and nothing is recomputed."""
    faults = [{"step": 2, "replica": 3, "phase": "forward"}, {"step": 4, "replica": 0, "phase": "backward"}]
    train(tmp_path / "plain", layout(1, 1, 1, 4), 1, steps=6)
    train(
        tmp_path / "ft",
        hsdp(2, 4, 1) + ["recover.enabled=true", f"recover.faults={json.dumps(faults)}"],
        8,
        6,
    )
    assert_same_curve(read_metrics(tmp_path / "ft"), read_metrics(tmp_path / "plain"), grad_norm_rel=1e-4)
    promoted = [i for i in read_incidents(tmp_path / "ft") if i["step"] == 4]
    assert [i["action"] for i in promoted] == ["promote_spare"] and promoted[0]["extra_microbatches"] == 0


def test_hsdp_checkpoint_resumes_on_3d_and_back(tmp_path, one_process):
    """Stop an HSDP run after step 4, resume it on tp=2 (3D) and stop after 6, resume with HSDP: the
    curve is the one-process curve throughout."""
    ck = tmp_path / "ck"
    where = [f"checkpoints.checkpoints_path={ck}"]
    train(tmp_path / "a", hsdp(2, 2, 4) + where, 4, stop_after=4)
    assert CheckpointReader(ck).step == 4
    train(tmp_path / "b", layout(2, 1, 1, 8) + where, 2, stop_after=6)
    assert CheckpointReader(ck).step == 6
    train(tmp_path / "c", hsdp(2, 2, 4) + where, 4, steps=STEPS)
    got = read_metrics(tmp_path / "a") + read_metrics(tmp_path / "b") + read_metrics(tmp_path / "c")
    assert_same_curve(got, one_process, grad_norm_rel=1e-4)
