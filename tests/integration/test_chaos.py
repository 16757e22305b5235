"""Short chaos campaigns on this host: ``nanotron-recover chaos`` launches a 3-replica job with
re-join on and sends faults from outside. A seeded one sends a SIGKILL, a SIGSTOP and a kill timed
into a re-join (the first kill's incident recorded, its replacement spawned and not joined yet); a
replayed one sends the pair of kills a longer campaign found stalling the job. The tests read only
``chaos.json``: exit 0, the plain run's ids and loss at every step, a recorded reaction to each
fault, and the job back at its initial width at the end. Both share one plain reference run."""

from __future__ import annotations

import json

import pytest

from nanotron_recover.chaos.schedule import draw_schedule
from tests.helpers.mpirun_utils import REPO, run_cli

pytestmark = pytest.mark.mpi

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
DP, STEPS = 3, 300
SETS = [
    "model.model_config.hidden_size=32",
    "model.model_config.intermediate_size=64",
    "tokens.sequence_length=32",
    "tokens.micro_batch_size=1",
    f"tokens.train_steps={STEPS}",
    f"parallelism.dp={DP}",
    "tokens.batch_accumulation_per_replica=2",
    "recover.enabled=true",
    "recover.rejoin.mode=spawn",
    "recover.heartbeat_period_s=0.5",
    "recover.heartbeat_timeout_s=2",
    "recover.rejoin.join_timeout_s=60",
    "recover.watchdog_timeout_s=60",
    "recover.gate_timeout_s=30",
]
KINDS = ["kill", "freeze", "kill_during_rejoin"]
SEED = 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain reference runs' folder, shared: the campaigns here run the same config."""
    return tmp_path_factory.mktemp("chaos_reference")


def _campaign(run_dir, reference, *args: str) -> dict:
    """``nanotron-recover chaos`` on the suite's config (``args``: what the campaign sends); its
    ``chaos.json``, after checking that the job exited 0."""
    cmd = ["chaos", "--config", CONFIG, "--run-dir", str(run_dir), "--reference", str(reference), *args]
    result = run_cli([*cmd, *(a for s in SETS for a in ("--set", s))], timeout=180)
    record = json.loads((run_dir / "chaos.json").read_text())
    print((run_dir / "chaos.md").read_text())
    assert result.returncode == 0 and record["exit_status"] == 0, record["verdict"] + result.output[-3000:]
    return record


def test_seeded_campaign_equals_the_plain_run(tmp_path, reference):
    run_dir = tmp_path / "run"
    args = ["--seed", str(SEED), "--faults", "3", "--kinds", ",".join(KINDS)]
    args += ["--first-step", "10", "--min-gap", "60", "--timeout-s", "150"]
    record = _campaign(run_dir, reference, *args)
    totals = record["totals"]

    # The schedule is the seeded draw, written for --replay.
    want = draw_schedule(SEED, 3, KINDS, dp=DP, replica_size=1, first_step=10, last_step=240, min_gap=60)
    assert record["schedule"] == want.to_dict()
    assert json.loads((run_dir / "chaos_schedule.json").read_text()) == want.to_dict()

    # The job: exit 0, every step the plain run's ids and loss, back at full width, no hang.
    assert totals["exit_status"] == 0 and totals["hang"] is None
    comparison = record["comparison"]
    assert comparison["equal"] and totals["equal_to_plain"]
    assert comparison["steps"] == STEPS and not comparison["missing_steps"]
    assert not comparison["ids_mismatch_steps"] and not comparison["loss_mismatch_steps"]
    assert totals["final_replicas"] == DP
    assert 0 < totals["full_width_share"] < 1

    # Each fault was sent and has a recorded reaction of the kind it calls for.
    assert totals["faults_sent"] == 3 and totals["faults_with_reaction"] == 3 and not record["unsent"]
    by_kind = {f["kind"]: f for f in record["faults"]}
    assert "crash" in by_kind["kill"]["incident_kinds"]
    assert "hang" in by_kind["freeze"]["incident_kinds"]
    rejoin = by_kind["kill_during_rejoin"]
    assert [s["sent"] for s in rejoin["signals"]] == [True, True]
    assert "crash" in rejoin["incident_kinds"] and "rejoin" in rejoin["incident_kinds"]
    for fault in record["faults"]:
        assert fault["to_next_commit_s"] is not None and fault["to_next_commit_s"] >= 0
        assert "rejoin" in fault["incident_kinds"], fault  # every lost replica came back
    assert totals["rejoins_joined"] >= 3
    assert totals["frozen_left_behind"] == []


def _victims(*replicas: int) -> list[dict]:
    return [{"replica": r, "local_rank": 0} for r in replicas]


# Found by a 3-fault campaign on this host (seed 1, kill_two only): the first pair re-joins as one
# spawn; the second kills the launch's last rank and one of the spawned pair together. The runtime
# then told the last rank of no second death, and it waited in the recovery's agreement until the
# supervisor relaunched the stalled job, 26 s later (ft/death_notices.py).
LAST_LAUNCH_RANK_SCHEDULE = {
    "format": "nanotron-recover chaos schedule 1",
    "seed": 1,
    "kinds": ["kill_two"],
    "dp": DP,
    "replica_size": 1,
    "first_step": 50,
    "last_step": 240,
    "min_gap": 3,
    "faults": [
        {"index": 0, "kind": "kill_two", "step": 80, "delay": 0.084, "victims": _victims(1, 2), "role": None},
        {
            "index": 1,
            "kind": "kill_two",
            "step": 118,
            "delay": 0.626,
            "victims": _victims(0, 1),
            "role": None,
        },
    ],
}


def test_deaths_after_the_launch_is_gone_are_repaired_in_place(tmp_path, reference):
    """Replicas 1 and 2 killed and re-joined (their processes spawned together), then replica 0 (the
    launch's last rank) and replica 1 killed together: replica 2 alone must repair the step itself
    (no relaunch) and re-join both, and the run equal the plain one."""
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps(LAST_LAUNCH_RANK_SCHEDULE))
    record = _campaign(tmp_path / "run", reference, "--replay", str(schedule), "--timeout-s", "150")
    totals = record["totals"]
    assert record["comparison"]["equal"] and totals["equal_to_plain"]
    assert totals["faults_sent"] == 2 and not record["unsent"]
    for fault in record["faults"]:
        assert [s["sent"] for s in fault["signals"]] == [True, True], fault
        assert fault["relaunches"] == [], fault  # repaired in place, not stalled and relaunched
        # One recovery round or two (each death found on its own), then the re-join.
        assert set(fault["incident_kinds"]) == {"crash", "rejoin"}, fault
    assert totals["final_replicas"] == DP
