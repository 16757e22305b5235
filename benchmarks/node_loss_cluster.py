"""A node losing power under a training job on the emulated multi-node Slurm cluster: how long until
training commits again, in parts, relaunched from node memory or from the disk checkpoint.

The cluster is ``tests/helpers/emulated_cluster.py`` (4 nodes made of Linux namespaces on this
machine, a real slurmd in each; needs root, Slurm and munge). The job is the tiny CPU config, one
rank per node, ``dp=3`` on 3 nodes plus 1 spare, submitted with ``nanotron-recover slurm``. At a
committed step it picks, the benchmark takes replica 1's node's link down and SIGKILLs every process
of it (``--power-loss dark``, a real power loss: the peers hear nothing; ``reset`` leaves the link up,
so the peers get a connection reset at once). From the run's records and the power-off time:

- ``detect_s``: power off to the job's end (the supervisor ends it once the lost rank's host does
  not answer, or Open MPI's runtime ends it when it finds the lost daemon);
- ``cleanup_s``, ``probe_s``: the supervisor ends what is left and asks which nodes answer (at the
  same time: the probe starts when the job ends, so the two overlap);
- ``start_s``: the new ``mpirun`` to the state restored (snapshots: loaded on the nodes that kept
  them, sent over MPI to the spare) or the disk checkpoint chosen;
- ``first_step_s``: from there to the first commit (model built, state adopted, one step);
- ``loss_to_commit_s``: power off to that commit, and ``steps_redone``.

The relaunch floor on this machine is ``start_s + first_step_s`` of a job that restores nothing
heavier than the tiny model: three ranks starting Python, torch and MPI on 2 cores.

Writes ``benchmarks/results/node_loss_cluster.json`` and ``node_loss_cluster.md``.

    python benchmarks/node_loss_cluster.py [--repeats 3] [--steps 40] [--fault-step 8]
        [--sources snapshot,checkpoint] [--power-loss dark|reset] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.helpers: the emulated cluster

from common import describe, machine_info, markdown_table, write_report  # noqa: E402

from nanotron_recover.generation import read_relaunch  # noqa: E402
from nanotron_recover.logging import read_incidents, read_metrics  # noqa: E402
from tests.helpers.cluster_job import ClusterJob  # noqa: E402
from tests.helpers.emulated_cluster import emulated_cluster, unavailable_reason  # noqa: E402

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
PARTS = ("detect_s", "cleanup_s", "probe_s", "start_s", "first_step_s", "loss_to_commit_s")


def job_sets(steps: int, source: str, run_dir: Path) -> list[str]:
    sets = [
        "parallelism.dp=3",
        "tokens.batch_accumulation_per_replica=4",
        f"tokens.train_steps={steps}",
        "data_stages.0.data.dataset=null",
        "recover.enabled=true",
        "recover.heartbeat_period_s=1",
        "recover.heartbeat_timeout_s=5",
        "recover.watchdog_timeout_s=120",
        "recover.gate_timeout_s=30",
    ]
    if source == "checkpoint":
        sets += [
            "recover.snapshot.interval=0",
            "checkpoints.checkpoint_interval=5",
            f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        ]
    return sets


def one_loss(cluster, work: Path, steps: int, fault_step: int, source: str, dark: bool = True) -> dict:
    work.mkdir(parents=True)
    job = ClusterJob(cluster, work, CONFIG, job_sets(steps, source, work / "run"), nodes=3, spares=1)
    victim = job.host_of(1)
    job.wait_for_step(fault_step)
    off_at = time.time()
    cluster.power_off(victim, drop_link=dark)
    job.finish()
    relaunch = read_relaunch(job.run_dir)
    incident = next(i for i in read_incidents(job.run_dir) if i["kind"] == "node_lost")
    commit = next(r for r in read_metrics(job.run_dir) if r["step"] == incident["step"])
    cluster.power_on(victim)
    return {
        "state_from": incident["state_from"],
        "restored_step": incident["restored_step"],
        "steps_redone": incident["steps_redone"],
        "detect_s": relaunch.ended_at - off_at,
        "cleanup_s": incident["cleanup_s"],
        "probe_s": incident["probe_s"],
        "start_s": incident["start_s"],
        "first_step_s": incident["first_step_s"],
        "loss_to_commit_s": commit["time"] - off_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=8)
    parser.add_argument("--sources", default="snapshot,checkpoint", help="state sources to measure")
    parser.add_argument(
        "--power-loss",
        choices=["dark", "reset"],
        default="dark",
        help="dark (default): the node's link goes down first, as with a real power loss, so peers "
        "learn of it from silence only; reset: its processes are killed with the link up (peers get "
        "a connection reset at once, kinder than a real power loss)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    sources = args.sources.split(",")
    dark = args.power_loss == "dark"
    reason = unavailable_reason()
    if reason:
        sys.exit(f"no emulated cluster on this machine: {reason}")
    results: dict = {
        "machine": machine_info(),
        "power_loss": args.power_loss,
        "runs": {source: [] for source in sources},
    }
    with tempfile.TemporaryDirectory() as tmp, emulated_cluster(n_nodes=4, cpus_per_node=2) as cluster:
        for k in range(args.repeats):
            for source in sources:
                cluster.wait_nodes_idle(timeout_s=120)
                run = one_loss(cluster, Path(tmp, f"{source}{k}"), args.steps, args.fault_step, source, dark)
                results["runs"][source].append(run)
                print(source, {k: round(v, 2) if isinstance(v, float) else v for k, v in run.items()})
    results["median"] = {
        source: {p: statistics.median(r[p] for r in runs) for p in (*PARTS, "steps_redone")}
        for source, runs in results["runs"].items()
    }
    lines = ["# A node losing power, on the emulated cluster", "", describe(results["machine"]), ""]
    lines += [
        "4 emulated nodes (namespaces, one slurmd each) on this machine; dp=3 on 3 nodes + 1 spare, one rank",
        f"per node; replica 1's node powered off after step {args.fault_step} of {args.steps}; medians of "
        f"{args.repeats} runs per source. Disk: a checkpoint every 5 steps. Power loss: "
        + (
            "dark (the node's link dropped first: peers learn of it from silence, as with a real one)."
            if dark
            else "reset (processes killed with the link up: peers get a connection reset at once)."
        ),
        "",
    ]
    rows = [
        [source, *[f"{m[p]:.2f}" for p in PARTS], f"{m['steps_redone']:g}"]
        for source, m in results["median"].items()
    ]
    lines += markdown_table(
        ["state from", *[p.removesuffix("_s") + " s" for p in PARTS], "steps redone"], rows
    )
    write_report(args.out, "node_loss_cluster", results, lines)


if __name__ == "__main__":
    main()
