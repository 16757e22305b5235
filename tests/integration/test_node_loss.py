"""Whole nodes lost under a training job, on the emulated Slurm cluster (``tests/helpers/emulated_cluster.py``).

Each test submits the tiny CPU job with ``nanotron-recover slurm --submit``: one rank per node, one
replica per rank, ``dp=3`` (B = 12 micro-batches per step). Then, at a committed step the test picks
(the code does not choose it), it takes nodes away from outside: power (SIGKILL of every process of
the node, its ``/dev/shm`` with them), or a freeze (SIGSTOP of every process of the node).

Open MPI's runtime ends the whole job when it loses a node's daemon; the job script's supervisor
relaunches it inside the same allocation on the nodes that still answer, from the replicas'
node-memory snapshots (a spare node, or a narrower job with the same B when there is none). Every
test checks: the Slurm job COMPLETED with exit status 0, every step 1..N committed with the
fault-free run's micro-batch ids and loss (1e-5 relative), identical parameters on every replica
at the end, the relaunch incident, and no process of the job left on any node that is up.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome
from tests.helpers.curves import assert_replicas_identical, assert_same_curve
from tests.helpers.emulated_cluster import EmulatedCluster, _is_zombie, cluster_fixture
from tests.helpers.mpirun_utils import REPO, check, layout, run_cli

pytestmark = [pytest.mark.mpi, pytest.mark.cluster]

emulated = cluster_fixture(scope="module", n_nodes=4, cpus_per_node=2)

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 30
DP, G = 3, 4  # B = 12
# The heartbeat as short as a busy 2-core machine allows (a frozen node is declared failed after it).
HEARTBEAT = ["recover.heartbeat_period_s=1", "recover.heartbeat_timeout_s=5"]
JOB_TIMEOUT_S = 420
# A powered-off node is DOWN for Slurm after SlurmdTimeout (10 s); a thawed or powered-on one
# registers again and returns to service by itself (ReturnToService=2).
NODE_BACK_S = 120


def sets(extra: list[str] | None = None) -> list[str]:
    return [
        *layout(1, 1, DP, G),
        f"tokens.train_steps={STEPS}",
        "data_stages.0.data.dataset=null",
        "recover.enabled=true",
        "recover.max_restarts=3",
        "recover.watchdog_timeout_s=120",
        "recover.gate_timeout_s=30",
        *HEARTBEAT,
        *(extra or []),
    ]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    """The fault-free reference: one process summing the same B = 12 micro-batches per step."""
    run_dir = tmp_path_factory.mktemp("plain")
    args = ["train", "--config", CONFIG, "--run-dir", str(run_dir)]
    base = [s for s in sets() if not s.startswith(("parallelism.", "tokens.batch_accumulation", "recover."))]
    check(run_cli(args + [a for s in [*base, *layout(1, 1, 1, DP * G)] for a in ("--set", s)]))
    return read_metrics(run_dir)


class ClusterJob:
    """A training job submitted to the emulated cluster; its run folder is on the shared file system."""

    def __init__(self, cluster: EmulatedCluster, work: Path, nodes: int, spares: int, extra=None):
        self.cluster, self.run_dir = cluster, work / "run"
        argv = [sys.executable, "-m", "nanotron_recover.cli", "slurm", "--config", CONFIG]
        argv += ["--nodes", str(nodes), "--spare-nodes", str(spares), "--gpus-per-node", "0"]
        argv += ["--time", "15", "--run-dir", str(self.run_dir), "--job-name", work.name, "--submit"]
        argv += [a for s in sets(extra) for a in ("--set", s)]
        env = dict(cluster.mpi_env, OMP_NUM_THREADS="1")
        proc = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        self.id = re.search(r"submitted job (\d+)", proc.stdout).group(1)

    def log(self) -> str:
        path = self.run_dir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else self.cluster.logs()

    def committed(self) -> int:
        try:
            return read_metrics(self.run_dir)[-1]["step"]
        except (OSError, ValueError, IndexError, KeyError):
            return 0

    def wait_for_step(self, step: int, timeout_s: float = 180) -> int:
        deadline = time.monotonic() + timeout_s
        while self.committed() < step:
            state = self.cluster.job_state(self.id)
            if time.monotonic() > deadline or state not in ("PENDING", "CONFIGURING", "RUNNING"):
                self.cluster.run("scancel", self.id)
                pytest.fail(
                    f"job {self.id} ({state}): no step {step} after {timeout_s}s\n{self.log()[-4000:]}"
                )
            time.sleep(0.05)
        return self.committed()

    def ranks(self) -> list[dict]:
        deadline = time.monotonic() + 120
        while not (self.run_dir / "ranks.json").exists():
            if time.monotonic() > deadline:
                pytest.fail(f"job {self.id}: no rank table after 120 s\n{self.log()[-4000:]}")
            time.sleep(0.05)
        return json.loads((self.run_dir / "ranks.json").read_text())

    def batch_host(self) -> str:
        """The node that runs the job script, the supervisor and mpirun (see the SPOF note in
        docs/architecture.md): the tests take other nodes away."""
        return self.cluster.job_info(self.id)["BatchHost"]

    def host_of(self, replica: int) -> str:
        return next(r["host"] for r in self.ranks() if r["replica"] == replica)

    def finish(self) -> str:
        state = self.cluster.wait_job(self.id, JOB_TIMEOUT_S)
        assert state == "COMPLETED", f"job {self.id} {state}\n{self.log()[-6000:]}"
        assert f"job {self.id} finished" in self.log() and "exit status 0" in self.log(), self.log()[-3000:]
        return self.log()

    def leftovers(self, nodes: list[str]) -> dict[str, list[str]]:
        """Processes of this job still on ``nodes``: its ranks (they name the run folder) and the
        runtime's daemons and Slurm steps (anything but slurmd), after Slurm's own clean-up."""
        found: dict[str, list[str]] = {}
        deadline = time.monotonic() + 30
        while True:
            found = {}
            for node in nodes:
                slurmd = self.cluster._slurmd[node].pid
                for pid in self.cluster.pids(node):
                    if pid == slurmd or _is_zombie(pid):
                        continue
                    try:
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    except OSError:
                        continue
                    found.setdefault(node, []).append(f"{pid} {cmdline[:120]}")
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)


def assert_trained_like_plain(job: ClusterJob, plain: list[dict], replicas: list[int]) -> None:
    outcome = read_outcome(job.run_dir)
    assert outcome["status"] == "completed" and outcome["last_step"] == STEPS, outcome
    assert_same_curve(read_metrics(job.run_dir), plain[:STEPS])
    assert_replicas_identical(job.run_dir, replicas)


def node_memory_left(cluster: EmulatedCluster, nodes: list[str]) -> dict[str, str]:
    """What is left in each node's snapshot folder (the run removes its snapshots at the end)."""
    found = {}
    for node in nodes:
        out = cluster.run_on(node, ["sh", "-c", "ls -A /dev/shm/nanotron-recover 2>/dev/null"]).stdout
        if out.strip():
            found[node] = out.strip()
    return found


@pytest.fixture
def cluster(emulated):
    """The module's cluster with every node up and idle before the test, and again after it."""
    emulated.wait_nodes_idle(timeout_s=NODE_BACK_S)
    yield emulated
    for node in emulated.names:
        if node in emulated._frozen:
            emulated.thaw(node)
        if not emulated.is_on(node):
            emulated.power_on(node, wait_idle_s=None)
    emulated.wait_nodes_idle(timeout_s=NODE_BACK_S)


def relaunch_incident(job: ClusterJob) -> dict:
    (incident,) = [i for i in read_incidents(job.run_dir) if i["kind"] == "node_lost"]
    return incident


def test_power_loss_with_a_spare_node_relaunches_at_full_width(cluster, tmp_path, plain):
    """Replica 1's node loses power mid-run: the job is relaunched on the two nodes left and the
    spare, the spare's rank receives its state from a peer's snapshot, and all three replicas run
    to the end."""
    job = ClusterJob(cluster, tmp_path, nodes=3, spares=1)
    victim = job.host_of(1)
    spare = next(n for n in cluster.names if n not in {r["host"] for r in job.ranks()})
    assert victim != job.batch_host()
    job.wait_for_step(3)
    cluster.power_off(victim)
    lost_after = job.committed()
    log = job.finish()

    assert f"(hosts {victim} lost): relaunching it (generation 1, 3 replica(s)" in log, log[-3000:]
    assert_trained_like_plain(job, plain, [0, 1, 2])
    incident = relaunch_incident(job)
    assert incident["hosts_lost"] == [victim] and incident["state_from"] == "snapshot"
    assert victim not in incident["hosts"] and spare in incident["hosts"]
    assert lost_after - 1 <= incident["restored_step"] <= lost_after + 1
    assert incident["alive_replicas"] == [0, 1, 2]
    assert spare in {r["host"] for r in job.ranks()} and victim not in {r["host"] for r in job.ranks()}
    parts = sum(incident[k] for k in ("cleanup_s", "probe_s", "start_s", "first_step_s"))
    assert parts == pytest.approx(incident["restart_s"], abs=1.0)
    up = [n for n in cluster.names if n != victim]
    assert job.leftovers(up) == {}
    assert node_memory_left(cluster, up) == {}


def test_power_loss_without_a_spare_goes_on_narrower_with_the_same_batch(cluster, tmp_path, plain):
    """No spare: the job is relaunched with the two replicas the answering nodes hold; they share
    the same B = 12 micro-batches, so the curve is the fault-free one."""
    job = ClusterJob(cluster, tmp_path, nodes=3, spares=0)
    victim = job.host_of(2)
    job.wait_for_step(4)
    cluster.power_off(victim)
    log = job.finish()

    assert f"(hosts {victim} lost): relaunching it (generation 1, 2 replica(s)" in log, log[-3000:]
    assert_trained_like_plain(job, plain, [0, 1])
    incident = relaunch_incident(job)
    assert incident["alive_replicas"] == [0, 1] and incident["state_from"] == "snapshot"
    assert read_metrics(job.run_dir)[-1]["replicas"] == 2
    assert job.leftovers([n for n in cluster.names if n != victim]) == {}


def test_two_nodes_lost_at_once(cluster, tmp_path, plain):
    """Two of the three training nodes lose power together: the one left and the spare run two
    replicas; the spare's state comes over MPI from the node that kept its snapshot."""
    job = ClusterJob(cluster, tmp_path, nodes=3, spares=1)
    victims = [job.host_of(1), job.host_of(2)]
    assert job.batch_host() not in victims
    job.wait_for_step(3)
    for node in victims:
        cluster.power_off(node)
    log = job.finish()

    assert "relaunching it (generation 1, 2 replica(s)" in log, log[-3000:]
    assert_trained_like_plain(job, plain, [0, 1])
    incident = relaunch_incident(job)
    assert sorted(incident["hosts_lost"]) == sorted(victims) and incident["state_from"] == "snapshot"
    assert job.leftovers([n for n in cluster.names if n not in victims]) == {}


def test_frozen_node(cluster, tmp_path, plain):
    """Every process of replica 1's node is stopped (a kernel hang): the heartbeat declares its rank
    failed and the step is repaired forward; if Open MPI's runtime later gives up on the node's
    daemon, the job is relaunched without it. Either way the run completes with the plain curve
    and, once the node is thawed, nothing of the job is left on it."""
    job = ClusterJob(cluster, tmp_path, nodes=3, spares=0)
    victim = job.host_of(1)
    job.wait_for_step(3)
    cluster.freeze(victim)
    try:
        log = job.finish()
    finally:
        cluster.thaw(victim)
    incidents = read_incidents(job.run_dir)
    assert any(i["kind"] in ("hang", "node_lost") for i in incidents), incidents
    relaunched = [i for i in incidents if i["kind"] == "node_lost"]
    # Repaired in the step, replicas 0 and 2 go on; a relaunch numbers the replicas it runs 0, 1.
    replicas = relaunched[-1]["alive_replicas"] if relaunched else [0, 2]
    assert_trained_like_plain(job, plain, replicas)
    assert "nanotron-recover job:" in log or not relaunched
    assert job.leftovers(cluster.names) == {}
    print(f"frozen {victim}: incidents {[(i['kind'], i['step']) for i in incidents]}")
