"""A short seeded chaos campaign on the emulated multi-node Slurm cluster (``tests/helpers/emulated_cluster.py``).

The job is the tiny CPU model in exact mode, submitted with ``sbatch`` from the script
``nanotron-recover slurm`` renders: ``dp=3``, one rank per node, 3 spare nodes for re-joins and
relaunches (6 nodes). The campaign runner (``nanotron_recover.chaos.runner``) drives it through the
cluster target (``tests/helpers/chaos_cluster.py``) and sends, from outside, at the seed's steps:

- a SIGKILL of rank 0, which runs on the batch host (the node of ``mpirun`` and the job script):
  a process fault, repaired forward; the re-join spawns rank 0's replacement on a spare node;
- a SIGSTOP of rank 0, now on that spare node (the target never freezes anything on the batch
  host, nor sends it a node fault: it is the job's single point of failure; when the runtime lost
  a daemon during the re-join and the job was relaunched, rank 0 is back on the batch host and
  another replica is frozen instead). A spawned process is
  outside ULFM's heartbeat ring and no rank shares its node: the supervisor reads its heartbeat
  file, records the hang and SIGKILLs it on its node, and the job repairs the step in place
  (``frozen_processes.py``), long before the commit deadline (``recover.commit_timeout_s``);
- a SIGKILL of two ranks on two different nodes (the re-join needs two free slots);
- a power loss of a third node (every process of it, its ``/dev/shm`` with them), powered on again
  a while later: the supervisor relaunches the job from node memory;
- a SIGSTOP of rank 1, then of rank 2, each on its own node (added to the seed's draw): with the
  freeze of rank 0 on a spare, every node a rank runs on (the batch host excepted) has had a frozen
  rank, spawned or launched, before and after earlier failures, re-joins and relaunches; each must
  be found by the heartbeats and repaired in place (a ``hang``, or a ``crash`` once the watch that
  found it removed it), never by the commit deadline.

The test reads only the campaign's ``chaos.json``: the Slurm job COMPLETED with exit status 0,
every step the plain run's micro-batch ids and loss bit for bit, three replicas at the end, a
recorded reaction to every fault, and each fault's time to the next commit (printed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from nanotron_recover.chaos.schedule import PlannedFault, Victim, draw_schedule
from tests.helpers.chaos_cluster import run_cluster_campaign
from tests.helpers.emulated_cluster import cluster_fixture
from tests.helpers.mpirun_utils import REPO

pytestmark = [pytest.mark.mpi, pytest.mark.cluster]

# 6 nodes: 3 for the replicas, 3 spares. slurmd_timeout_s above the target's restore delay, so that
# a node powered on again is still the job's (Slurm would otherwise mark it down and take it out).
N_NODES = 6 if (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) >> 30 >= 12 else 5
# Each node on its own share of the CPUs, as on a cluster: left free, the kernel moves the busy ranks
# between the CPUs (0.15 s a step on average, a sixth of the steps over 0.3 s, against 0.05 s;
# tests/helpers/emulated_cluster.py).
emulated = cluster_fixture(
    scope="module", n_nodes=N_NODES, cpus_per_node=2, slurmd_timeout_s=120, node_cpus=True
)

CONFIG = REPO / "configs" / "tiny_cpu.yaml"
DP, STEPS = 3, 160
SEED, KINDS = 93, ["kill", "freeze", "kill_two", "node_power_off"]
FIRST, LAST, GAP = 8, 110, 25
NEXT_COMMIT_BOUND_S = 30.0  # the bound for any fault (its goal: 15 s)
SETS = [
    "model.model_config.hidden_size=32",
    "model.model_config.intermediate_size=64",
    "tokens.sequence_length=32",
    "tokens.micro_batch_size=1",
    f"tokens.train_steps={STEPS}",
    f"parallelism.dp={DP}",
    "tokens.batch_accumulation_per_replica=2",
    "data_stages.0.data.dataset=null",
    "recover.enabled=true",
    "recover.exact=true",
    "recover.rejoin.mode=spawn",
    "recover.rejoin.max_failures_per_replica=10",
    "recover.rejoin.join_timeout_s=60",
    # As short as 2 busy cores allow across emulated nodes (tests/integration/test_node_loss.py).
    "recover.heartbeat_period_s=1",
    "recover.heartbeat_timeout_s=5",
    "recover.watchdog_timeout_s=120",
    "recover.gate_timeout_s=30",
    # A re-joined (spawned) process frozen on a node of its own is outside ULFM's heartbeat ring and
    # has no neighbour to watch its heartbeat file: the supervisor's commit deadline ends that stall
    # (derived, it is about 100 s here; fixed lower so the campaign stays short).
    "recover.commit_timeout_s=45",
    "checkpoints.save_final_state=false",
]


def test_seeded_campaign_on_the_cluster(emulated, tmp_path):
    emulated.wait_nodes_idle(timeout_s=120)
    schedule = draw_schedule(
        SEED, 4, KINDS, dp=DP, replica_size=1, first_step=FIRST, last_step=LAST, min_gap=GAP
    )
    # The seed's draw: kill rank 0, freeze rank 0, kill two, power a node off.
    assert [(f.kind, [v.replica for v in f.victims]) for f in schedule.faults] == [
        ("kill", [0]),
        ("freeze", [0]),
        ("kill_two", [0, 1]),
        ("node_power_off", [2]),
    ]
    # Then rank 1 and rank 2 frozen, each on its node.
    extra = tuple(
        PlannedFault(index=4 + i, kind="freeze", step=step, delay=0.3, victims=(Victim(replica=replica),))
        for i, (step, replica) in enumerate([(108, 1), (133, 2)])
    )
    schedule = dataclasses.replace(schedule, faults=schedule.faults + extra)
    record = run_cluster_campaign(
        emulated,
        tmp_path,
        CONFIG,
        SETS,
        schedule,
        nodes=DP,
        spares=N_NODES - DP,
        timeout_s=450,
        restore_after_s=15,
    )
    totals, faults, slurm = record["totals"], record["faults"], record["slurm"]
    print((tmp_path / "run" / "chaos.md").read_text())
    summary = [(f["index"], f["kind"], f["target"], f.get("to_next_commit_s")) for f in faults]
    print("fault -> next commit:", json.dumps(summary, default=str))
    print(f"batch host {slurm['batch_host']}, Slurm {slurm['state']} {slurm['exit_code']}")
    # What the job said about itself, for any assertion below: the supervisor's lines (why a job
    # ended, what was relaunched) and the end of the Slurm output.
    log_tail = "\n" + (tmp_path / "run" / "chaos_job.log").read_text()[-1000:]
    slurm_log = Path(slurm["log"])
    if slurm_log.exists():
        slurm_lines = slurm_log.read_text(errors="replace").splitlines()
        said = [line for line in slurm_lines if "nanotron-recover launch" in line or "error" in line.lower()]
        log_tail += "\n" + "\n".join(said[-40:] + ["..."] + slurm_lines[-30:])

    # The job: Slurm COMPLETED with exit 0, no hang, every step committed, 3 replicas at the end.
    assert slurm["state"] == "COMPLETED" and slurm["exit_code"] == "0:0", str(slurm) + log_tail
    assert totals["exit_status"] == 0 and totals["hang"] is None, record["verdict"] + log_tail
    comparison = record["comparison"]
    assert comparison["tolerance"].startswith("bitwise")
    assert comparison["steps"] == STEPS and not comparison["missing_steps"], comparison
    assert totals["final_replicas"] == DP

    # Every fault sent, with a recorded reaction, and the next commit within the bound.
    assert totals["faults_sent"] == 6 and not record["unsent"]
    assert totals["faults_with_reaction"] == 6
    by_kind = {f["kind"]: f for f in faults[:4]}
    batch = slurm["batch_host"]
    kill, freeze = by_kind["kill"], by_kind["freeze"]
    assert kill["target"][0]["rank"] == 0 and "crash" in kill["incident_kinds"]
    # Rank 0 re-joins on a spare node, where the seed's freeze finds it. The runtime sometimes
    # loses a daemon during the spawn and ends the job, which is relaunched with rank 0 on the
    # batch host again: the target then strikes another replica (never the batch host).
    if "rejoin" in kill["incident_kinds"]:
        assert freeze["target"][0]["rank"] == 0, freeze
    assert freeze["signals"][0]["host"] != batch, freeze
    assert len(by_kind["kill_two"]["target"]) == 2
    power = by_kind["node_power_off"]
    assert power["signals"][0]["node"] != batch
    assert any(k in ("node_lost", "job_lost", "stalled") for k in power["incident_kinds"]), power
    assert all(e["restored_after_s"] is not None for e in record["node_faults"]), record["node_faults"]
    # Frozen processes on several nodes, none the batch host (rank 0 on a spare when it re-joined
    # there, rank 1 and rank 2 on theirs), each found by the heartbeats (ULFM's detector, a rank's
    # monitor or the supervisor's watch) and repaired in place: never the commit deadline.
    frozen = [f for f in faults if f["kind"] == "freeze"]
    hosts = {f["signals"][0]["host"] for f in frozen}
    assert len(hosts) >= 2 and batch not in hosts, frozen
    for f in frozen:
        assert {"hang", "crash"} & set(f["incident_kinds"]) and "stalled" not in f["incident_kinds"], (
            str(f) + log_tail
        )
    print("frozen:", [(f["target"][0]["rank"], f["signals"][0]["host"], f["incident_kinds"]) for f in frozen])
    for fault in faults:
        assert fault["to_next_commit_s"] is not None, fault
        assert 0 <= fault["to_next_commit_s"] <= NEXT_COMMIT_BOUND_S, fault

    # The plain run's micro-batch ids and loss (and grad norm) at every step, bit for bit (a rank
    # killed in the step's agree once left the curve from the next step: found by this campaign).
    assert not comparison["ids_mismatch_steps"] and not comparison["loss_mismatch_steps"], comparison
    assert comparison["equal"] and totals["equal_to_plain"], comparison
    assert record["exit_status"] == 0, record["verdict"] + log_tail
