"""A long chaos campaign on the emulated multi-node Slurm cluster: every fault kind, node kinds
included, sent from outside to a training job that runs across 6 nodes.

The cluster is ``tests/helpers/emulated_cluster.py`` (6 nodes made of Linux namespaces on this
machine, a real slurmd in each; needs root, Slurm and munge). The job is the tiny CPU model
(hidden 32) in exact mode, ``dp=3`` with one rank per node and 3 spare nodes for re-joins and
relaunches, submitted with ``sbatch`` from the script ``nanotron-recover slurm`` renders. The
campaign runner drives it through the cluster target (``tests/helpers/chaos_cluster.py``):
``--faults`` faults drawn with ``--seed`` from every kind (rank kinds, and node kinds: power off,
link cut, node freeze, each node given back ``--restore-after-s`` later). The batch host (the node
of the job script and ``mpirun``, a single point of failure) gets no node fault and no SIGSTOP.

Writes ``benchmarks/results/chaos.json`` (the campaign's record: the schedule to replay, every
fault with its target, reaction, time to the next commit and to full width, steps redone; the
incidents; the totals; the machine) and ``chaos.md``: a summary (faults sent, time to the next
commit per kind, steps redone, share of wall time at full width, relaunches, failed re-joins,
healthy ranks declared dead, hangs) followed by the per-fault table.

    python benchmarks/chaos_cluster.py [--seed 5] [--faults 44] [--steps 700] [--replay chaos.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.helpers: the emulated cluster and its chaos target

from common import describe, machine_info, markdown_table  # noqa: E402

from nanotron_recover.chaos.kinds import KINDS  # noqa: E402
from nanotron_recover.chaos.report import markdown  # noqa: E402
from nanotron_recover.chaos.schedule import draw_schedule, load_schedule  # noqa: E402
from tests.helpers.chaos_cluster import run_cluster_campaign  # noqa: E402
from tests.helpers.emulated_cluster import emulated_cluster, unavailable_reason  # noqa: E402

CONFIG = REPO / "configs" / "tiny_cpu.yaml"
N_NODES, DP = 6, 3


def campaign_sets(steps: int, checkpoint_interval: int, commit_timeout_s: float) -> list[str]:
    return [
        "model.model_config.hidden_size=32",
        "model.model_config.intermediate_size=64",
        "tokens.sequence_length=32",
        "tokens.micro_batch_size=1",
        f"tokens.train_steps={steps}",
        f"parallelism.dp={DP}",
        "tokens.batch_accumulation_per_replica=2",
        "data_stages.0.data.dataset=null",
        "recover.enabled=true",
        "recover.exact=true",
        "recover.rejoin.mode=spawn",
        "recover.rejoin.max_failures_per_replica=100",
        "recover.rejoin.max_spawns=100",
        "recover.rejoin.join_timeout_s=60",
        "recover.heartbeat_period_s=1",
        "recover.heartbeat_timeout_s=5",
        "recover.watchdog_timeout_s=120",
        "recover.gate_timeout_s=30",
        f"recover.commit_timeout_s={commit_timeout_s:g}",
        f"checkpoints.checkpoint_interval={checkpoint_interval}",
        "checkpoints.save_final_state=false",
    ]


def per_kind(record: dict) -> list[list[str]]:
    """Per kind: faults sent, time to the next commit (median, max), to full width (median, max),
    steps redone, relaunches in their windows."""
    rows = []
    kinds = dict.fromkeys(f["kind"] for f in record["faults"])
    for kind in kinds:
        faults = [f for f in record["faults"] if f["kind"] == kind and f.get("sent_at") is not None]
        nxt = [f["to_next_commit_s"] for f in faults if f.get("to_next_commit_s") is not None]
        full = [f["to_full_width_s"] for f in faults if f.get("to_full_width_s") is not None]

        def stat(values: list[float]) -> str:
            return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"

        rows.append(
            [
                kind,
                str(len(faults)),
                stat(nxt),
                stat(full),
                str(sum(f["steps_redone"] for f in faults)),
                str(sum(len(f["relaunches"]) for f in faults)),
                str(sum(1 for f in faults if f["reaction"])),
            ]
        )
    return rows


def summary_lines(record: dict, args: argparse.Namespace, machine: dict) -> list[str]:
    t = record["totals"]
    nxt = [f["to_next_commit_s"] for f in record["faults"] if f.get("to_next_commit_s") is not None]
    slurm = record["slurm"]
    incident_kinds = [i.get("kind") for i in record["incidents"]]
    lines = [
        "# A chaos campaign on the emulated multi-node cluster",
        "",
        f"{describe(machine)}. `python benchmarks/chaos_cluster.py --seed {args.seed} --faults {args.faults} "
        f"--steps {args.steps}`: {N_NODES} emulated Slurm nodes (namespaces, one slurmd each) on this machine, "
        f"dp={DP} of the tiny model (hidden 32) with one rank per node and {N_NODES - DP} spare nodes, "
        "exact mode, re-join on, node-memory snapshots every step, a checkpoint every "
        f"{args.checkpoint_interval} steps, heartbeat 1 s / 5 s, commit deadline {args.commit_timeout_s:g} s. "
        f"Node faults are given back (powered on, linked, thawed) {args.restore_after_s:g} s later; the batch "
        f"host ({slurm['batch_host']}: job script, supervisor, mpirun) gets no node fault and no SIGSTOP.",
        "",
        f"Verdict: **exit {record['exit_status']}**: {record['verdict']}. Slurm job {slurm['job_id']}: "
        f"{slurm['state']} (exit code {slurm['exit_code']}).",
        "",
        "| total | value |",
        "|---|---|",
        f"| faults sent / planned | {t['faults_sent']} / {t['faults_planned']} |",
        f"| faults with a recorded reaction | {t['faults_with_reaction']} |",
        f"| wall time of the campaign | {t['wall_s'] / 60:.1f} min |",
        "| fault -> next commit: median / p90 / max | "
        + (
            f"{statistics.median(nxt):.1f} / {sorted(nxt)[int(0.9 * (len(nxt) - 1))]:.1f} / {max(nxt):.1f} s |"
            if nxt
            else "- |"
        ),
        f"| steps redone (relaunches) | {sum(f['steps_redone'] for f in record['faults'])} |",
        f"| share of wall time at full width ({DP} replicas) | "
        + (f"{t['full_width_share']:.1%} |" if t["full_width_share"] is not None else "- |"),
        f"| relaunches (node_lost / job_lost / stalled / regrow) | {t['relaunches']} "
        f"({incident_kinds.count('node_lost')} / {incident_kinds.count('job_lost')} / "
        f"{incident_kinds.count('stalled')} / {incident_kinds.count('regrow')}) |",
        f"| re-joins joined / failed / given up | {t['rejoins_joined']} / {t['rejoins_failed']} / "
        f"{t['rejoins_given_up']} |",
        f"| healthy ranks declared dead | {t['healthy_ranks_declared_dead']} |",
        f"| hangs (no commit past the runner's bound) | {'1: ' + t['hang']['message'] if t['hang'] else 0} |",
        f"| equal to the plain run, bit for bit | {'yes' if t['equal_to_plain'] else 'no'} |",
        f"| final replicas | {t['final_replicas']} |",
        "",
        "Per kind (times in s, median / max):",
        "",
        *markdown_table(
            [
                "kind",
                "sent",
                "-> next commit",
                "-> full width",
                "steps redone",
                "relaunches",
                "with a reaction",
            ],
            per_kind(record),
        ),
        "",
        "Node faults given back: "
        + (
            ", ".join(
                f"{e['node']} {e['kind']} ({e['restored']} after {e['restored_after_s']:.0f} s)"
                if e["restored_after_s"] is not None
                else f"{e['node']} {e['kind']} (not restored: {e['restore_error']})"
                for e in record["node_faults"]
            )
            or "none"
        )
        + ".",
        "",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--faults", type=int, default=44)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--first-step", type=int, default=10)
    parser.add_argument("--min-gap", type=int, default=14)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--checkpoint-interval", type=int, default=20)
    parser.add_argument("--commit-timeout-s", type=float, default=45)
    parser.add_argument("--restore-after-s", type=float, default=15)
    parser.add_argument("--timeout-s", type=float, default=2700)
    parser.add_argument("--replay", type=Path, help="a chaos.json (or chaos_schedule.json) to send again")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "chaos_cluster_logs",
        help="where the job's Slurm output, the runner's log and the incidents are copied",
    )
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"no emulated cluster on this machine: {reason}")
    if args.replay is not None:
        schedule = load_schedule(args.replay)
    else:
        last = args.steps - 30
        schedule = draw_schedule(
            args.seed,
            args.faults,
            [k.strip() for k in args.kinds.split(",") if k.strip()],
            dp=DP,
            replica_size=1,
            first_step=args.first_step,
            last_step=last,
            min_gap=args.min_gap,
        )
    machine = machine_info()
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with emulated_cluster(n_nodes=N_NODES, cpus_per_node=2, slurmd_timeout_s=300) as cluster:
            record = run_cluster_campaign(
                cluster,
                work,
                CONFIG,
                campaign_sets(args.steps, args.checkpoint_interval, args.commit_timeout_s),
                schedule,
                nodes=DP,
                spares=N_NODES - DP,
                timeout_s=args.timeout_s,
                restore_after_s=args.restore_after_s,
                ready_timeout_s=120,
            )
        run_dir = work / "run"
        record["machine"] = machine
        record["benchmark"] = {
            "command": " ".join(sys.argv),
            "seed": args.seed,
            "wall_s_with_cluster": time.time() - started,
        }
        slurm_log = Path(record["slurm"]["log"])
        record["slurm_log_tail"] = (
            slurm_log.read_text(errors="replace").splitlines()[-200:] if slurm_log.exists() else []
        )
        record["replay"] = "python benchmarks/chaos_cluster.py --replay benchmarks/results/chaos.json"
        lines = summary_lines(record, args, machine)
        table = markdown(record).replace("# Chaos campaign\n", "")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chaos.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        (args.out / "chaos.md").write_text("\n".join(lines) + "\n" + table)
        print((args.out / "chaos.md").read_text())
        keep = args.keep_logs  # the job's whole output, for the evidence behind a finding
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("chaos_job.log", "incidents.jsonl"):
            if (run_dir / name).exists():
                (keep / name).write_text((run_dir / name).read_text(errors="replace"))
        if slurm_log.exists():
            (keep / "slurm.out").write_text(slurm_log.read_text(errors="replace"))
    return 0 if record["exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
