"""Forward recovery end to end: real mpirun jobs on CPU whose ranks really SIGKILL themselves.

Every faulty run is compared with the plain (fault-free) run of the same config: each step must
consume the same micro-batch ids (``ids_digest``), have the same loss (1e-5 relative), and the
surviving replicas must end with bitwise identical parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotron_recover.checkpoint import CheckpointReader
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome
from tests.helpers.curves import assert_replicas_identical, assert_same_curve
from tests.helpers.mpirun_utils import REPO, check, layout, run_cli

pytestmark = pytest.mark.mpi

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 12


def run(run_dir: Path, corpus: Path, sets: list[str], nproc: int, expect_ok: bool = True):
    args = ["train", "--config", CONFIG, "--run-dir", str(run_dir)]
    common = [
        f"tokens.train_steps={STEPS}",
        f"data_stages.0.data.dataset={{dataset_folder: {corpus}}}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        "checkpoints.save_final_state=false",
        "recover.watchdog_timeout_s=120",
        "recover.gate_timeout_s=30",
        # Every fault here is a crash, which the runtime reports at once; the heartbeat only finds
        # frozen ranks. With its 5 s default, 8 ranks starting together on 2 cores had one declared
        # dead by mistake (a start-up failure is repaired, but it changes the fault schedule these
        # tests check).
        "recover.heartbeat_timeout_s=15",
    ]
    for s in common + sets:
        args += ["--set", s]
    result = run_cli(args, nproc=nproc, timeout=300)
    if expect_ok:
        check(result)
    return result


def recover(faults: list[dict], **extra) -> list[str]:
    sets = ["recover.enabled=true", f"recover.faults={json.dumps(faults)}"]
    return sets + [f"recover.{k}={v}" for k, v in extra.items()]


def assert_equivalent(run_dir: Path, reference: list[dict], survivors: list[int]) -> list[dict]:
    got = read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_same_curve(got, reference)
    assert_replicas_identical(run_dir, survivors)
    return got


# -- W_init = 4 replicas of tp=2 (8 ranks), G=2: B=8 -------------------------------------------
W4_TP2 = layout(2, 1, 4, 2)

# Every phase of the step, three runs of two faults each (each run keeps two survivors to compare).
PHASE_FAULTS = {
    # A compute fault, then one rank of a replica dies at the gate: its tp partner learns it at the
    # gate barrier.
    "forward+gate": [
        {"step": 3, "replica": 1, "phase": "forward", "microbatch": 1},
        {"step": 5, "rank": 5, "phase": "gate"},
    ],
    # After the commit: the step stands; the next step discovers the dead replica in its reduction
    # and redistributes that replica's ids of the new step. Then one dies inside the reduction.
    "optimizer+reduce": [
        {"step": 2, "replica": 0, "phase": "optimizer"},
        {"step": 6, "replica": 3, "phase": "reduce", "microbatch": 1},
    ],
    # A second replica dies while the survivors recompute the first one's micro-batches.
    "recovery": [
        {"step": 7, "replica": 1, "phase": "forward"},
        {"step": 7, "replica": 2, "phase": "recovery"},
    ],
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory, local_dataset) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("plain")
    run(run_dir, local_dataset.corpus_dir, layout(1, 1, 1, 8), 1)
    return read_metrics(run_dir)


def failed_replicas(faults: list[dict]) -> set[int]:
    return {f["replica"] if "replica" in f else f["rank"] // 2 for f in faults}


@pytest.mark.parametrize("phases", list(PHASE_FAULTS))
def test_replicas_lost_in_every_phase(tmp_path, local_dataset, plain, phases):
    """The backward pass: the next test."""
    faults = PHASE_FAULTS[phases]
    run(tmp_path, local_dataset.corpus_dir, W4_TP2 + recover(faults), 8)
    lost = failed_replicas(faults)
    got = assert_equivalent(tmp_path, plain, survivors=sorted(set(range(4)) - lost))
    incidents = read_incidents(tmp_path)
    assert sorted(r for i in incidents for r in i["failed_replicas"]) == sorted(lost)
    assert {i["phase"] for i in incidents} == {f["phase"] for f in faults}
    assert got[-1]["replicas"] == 4 - len(lost)
    assert got[-1]["world_epoch"] == len(incidents)
    for inc in incidents:
        assert inc["action"] == "policy_boundary"
        assert inc["extra_microbatches"] == len(inc["lost_ids"]) > 0
        assert inc["detect_s"] is not None and inc["detect_s"] >= 0
        assert inc["recover_s"] >= 0


def test_two_replicas_lost_in_one_step_of_a_1f1b_pipeline(tmp_path, local_dataset, plain):
    """W_init=4 replicas of pp=2 (8 ranks) with 1F1B: two replicas die in the same step, one in its
    backward pass, the other in its forward pass."""
    faults = [
        {"step": 4, "replica": 0, "phase": "backward", "microbatch": 1},
        {"step": 4, "replica": 2, "phase": "forward", "microbatch": 0},
    ]
    run(tmp_path, local_dataset.corpus_dir, layout(1, 2, 4, 2, "1f1b") + recover(faults), 8)
    got = assert_equivalent(tmp_path, plain, survivors=[1, 3])
    incidents = read_incidents(tmp_path)
    assert {r for i in incidents for r in i["failed_replicas"]} == {0, 2}
    assert sum(len(i["lost_ids"]) for i in incidents) == 4, "two replicas of G=2 each"
    step4 = next(r for r in got if r["step"] == 4)
    assert step4["g_ext"] >= 1
    assert got[-1]["g_cur"] == 4, "B=8 over 2 survivors"


@pytest.mark.parametrize("spares", ["shadow", "zero"])
def test_spare_promotion_costs_no_extra_microbatch(tmp_path, local_dataset, plain, spares):
    """W_init=8 replicas with G=1 (B=8). Once 3 are lost, W=5 gives G=2: 4 Majors and 1 Spare that
    computes the first Major's (replica 0's) ids. Killing replica 0 then promotes a shadow Spare:
    nothing is recomputed. A zero Spare (the paper's) did the same work but cannot stand in: the
    survivors recompute replica 0's two ids. Either way the curve is the plain one."""
    faults = [
        {"step": 2, "replica": 5, "phase": "forward"},
        {"step": 2, "replica": 6, "phase": "forward"},
        {"step": 2, "replica": 7, "phase": "forward"},
        {"step": 4, "replica": 0, "phase": "backward"},
    ]
    run(tmp_path, local_dataset.corpus_dir, layout(1, 1, 8, 1) + recover(faults, spares=spares), 8)
    assert_equivalent(tmp_path, plain, survivors=[1, 2, 3, 4])
    incidents = read_incidents(tmp_path)
    (promoted,) = [i for i in incidents if i["step"] == 4]
    step4 = next(r for r in read_metrics(tmp_path) if r["step"] == 4)
    if spares == "shadow":
        assert promoted["action"] == "promote_spare"
        assert promoted["extra_microbatches"] == 0 and step4["g_ext"] == 0
    else:
        assert promoted["action"] == "policy_boundary"
        assert promoted["extra_microbatches"] == 2 and step4["g_ext"] == 1


def test_adaptive_world_drops_the_lost_microbatches_and_drifts(tmp_path, local_dataset, plain):
    """The ablation's adaptive world (what elastic trainers do): a replica killed in step 4 loses
    its two ids for that step, later steps sum only the survivors' 6 of 8 ids and divide by that,
    so the curve leaves the plain one, while the survivors stay bitwise identical."""
    faults = [{"step": 4, "replica": 1, "phase": "forward", "microbatch": 1}]
    run(tmp_path, local_dataset.corpus_dir, layout(1, 1, 4, 2) + recover(faults, policy="adaptive_world"), 4)
    got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_same_curve(got[:3], plain[:3])
    (incident,) = read_incidents(tmp_path)
    assert incident["action"] == "drop" and incident["lost_ids"] == [26, 27]
    assert incident["extra_microbatches"] == 0
    assert all(r["ids_digest"] != w["ids_digest"] for r, w in zip(got[3:], plain[3:], strict=True))
    assert all(r["g_ext"] == 0 and r["g_cur"] == 2 for r in got)
    assert max(abs(r["loss"] - w["loss"]) for r, w in zip(got[3:], plain[3:], strict=True)) > 1e-4
    assert_replicas_identical(tmp_path, [0, 2, 3])


def test_below_min_replicas_checkpoints_and_resumes(tmp_path, local_dataset, plain):
    """Two of four replicas lost with min_replicas=3: the last committed step is saved (here with
    asynchronous saves, the harder case: the stop waits for the save; tests/unit/data_parallel/forward/test_stops.py
    covers the synchronous one), the failure is logged, the exit is
    3, and the checkpoint resumes the same curve in plain mode."""
    faults = [
        {"step": 6, "replica": 1, "phase": "forward"},
        {"step": 6, "replica": 2, "phase": "forward"},
    ]
    saves = ["checkpoints.async_save=true", "checkpoints.checkpoint_interval=2"]
    result = run(
        tmp_path,
        local_dataset.corpus_dir,
        layout(1, 1, 4, 2) + recover(faults, min_replicas=3) + saves,
        4,
        expect_ok=False,
    )
    assert result.returncode == 3, result.output[-3000:]
    assert "below recover.min_replicas=3" in result.output
    assert "Saved step 5" in result.output
    assert read_outcome(tmp_path)["kind"] == "too_few_replicas"
    reader = CheckpointReader(tmp_path / "checkpoints")
    reader.verify()
    assert reader.step == 5, "the checkpoint the message names exists and is the latest"
    assert {r for i in read_incidents(tmp_path) for r in i["failed_replicas"]} == {1, 2}
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    # Resume the same config in plain mode: the curve continues as if nothing happened.
    run(tmp_path, local_dataset.corpus_dir, layout(1, 1, 4, 2), 4)
    got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, plain, strict=True):
        assert g["ids_digest"] == w["ids_digest"]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)


def test_random_faults_until_half_are_gone(tmp_path, local_dataset, plain):
    """recover.random_faults kills a seeded random replica every 4 steps until 2 of 4 are left."""
    sets = layout(1, 1, 4, 2) + [
        "recover.enabled=true",
        "recover.random_faults={every_steps: 4, seed: 5, until_replicas: 2}",
    ]
    run(tmp_path, local_dataset.corpus_dir, sets, 4)
    incidents = read_incidents(tmp_path)
    assert [i["step"] for i in incidents] == [4, 8]
    lost = sorted(r for i in incidents for r in i["failed_replicas"])
    assert len(lost) == 2
    assert_equivalent(tmp_path, plain, survivors=sorted(set(range(4)) - set(lost)))


# -- recover.exact: a faulty run is bit for bit the fault-free run ------------------------------
EXACT = ["recover.enabled=true", "recover.exact=true"]
# The fault-free reference is one replica of the same model layout computing all B micro-batches in
# the plain mode: the faulty run, whose sums travel over MPI between 4, then 3, then fewer replicas,
# must reproduce it bit for bit (and one replica of 2 ranks keeps the suite quick).
EXACT_REFERENCE = {"tp2": layout(2, 1, 1, 8), "pp2": layout(1, 2, 1, 4)}
EXACT_FAULTS = {
    # tp=2: a replica lost at the agree (after its reduction), then two in one step, the second
    # while the survivors recompute the first one's micro-batches.
    "tp2": (
        W4_TP2,
        [
            {"step": 2, "replica": 1, "phase": "agree"},
            {"step": 5, "replica": 0, "phase": "forward", "microbatch": 1},
            {"step": 5, "replica": 2, "phase": "recovery"},
        ],
        [3],
    ),
    # pp=2 (1F1B), B=4: lost in the reduction; then W=3 gives G=2, two Majors and a spare
    # shadowing replica 0, which dies in its backward pass (the spare is promoted); then a rank
    # dies at the gate.
    "pp2": (
        layout(1, 2, 4, 1),
        [
            {"step": 2, "replica": 3, "phase": "reduce", "microbatch": 0},
            {"step": 4, "replica": 0, "phase": "backward", "microbatch": 1},
            {"step": 7, "rank": 3, "phase": "gate"},
        ],
        [2],
    ),
}


def digests(run_dir: Path) -> dict[tuple[int, str], str]:
    """(replica, 'ppX_tpY') -> parameter digest of every rank that finished."""
    out = {}
    for f in (run_dir / "parameters").glob("replica*_pp*_tp*.sha256"):
        replica, coord = f.stem.split("_", 1)
        out[(int(replica.removeprefix("replica")), coord)] = f.read_text().strip()
    return out


@pytest.mark.parametrize("name", list(EXACT_FAULTS))
def test_exact_mode_with_faults_is_bitwise_the_fault_free_run(tmp_path, local_dataset, plain, name):
    sets, faults, survivors = EXACT_FAULTS[name]
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "faulty"
    run(ref_dir, local_dataset.corpus_dir, EXACT_REFERENCE[name] + ["recover.exact=true"], 2)
    run(run_dir, local_dataset.corpus_dir, sets + EXACT + [f"recover.faults={json.dumps(faults)}"], 8)
    want, got = read_metrics(ref_dir), read_metrics(run_dir)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert {r for i in read_incidents(run_dir) for r in i["failed_replicas"]} == set(range(4)) - set(
        survivors
    )
    for g, w in zip(got, want, strict=True):
        assert g["ids_digest"] == w["ids_digest"]
        assert g["loss"] == w["loss"], f"step {g['step']}: {g['loss']!r} != {w['loss']!r}"
        assert g["grad_norm"] == w["grad_norm"], f"step {g['step']}"
    ref, faulty = digests(ref_dir), digests(run_dir)
    assert {r for r, _ in faulty} == set(survivors)
    assert faulty and all(digest == ref[(0, coord)] for (_, coord), digest in faulty.items())
    if name == "pp2":
        promoted = [i for i in read_incidents(run_dir) if i["step"] == 4]
        assert [i["action"] for i in promoted] == ["promote_spare"]
    else:
        # Exact vs the normal mode (one rank summing all B=8 micro-batches in fp32): the fixed-point
        # rounding (2^-41 per micro-batch gradient element) is far below fp32's, so the curves agree
        # like any two orders of the float sum do.
        assert_same_curve(want, plain)
