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

import re
import signal
import time
from pathlib import Path

import pytest

from nanotron_recover import fencing
from nanotron_recover.commit_record import read_commit
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome
from tests.helpers.cluster_job import ClusterJob
from tests.helpers.curves import assert_replicas_identical, assert_same_curve
from tests.helpers.emulated_cluster import EmulatedCluster, cluster_fixture
from tests.helpers.mpirun_utils import REPO, check, layout, run_cli

pytestmark = [pytest.mark.mpi, pytest.mark.cluster]

emulated = cluster_fixture(scope="module", n_nodes=4, cpus_per_node=2)

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 30
DP, G = 3, 4  # B = 12
# The heartbeat as short as a busy 2-core machine allows (a frozen node is declared failed after it).
HEARTBEAT = ["recover.heartbeat_period_s=1", "recover.heartbeat_timeout_s=5"]
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


def assert_trained_like_plain(job: ClusterJob, plain: list[dict], replicas: list[int]) -> None:
    outcome = read_outcome(job.run_dir)
    assert outcome["status"] == "completed" and outcome["last_step"] == STEPS, outcome
    assert_same_curve(read_metrics(job.run_dir), plain[:STEPS])
    assert_replicas_identical(job.run_dir, replicas)


def node_memory_left(cluster: EmulatedCluster, nodes: list[str]) -> dict[str, str]:
    """What is left in each node's snapshot folder (the run removes its snapshots at the end)."""
    found = {}
    for node in nodes:
        # The per-user folder (recover.snapshot.dir's default) stays; the run's folder in it must not.
        out = cluster.run_on(node, ["sh", "-c", "ls -A /dev/shm/nanotron-recover-*/ 2>/dev/null"]).stdout
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


def relaunch_incident(job: ClusterJob, generation: int = 1) -> dict:
    """The incident of the ``generation``-th relaunch, the first the test caused. On a busy machine
    a relaunched job can lose a rank again while it starts (a heartbeat missed under load) and be
    relaunched once more: that is recovery doing its work, so a later generation may follow, but
    none may come before it and each must blame hosts that are really down."""
    relaunches = [i for i in read_incidents(job.run_dir) if i["kind"] == "node_lost"]
    ours = [i for i in relaunches if i["generation"] == generation]
    assert ours and all(i["generation"] >= generation for i in relaunches), relaunches
    if len(relaunches) > 1:
        print(f"relaunches: {[(i['generation'], i['step'], i['hosts_lost']) for i in relaunches]}")
    return ours[0]


def relaunches_blame(job: ClusterJob, down: list[str]) -> bool:
    """Every relaunch named only hosts that are down."""
    relaunches = [i for i in read_incidents(job.run_dir) if i["kind"] == "node_lost"]
    return all(set(i["hosts_lost"]) <= set(down) for i in relaunches)


def test_power_loss_with_a_spare_node_relaunches_at_full_width(cluster, tmp_path, plain):
    """Replica 1's node loses power mid-run: the job is relaunched on the two nodes left and the
    spare, the spare's rank receives its state from a peer's snapshot, and all three replicas run
    to the end."""
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(), nodes=3, spares=1)
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
    # The survivors may repair the step forward and go on at 2 replicas for a few steps until Open
    # MPI's runtime (or the supervisor's probe of the silent host) ends the job; the relaunch then
    # restores the newest snapshot every coordinate holds: at most one committed step is redone.
    assert incident["restored_step"] >= lost_after - 1 and incident["steps_redone"] <= 1, incident
    assert incident["alive_replicas"] == [0, 1, 2]
    assert spare in {r["host"] for r in job.ranks()} and victim not in {r["host"] for r in job.ranks()}
    # The probe runs during the cleanup: the relaunch waited for the longer of the two.
    rest = incident["start_s"] + incident["first_step_s"]
    cleanup, probe = incident["cleanup_s"], incident["probe_s"]
    assert max(cleanup, probe) + rest - 1.0 <= incident["restart_s"] <= cleanup + probe + rest + 1.0, incident
    up = [n for n in cluster.names if n != victim]
    assert job.leftovers(up) == {}
    assert node_memory_left(cluster, up) == {}


def test_power_loss_without_a_spare_goes_on_narrower_with_the_same_batch(cluster, tmp_path, plain):
    """No spare: the job is relaunched with the two replicas the answering nodes hold; they share
    the same B = 12 micro-batches, so the curve is the fault-free one."""
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(), nodes=3, spares=0)
    victim = job.host_of(2)
    job.wait_for_step(4)
    cluster.power_off(victim)
    log = job.finish()

    assert f"(hosts {victim} lost): relaunching it (generation 1, 2 replica(s)" in log, log[-3000:]
    assert_trained_like_plain(job, plain, [0, 1])
    incident = relaunch_incident(job)
    assert incident["alive_replicas"] == [0, 1] and incident["state_from"] == "snapshot"
    assert relaunches_blame(job, [victim])
    assert read_metrics(job.run_dir)[-1]["replicas"] == 2
    assert job.leftovers([n for n in cluster.names if n != victim]) == {}


def test_two_nodes_lost_at_once(cluster, tmp_path, plain):
    """Two of the three training nodes lose power together: the one left and the spare run two
    replicas; the spare's state comes over MPI from the node that kept its snapshot. Together is
    still two events to the runtime: when it meets the second node only while relaunching, the job
    is relaunched once more -- on the two that answer either way, with the same curve."""
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(), nodes=3, spares=1)
    victims = [job.host_of(1), job.host_of(2)]
    assert job.batch_host() not in victims
    job.wait_for_step(3)
    cluster.power_off_together(victims)
    log = job.finish()

    up = sorted(n for n in cluster.names if n not in victims)
    relaunched = re.findall(r"relaunching it \(generation (\d), (\d) replica\(s\) on ([\w, ]+),", log)
    assert relaunched and len(relaunched) <= 2, log[-3000:]
    generation, replicas, hosts = relaunched[-1]
    assert replicas == "2" and sorted(hosts.split(", ")) == up, relaunched
    assert_trained_like_plain(job, plain, [0, 1])
    incident = relaunch_incident(job, int(generation))
    assert sorted(incident["hosts_lost"]) == sorted(victims) and incident["state_from"] == "snapshot"
    assert relaunches_blame(job, victims)
    assert job.leftovers(up) == {}


def test_frozen_node(cluster, tmp_path, plain):
    """Every process of replica 1's node is stopped (a kernel hang): the heartbeat declares its rank
    failed and the step is repaired forward, and the job is relaunched without the node once it
    stops answering. The node is thawed while the job still trains -- its processes wake up inside
    a newer generation (or, repaired forward only, as removed members) -- and write nothing: the
    run completes with the plain curve, the outcome and the last commit are the newest job's, and
    nothing of the job is left on the node."""
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(), nodes=3, spares=0)
    victim = job.host_of(1)
    job.wait_for_step(3)
    first = fencing.read_token(job.run_dir)
    cluster.freeze(victim)
    try:
        job.wait_until(lambda: moved_on(job, first), "the job going on without the frozen node")
        assert read_outcome(job.run_dir) is None, "the job ended before the node was thawed"
    finally:
        cluster.thaw(victim)
    log = job.finish()
    incidents = read_incidents(job.run_dir)
    assert any(i["kind"] in ("hang", "node_lost") for i in incidents), incidents
    relaunched = [i for i in incidents if i["kind"] == "node_lost"]
    # Repaired in the step, replicas 0 and 2 go on; a relaunch numbers the replicas it runs 0, 1.
    replicas = relaunched[-1]["alive_replicas"] if relaunched else [0, 2]
    try:
        assert_trained_like_plain(job, plain, replicas)
    except AssertionError as e:  # say what the job did (a relaunch after the thaw, say)
        raise AssertionError(f"{e}\nincidents: {incidents}\n{log[-3000:]}") from e
    # The newest job wrote the outcome and the last commit (the supervisor advances the token
    # once more when that job ends, fencing nothing that still writes).
    last = read_commit(job.run_dir).token
    assert read_commit(job.run_dir).step == STEPS and last is not None
    assert read_outcome(job.run_dir)["token"] == last.as_record()
    assert last.generation == fencing.read_token(job.run_dir).generation - 1
    if relaunched:
        assert last.generation > first.generation
    assert "nanotron-recover job:" in log or not relaunched
    assert job.leftovers(cluster.names) == {}
    print(
        f"frozen {victim}: incidents {[(i['kind'], i['step']) for i in incidents]}, token {first} -> {last}"
    )


def moved_on(job: ClusterJob, first: fencing.Token) -> bool:
    """A newer job (token) committed a step, or the repaired job committed two steps past the
    hang's incident."""
    record = read_commit(job.run_dir)
    if record is None:
        return False
    if record.token is not None and record.token.generation > first.generation:
        return True
    hangs = [i for i in read_incidents(job.run_dir) if i["kind"] == "hang"]
    return bool(hangs) and record.step >= hangs[0]["step"] + 2


def test_cut_link(cluster, tmp_path, plain):
    """Replica 1's node loses its network but keeps running. Open MPI's runtime cannot reach that
    node's daemon (nor, through it, the next one's), ends the ranks it can reach and exits; the
    cut-off rank cannot be reached, so it declares the others failed after the heartbeat timeout
    and trains on alone, summing the same B micro-batches. The supervisor relaunches the job on the
    nodes that answer, and from then on the cut-off rank finds a newer generation and publishes
    nothing; if it finished the run before that relaunch, its records are the run's. Either way
    the run's records are the plain run's, and once the link is back nothing of the job is left."""
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(), nodes=3, spares=0)
    victim = job.host_of(1)
    job.wait_for_step(3)
    cluster.cut_link(victim)
    try:
        job.finish()
    finally:
        cluster.restore_link(victim)
    incidents = read_incidents(job.run_dir)
    assert any(i["kind"] in ("crash", "hang", "node_lost") for i in incidents), incidents
    outcome = read_outcome(job.run_dir)
    assert outcome["status"] == "completed" and outcome["last_step"] == STEPS, outcome
    metrics = read_metrics(job.run_dir)
    assert_same_curve(metrics, plain[:STEPS])
    digests = {f.name: f.read_text() for f in (job.run_dir / "parameters").glob("replica*.sha256")}
    assert len(digests) == metrics[-1]["replicas"] and len(set(digests.values())) == 1, digests
    assert job.leftovers(cluster.names, timeout_s=90) == {}
    print(f"cut {victim}: incidents {[(i['kind'], i['step'], i.get('failed_replicas')) for i in incidents]}")


def test_node_lost_while_the_job_restarts(cluster, tmp_path, plain):
    """Replica 1's node loses power; while the relaunched job starts on the nodes left and the
    spare, the spare loses power too. The job is relaunched once more, on the two nodes left,
    from the snapshots the first relaunch could not use yet."""
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(), nodes=3, spares=1)
    first = job.host_of(1)
    spare = next(n for n in cluster.names if n not in {r["host"] for r in job.ranks()})
    job.wait_for_step(3)
    cluster.power_off(first)
    generation = job.run_dir / "generation.json"
    deadline = time.monotonic() + 120
    while not generation.exists():
        assert time.monotonic() < deadline, job.log()[-4000:]
        time.sleep(0.02)
    # The relaunch is starting: mpirun launches its daemons, ranks import torch.
    cluster.power_off(spare)
    log = job.finish()

    assert "relaunching it (generation 2, 2 replica(s)" in log, log[-4000:]
    assert_trained_like_plain(job, plain, [0, 1])
    incident = relaunch_incident(job, generation=2)
    assert sorted(incident["hosts_lost"]) == sorted([first, spare]) and incident["state_from"] == "snapshot"
    up = [n for n in cluster.names if n not in (first, spare)]
    assert job.leftovers(up) == {}


def test_spare_node_lost_during_a_rejoin(cluster, tmp_path, plain):
    """Replica 1's rank is killed (an injected fault) and repaired forward; at the next boundary its
    replacement is spawned onto the spare node, and the spare loses power as soon as that process
    exists, before its join can commit. Open MPI's runtime ends the job; it is relaunched on the
    three training nodes from node memory and completes at full width."""
    extra = [
        "recover.rejoin.mode=spawn",
        "recover.faults=[{step: 4, replica: 1, phase: forward}]",
        "recover.rejoin.join_timeout_s=120",
    ]
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(extra), nodes=3, spares=1)
    training = {r["host"] for r in job.ranks()}
    spare = next(n for n in cluster.names if n not in training)
    deadline = time.monotonic() + 180
    while not job.processes_on(spare):
        assert time.monotonic() < deadline, f"no process spawned on {spare}\n{job.log()[-4000:]}"
        time.sleep(0.01)
    spawned_at_step = job.committed()
    cluster.power_off(spare)
    log = job.finish()

    assert f"(hosts {spare} lost): relaunching it (generation 1, 3 replica(s)" in log, log[-4000:]
    assert_trained_like_plain(job, plain, [0, 1, 2])
    kinds = [i["kind"] for i in read_incidents(job.run_dir)]
    assert kinds[0] == "crash" and "node_lost" in kinds, kinds
    assert not any(i["kind"] == "rejoin" and i["status"] == "joined" for i in read_incidents(job.run_dir)[:2])
    assert job.leftovers([n for n in cluster.names if n != spare]) == {}
    print(f"spare {spare} lost at step {spawned_at_step}; incidents {kinds}")


def cpus_allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(
        line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")
    )


def test_a_launch_across_hosts_spawns_again_after_its_first_spawn(cluster, tmp_path, plain):
    """One launch across hosts re-joins twice by spawning: dp=2 on two nodes and two spare nodes;
    the test SIGKILLs replica 1's process from outside after step 3, and its spawned replacement
    once that re-join is done and step 12 committed. Each comes back by a spawn onto a spare node,
    in the same launch, with no relaunch and no step redone.

    Without the fix the supervisor preloads into Open MPI's runtime (``ft/prrte_fix.py``), PRRTE
    3.0's connect code registers an empty namespace at the first spawn, and the second spawn's
    process cannot reach the job ("unable to reach each other") and dies in MPI_Init; or the
    same code's heap corruption ends mpirun or a daemon around a spawn, and the job is lost. The
    job would then come back by a relaunch (``recover.rejoin.spawns_across_hosts``), which this
    test refuses."""
    extra = ["recover.rejoin.mode=spawn", "recover.rejoin.join_timeout_s=120"]
    extra += ["parallelism.dp=2", f"tokens.batch_accumulation_per_replica={DP * G // 2}"]  # B = 12
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(extra), nodes=2, spares=2)
    killed_after = []
    for after_step in (3, 12):
        job.wait_for_step(after_step)
        job.wait_until(
            lambda: len(read_metrics(job.run_dir)) > 0 and read_metrics(job.run_dir)[-1]["replicas"] == 2,
            "full width",
        )
        rank = next(r for r in job.ranks() if r["replica"] == 1)
        if after_step == 12:
            # The spawned process may run where its node's own processes run, as the launch's
            # (unbound): not bound by the runtime to a core of the CPUs mpirun saw on its host.
            assert cpus_allowed(rank["pid"]) == cpus_allowed(cluster._slurmd[rank["host"]].pid), rank
        killed_after.append(job.committed())
        assert cluster.signal(rank["host"], rank["pid"], signal.SIGKILL), rank
    log = job.finish()

    assert_trained_like_plain(job, plain, [0, 1])
    incidents = read_incidents(job.run_dir)
    relaunches = [i for i in incidents if i["kind"] in ("regrow", "job_lost", "node_lost", "stalled")]
    assert relaunches == [], (relaunches, log[-4000:])
    joins = [i for i in incidents if i["kind"] == "rejoin"]
    assert [(j["status"], j["replicas"]) for j in joins] == [("joined", [1]), ("joined", [1])], (
        joins,
        log[-4000:],
    )
    narrow = [m["step"] for m in read_metrics(job.run_dir) if m["replicas"] < 2]
    allowed = {
        k + d for k in killed_after for d in (1, 2, 3)
    }  # the struck step (maybe the next) and one more
    assert set(narrow) <= allowed, (narrow, killed_after, incidents)
    assert "unable to reach each other" not in log and "lost communication with a remote daemon" not in log, (
        log[-4000:]
    )
    assert job.leftovers(cluster.names) == {}


def test_the_root_lost_during_a_spawn_leaves_no_process_waiting_on_the_spare(cluster, tmp_path, plain):
    """Replica 1's rank is killed (an injected fault) and repaired forward; at the next boundary the
    re-join's root (rank 0) spawns its replacement onto the spare node, and the test SIGKILLs rank 0
    as soon as that process exists on the spare. The other members leave the join at the spawn
    stage and train on. The spawned process, still starting, would then wait in ``MPI_Init`` for
    parents that are gone, reached by no revoke, holding the spare (the next spawn "could not
    start" and the job was relaunched to regrow, measured without the fix) and holding ``mpirun``
    at its end; its watcher ends it instead (``ft/abandoned_join.py``), within seconds of the
    failed join, so the next join spawns replica 1 onto the spare again. The run completes with
    the plain curve and leaves nothing behind."""
    extra = [
        "recover.rejoin.mode=spawn",
        "recover.faults=[{step: 4, replica: 1, phase: forward}]",
        "recover.rejoin.join_timeout_s=120",
    ]
    job = ClusterJob(cluster, tmp_path, CONFIG, sets(extra), nodes=3, spares=1)
    ranks = job.ranks()
    training = {r["host"] for r in ranks}
    spare = next(n for n in cluster.names if n not in training)
    root = next(r for r in ranks if r["rank"] == 0)
    deadline = time.monotonic() + 180
    while not job.processes_on(spare):
        assert time.monotonic() < deadline, f"no process spawned on {spare}\n{job.log()[-4000:]}"
        time.sleep(0.01)
    assert cluster.signal(root["host"], root["pid"], signal.SIGKILL), root

    def failed_join() -> bool:
        return any(i["kind"] == "rejoin" and i["status"] == "failed" for i in read_incidents(job.run_dir))

    job.wait_until(failed_join, "the failed re-join")
    failed_at = time.monotonic()
    job.wait_until(lambda: not job.processes_on(spare), f"the spawned process on {spare} gone")
    gone_s = time.monotonic() - failed_at
    log = job.finish()

    assert_trained_like_plain(job, plain, [0, 1, 2])
    incidents = read_incidents(job.run_dir)
    failed = [i for i in incidents if i["kind"] == "rejoin" and i["status"] == "failed"]
    assert "a member failed during the spawn" in failed[0]["reason"], (failed, log[-4000:])
    # The spare was free again: replica 1 came back by a spawn onto it. Replica 0's node still
    # counts as used for Open MPI's runtime: its spawn cannot be placed, and a relaunch at full
    # width from node memory brings it back.
    assert any(i["kind"] == "rejoin" and i["status"] == "joined" and i["replicas"] == [1] for i in incidents)
    assert job.leftovers(cluster.names) == {}
    print(
        f"spawned process gone {gone_s:.1f} s after the failed join; incidents {[i['kind'] for i in incidents]}"
    )
