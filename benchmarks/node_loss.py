"""A job lost as a whole, on this machine: the relaunch from node memory against the one from the disk
checkpoint, and what node-memory snapshots cost a fault-free step.

One host stands in for a cluster that lost a node: every rank of the job is killed at once (an
injected kill of every replica in the forward pass of ``--fault-step``), which is what Open MPI's
runtime does to the healthy replicas when it loses a node's daemon. The supervisor relaunches the
job; from the run's records:

- ``detect_s``: the kill to the supervisor finding the job ended without an outcome;
- ``restart_s``: from there to the relaunched job's first commit (start-up, MPI, the restore, the
  redone step), from the relaunch incident;
- ``loss_to_commit_s``: the kill to that commit; ``steps_redone`` and where the state came from.

The steady cost: the median fault-free step time with ``recover.snapshot.interval`` 1 and 0, same
run length, two model sizes.

Not measured here: a node lost on a multi-node cluster (the runtime's own detection of a lost
daemon, hosts probed, state received over the network).

Writes ``benchmarks/results/node_loss.json`` and ``node_loss.md``.

    python benchmarks/node_loss.py [--steps 12] [--fault-step 6] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import describe, machine_info, markdown_table, run_training, write_report

from nanotron_recover.demo import tiny_config_path
from nanotron_recover.ft.records import read_records
from nanotron_recover.generation import read_relaunch
from nanotron_recover.logging import read_incidents, read_metrics

MODELS = {
    "hidden 64, 2 layers": [],
    "hidden 256, 4 layers": [
        "model.model_config.hidden_size=256",
        "model.model_config.intermediate_size=512",
        "model.model_config.num_hidden_layers=4",
    ],
}
COMMON = ["parallelism.dp=2", "tokens.batch_accumulation_per_replica=2", "recover.enabled=true"]


def relaunch(run_dir: Path, steps: int, fault_step: int, source: str) -> dict:
    sets = [
        *COMMON,
        f"tokens.train_steps={steps}",
        f"recover.snapshot.dir={run_dir / 'node_memory'}",
        f"recover.faults=[{{step: {fault_step}, replica: 0}}, {{step: {fault_step}, replica: 1}}]",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
    ]
    if source == "checkpoint":
        sets += ["recover.snapshot.interval=0", "checkpoints.checkpoint_interval=2"]
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "launch", "--config", str(tiny_config_path())]
    cmd += ["--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        cmd, check=True, timeout=1800, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    killed_at = min(r["time"] for r in read_records(run_dir))
    ended_at = read_relaunch(run_dir).ended_at
    (incident,) = [i for i in read_incidents(run_dir) if i["kind"] in ("job_lost", "node_lost")]
    commit = next(r for r in read_metrics(run_dir) if r["step"] == incident["step"])
    return {
        "state_from": incident["state_from"],
        "restored_step": incident["restored_step"],
        "steps_redone": incident["steps_redone"],
        "detect_s": ended_at - killed_at,
        "restart_s": incident["restart_s"],
        "loss_to_commit_s": commit["time"] - killed_at,
    }


def step_time(run_dir: Path, model: list[str], steps: int, interval: int) -> float:
    sets = [*COMMON, *model, f"tokens.train_steps={steps}", f"recover.snapshot.interval={interval}"]
    sets += [f"recover.snapshot.dir={run_dir / 'node_memory'}"]
    run_training(run_dir, sets, nproc=2)
    return statistics.median(r["step_time_s"] for r in read_metrics(run_dir) if r["step"] > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fault-step", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    results: dict = {"machine": machine_info(), "relaunch": {}, "snapshot_cost": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for source in ("snapshot", "checkpoint"):
            results["relaunch"][source] = relaunch(
                Path(tmp, f"relaunch_{source}"), args.steps, args.fault_step, source
            )
        for name, model in MODELS.items():
            on = step_time(Path(tmp, f"{name}_on".replace(" ", "_")), model, args.steps, 1)
            off = step_time(Path(tmp, f"{name}_off".replace(" ", "_")), model, args.steps, 0)
            results["snapshot_cost"][name] = {
                "step_s_with": on,
                "step_s_without": off,
                "overhead": on / off - 1,
            }
    lines = ["# A job lost as a whole, relaunched", "", describe(results["machine"]), ""]
    lines += [
        f"Every rank killed in step {args.fault_step} of {args.steps}; 2 replicas; the supervisor relaunches.",
        "",
    ]
    rows = [
        [
            s,
            r["restored_step"],
            r["steps_redone"],
            f"{r['detect_s']:.2f}",
            f"{r['restart_s']:.2f}",
            f"{r['loss_to_commit_s']:.2f}",
        ]
        for s, r in results["relaunch"].items()
    ]
    lines += markdown_table(
        ["state from", "restored step", "steps redone", "detect s", "restart s", "loss to commit s"], rows
    )
    lines += ["", "Snapshot every committed step, median step time (2 replicas, 2 ranks on 2 cores):", ""]
    rows = [
        [
            m,
            f"{c['step_s_without'] * 1000:.1f} ms",
            f"{c['step_s_with'] * 1000:.1f} ms",
            f"{100 * c['overhead']:+.1f}%",
        ]
        for m, c in results["snapshot_cost"].items()
    ]
    lines += markdown_table(["model", "no snapshots", "snapshots", "cost"], rows)
    write_report(args.out, "node_loss", results, lines)


if __name__ == "__main__":
    main()
