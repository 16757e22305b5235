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
Each node's processes run on its own share of this machine's CPUs (``node_cpus``: on 2 CPUs, the
odd nodes on one, the even ones on the other), as a node's processes would on a cluster;
``--free-cpus`` lets the kernel move them over every CPU, as the campaigns before it did.

A job that fails (or hangs) before its faults are all sent is a result, not the end of the
campaign: as an operator would, the benchmark submits a fresh job (a new run of the same config,
on the same cluster) and sends it the faults the failed one did not get, re-based to its steps;
each job is one *segment*, judged on its own against the plain run, until every fault is sent or
``--budget-s`` has passed.

Writes ``benchmarks/results/chaos.json`` (the schedule to replay, each segment's campaign record:
every fault with its target, reaction, time to the next commit and to full width, steps redone;
the incidents; the totals; the Slurm job; and the totals over all segments) and ``chaos.md``: a
summary (faults sent, time to the next commit per kind, steps redone, share of wall time at full
width, relaunches, failed re-joins, healthy ranks declared dead, relaunches at full width, hangs,
failed jobs) followed by each segment's per-fault table.

    python benchmarks/chaos_cluster.py [--seed 5] [--faults 44] [--steps 600] [--replay chaos.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.helpers: the emulated cluster and its chaos target

from common import describe, machine_info, markdown_table, portable, write_json  # noqa: E402

from nanotron_recover.chaos.kinds import KINDS  # noqa: E402
from nanotron_recover.chaos.reference import start_reference  # noqa: E402
from nanotron_recover.chaos.report import markdown  # noqa: E402
from nanotron_recover.chaos.schedule import Schedule, draw_schedule, schedule_from_dict  # noqa: E402
from nanotron_recover.config import load_config  # noqa: E402
from nanotron_recover.errors import InputError  # noqa: E402
from tests.helpers.chaos_cluster import run_cluster_campaign  # noqa: E402
from tests.helpers.emulated_cluster import emulated_cluster, unavailable_reason  # noqa: E402

CONFIG = REPO / "configs" / "tiny_cpu.yaml"
N_NODES, DP = 6, 3


# The slowest step seen on this machine's emulated cluster (0.12-0.23 s in the runs with shared
# CPUs); a segment's time limit covers its steps at that pace besides the budget left.
SLOW_STEP_S = 0.25


def segment_timeout_s(budget_left_s: float, steps: int) -> float:
    """A segment's time limit: what is left of ``--budget-s`` (which says when no *new* segment
    starts), but never less than its steps at :data:`SLOW_STEP_S`: a limit from the budget alone
    ended a 135,000-step campaign run with the default budget at step 47,391 of a healthy job,
    and its plain reference with it, with no report."""
    return max(600.0, budget_left_s + 600.0, steps * SLOW_STEP_S + 600.0)


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


def per_kind(faults: list[dict]) -> list[list[str]]:
    """Per kind: faults sent, time to the next commit (median, max), to full width (median, max),
    steps redone, relaunches in their windows, faults with a recorded reaction."""
    rows = []
    for kind in dict.fromkeys(f["kind"] for f in faults):
        sent = [f for f in faults if f["kind"] == kind and f.get("sent_at") is not None]
        nxt = [f["to_next_commit_s"] for f in sent if f.get("to_next_commit_s") is not None]
        full = [f["to_full_width_s"] for f in sent if f.get("to_full_width_s") is not None]

        def stat(values: list[float]) -> str:
            return f"{statistics.median(values):.1f} / {max(values):.1f}" if values else "-"

        rows.append(
            [
                kind,
                str(len(sent)),
                stat(nxt),
                stat(full),
                str(sum(f["steps_redone"] for f in sent)),
                str(sum(len(f["relaunches"]) for f in sent)),
                str(sum(1 for f in sent if f["reaction"])),
            ]
        )
    return rows


def rebase(faults: list, first_step: int, steps: int, schedule: Schedule) -> Schedule:
    """The faults a failed job did not get, for a fresh job: the first at ``first_step``, the gaps
    kept (their indices too, so that the report names each fault as drawn)."""
    shift = faults[0].step - first_step
    moved = tuple(dataclasses.replace(f, step=f.step - shift) for f in faults)
    return dataclasses.replace(
        schedule, first_step=first_step, last_step=max(f.step for f in moved), faults=moved
    )


def totals_over(segments: list[dict], dp: int) -> dict:
    faults = [f for r in segments for f in r["faults"]]
    incidents = [i.get("kind") for r in segments for i in r["incidents"]]
    walls = [r["totals"]["wall_s"] for r in segments]
    shares = [(r["totals"]["full_width_share"], r["totals"]["wall_s"]) for r in segments]
    weighted = [(s, w) for s, w in shares if s is not None]
    nxt = sorted(f["to_next_commit_s"] for f in faults if f.get("to_next_commit_s") is not None)
    hangs = [r["totals"]["hang"] for r in segments if r["totals"]["hang"]]
    return {
        "segments": len(segments),
        "faults_sent": sum(r["totals"]["faults_sent"] for r in segments),
        "faults_with_reaction": sum(r["totals"]["faults_with_reaction"] for r in segments),
        "wall_s": sum(walls),
        "to_next_commit_s": {
            "median": statistics.median(nxt) if nxt else None,
            "p90": nxt[math.ceil(0.9 * len(nxt)) - 1] if nxt else None,  # nearest rank
            "max": max(nxt) if nxt else None,
            "over_90_s": sum(1 for v in nxt if v > 90),
        },
        "steps_redone": sum(f["steps_redone"] for f in faults),
        "full_width_share": sum(s * w for s, w in weighted) / sum(w for _, w in weighted)
        if weighted
        else None,
        "below_full_width_s": {
            where: sum(r["totals"].get("below_full_width", {}).get(where, 0.0) for r in segments)
            for where in ("in_fault_windows_s", "outside_s")
        },
        "relaunches": sum(r["totals"]["relaunches"] for r in segments),
        "relaunches_by_kind": {k: incidents.count(k) for k in ("node_lost", "job_lost", "stalled", "regrow")},
        "rejoins_joined": sum(r["totals"]["rejoins_joined"] for r in segments),
        "rejoins_failed": sum(r["totals"]["rejoins_failed"] for r in segments),
        "rejoins_given_up": sum(r["totals"]["rejoins_given_up"] for r in segments),
        "healthy_ranks_declared_dead": sum(r["totals"]["healthy_ranks_declared_dead"] for r in segments),
        "relaunches_at_full_width": sum(r["totals"].get("relaunches_at_full_width", 0) for r in segments),
        "hangs": sum(1 for h in hangs if h.get("kind") == "hang"),
        "campaign_timeouts": sum(1 for h in hangs if h.get("kind") == "timeout"),
        "jobs_failed": sum(1 for r in segments if r["totals"]["exit_status"] != 0),
        "jobs_completed_equal_to_plain": sum(
            1 for r in segments if r["totals"]["exit_status"] == 0 and r["totals"]["equal_to_plain"]
        ),
        "jobs_completed_not_equal": sum(
            1 for r in segments if r["totals"]["exit_status"] == 0 and not r["totals"]["equal_to_plain"]
        ),
    }


def summary_lines(result: dict, args: argparse.Namespace, machine: dict) -> list[str]:
    t = result["totals"]
    segments = result["segments"]
    nxt = t["to_next_commit_s"]
    batch = sorted({r["slurm"]["batch_host"] for r in segments if r["slurm"]["batch_host"]})
    lines = [
        "# A chaos campaign on the emulated multi-node cluster",
        "",
        f"{describe(machine)}. `python benchmarks/chaos_cluster.py --seed {args.seed} --faults {args.faults} "
        f"--steps {args.steps}{args.schedule_options}`: {N_NODES} emulated Slurm nodes (namespaces, one slurmd each) on this machine "
        + (
            "(every process on any CPU), "
            if args.free_cpus
            else "(each node's processes on its own share of the CPUs: odd nodes on one, even nodes on the other), "
        )
        + f"dp={DP} of the tiny model (hidden 32) with one rank per node and {N_NODES - DP} spare nodes, "
        "exact mode, re-join on, node-memory snapshots every step, a checkpoint every "
        f"{args.checkpoint_interval} steps, heartbeat 1 s / 5 s, commit deadline {args.commit_timeout_s:g} s. "
        f"Node faults are given back (powered on, linked, thawed) {args.restore_after_s:g} s later; the batch "
        f"host ({', '.join(batch)}: job script, supervisor, mpirun) gets no node fault and no SIGSTOP. A job "
        "that fails before its faults are sent is followed by a fresh one that gets the rest (a segment each).",
        "",
        "| total | value |",
        "|---|---|",
        f"| faults sent / drawn | {t['faults_sent']} / {args.faults} |",
        f"| faults with a recorded reaction | {t['faults_with_reaction']} |",
        f"| wall time of the campaign (all segments) | {t['wall_s'] / 60:.1f} min |",
        f"| wall time per fault sent | {t['wall_s'] / max(1, t['faults_sent']):.0f} s |",
        f"| jobs (segments) / failed | {t['segments']} / {t['jobs_failed']} |",
        f"| completed jobs equal to the plain run bit for bit / not equal | {t['jobs_completed_equal_to_plain']} / "
        f"{t['jobs_completed_not_equal']} |",
        "| fault -> next commit: median / p90 / max (over 90 s) | "
        + (
            f"{nxt['median']:.1f} / {nxt['p90']:.1f} / {nxt['max']:.1f} s ({nxt['over_90_s']}) |"
            if nxt["median"] is not None
            else "- |"
        ),
        f"| steps redone (relaunches) | {t['steps_redone']} |",
        f"| share of wall time at full width ({DP} replicas) | "
        + (f"{t['full_width_share']:.1%} |" if t["full_width_share"] is not None else "- |"),
        "| time not at full width: in the faults' windows (fault to full width) / outside them | "
        f"{t['below_full_width_s']['in_fault_windows_s']:.0f} / {t['below_full_width_s']['outside_s']:.0f} s |",
        f"| relaunches (node_lost / job_lost / stalled / regrow) | {t['relaunches']} ("
        + " / ".join(str(v) for v in t["relaunches_by_kind"].values())
        + ") |",
        f"| re-joins joined / failed / given up | {t['rejoins_joined']} / {t['rejoins_failed']} / "
        f"{t['rejoins_given_up']} |",
        f"| healthy ranks declared dead | {t['healthy_ranks_declared_dead']} |",
        f"| relaunches at full width (no fault's reaction) | {t['relaunches_at_full_width']} |",
        f"| hangs (no commit past the runner's bound) / campaign timeouts | {t['hangs']} / {t['campaign_timeouts']} |",
        "",
        "Per kind, all segments (times in s, median / max):",
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
            per_kind([f for r in segments for f in r["faults"]]),
        ),
        "",
        "| segment | Slurm job | state (exit) | faults sent | last step | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for k, r in enumerate(segments):
        lines.append(
            f"| {k} | {r['slurm']['job_id']} | {r['slurm']['state']} ({r['slurm']['exit_code']}) | "
            f"{r['totals']['faults_sent']} | {r['totals']['last_step']} / {r['totals']['target_step']} | "
            f"exit {r['exit_status']}: {r['verdict']} |"
        )
    return lines


# The options of a campaign's schedule and timing, besides seed, faults and steps.
SCHEDULE_OPTIONS = (
    "kinds",
    "first_step",
    "min_gap",
    "checkpoint_interval",
    "commit_timeout_s",
    "restore_after_s",
)


def non_default_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """Those of :data:`SCHEDULE_OPTIONS` that differ from their defaults, as given: the command a
    report shows then runs the same campaign."""
    words = []
    for name in SCHEDULE_OPTIONS:
        value = getattr(args, name)
        if value != parser.get_default(name):
            words.append(
                f" --{name.replace('_', '-')} {value:g}"
                if isinstance(value, float)
                else f" --{name.replace('_', '-')} {value}"
            )
    return "".join(words)


def main() -> int:
    # A SIGTERM ends the campaign like Ctrl-C: the cluster's context manager tears it down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--faults", type=int, default=44)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--first-step", type=int, default=10)
    parser.add_argument("--min-gap", type=int, default=12)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--checkpoint-interval", type=int, default=20)
    parser.add_argument("--commit-timeout-s", type=float, default=45)
    parser.add_argument("--restore-after-s", type=float, default=15)
    parser.add_argument("--budget-s", type=float, default=1800, help="no new segment after this")
    parser.add_argument("--replay", type=Path, help="a chaos.json of this benchmark: its schedule again")
    parser.add_argument(
        "--free-cpus",
        action="store_true",
        help="let every node's processes run on every CPU (by default each node has its own share, as on a cluster)",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--reference-dir",
        type=Path,
        help="where the plain reference runs are kept and reused (default: a temporary folder)",
    )
    parser.add_argument(
        "--reference-alongside",
        action="store_true",
        help="run the plain reference at the same time as the job, not before it: no wall time of its "
        "own, but it takes CPU from the job while both run, so the faults cost more, not less",
    )
    parser.add_argument(
        "--name",
        default="chaos",
        help="the results' file names: NAME.json and NAME.md (a sparse campaign kept beside the dense one)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=Path(tempfile.gettempdir()) / "chaos_cluster_logs",
        help="where each job's Slurm output, the runner's log and the incidents are copied",
    )
    args = parser.parse_args()
    args.schedule_options = non_default_options(args, parser)
    reason = unavailable_reason()
    if reason:
        sys.exit(f"no emulated cluster on this machine: {reason}")
    if args.replay is not None:
        schedule = schedule_from_dict(json.loads(args.replay.read_text())["schedule"])
    else:
        schedule = draw_schedule(
            args.seed,
            args.faults,
            [k.strip() for k in args.kinds.split(",") if k.strip()],
            dp=DP,
            replica_size=1,
            first_step=args.first_step,
            last_step=args.steps - 30,
            min_gap=args.min_gap,
        )
    machine = machine_info()
    started = time.time()
    segments: list[dict] = []
    sets = campaign_sets(args.steps, args.checkpoint_interval, args.commit_timeout_s)
    args.keep_logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        reference = None
        if args.reference_alongside:
            cfg = load_config(CONFIG, sets)
            reference = start_reference(
                CONFIG, cfg, sets, (args.reference_dir or work / "chaos_reference").resolve()
            )
            print(
                f"plain reference {'reused' if reference.reused else 'started'}: {reference.ref_dir}",
                flush=True,
            )
            stack.callback(reference.kill)  # ended early: killed before its folder is removed
        with emulated_cluster(
            n_nodes=N_NODES, cpus_per_node=2, slurmd_timeout_s=300, node_cpus=not args.free_cpus
        ) as cluster:
            remaining = list(schedule.faults)
            while remaining and time.time() - started < args.budget_s:
                if reference is not None:
                    try:
                        reference.check()  # a reference that failed ends the campaign now
                    except InputError as e:
                        print(f"the campaign ends: {e}", flush=True)
                        break
                cluster.wait_nodes_idle(timeout_s=180)
                k = len(segments)
                part = schedule if k == 0 else rebase(remaining, args.first_step, args.steps, schedule)
                left = args.budget_s - (time.time() - started)
                record = run_cluster_campaign(
                    cluster,
                    work / f"segment{k}",
                    CONFIG,
                    sets,
                    part,
                    nodes=DP,
                    spares=N_NODES - DP,
                    timeout_s=segment_timeout_s(left, args.steps),
                    restore_after_s=args.restore_after_s,
                    ready_timeout_s=120,
                    ref_root=args.reference_dir or work / "chaos_reference",
                    reference=reference,
                )
                run_dir = work / f"segment{k}" / "run"
                slurm_log = Path(record["slurm"]["log"])
                for name, src in (
                    ("chaos_job.log", run_dir / "chaos_job.log"),
                    ("incidents.jsonl", run_dir / "incidents.jsonl"),
                    ("slurm.out", slurm_log),
                ):
                    if src.exists():
                        (args.keep_logs / f"segment{k}-{name}").write_text(src.read_text(errors="replace"))
                record["slurm_log_tail"] = (
                    slurm_log.read_text(errors="replace").splitlines()[-120:] if slurm_log.exists() else []
                )
                segments.append(record)
                sent = {f["index"] for f in record["faults"] if f.get("sent_at") is not None}
                remaining = [f for f in remaining if f.index not in sent]
                print(
                    f"segment {k}: {len(sent)} faults sent, {len(remaining)} left: {record['verdict']}",
                    flush=True,
                )
                if record["exit_status"] in (0, 4) and record["totals"]["exit_status"] == 0:
                    break  # the job completed: faults not sent are the schedule's, not a failure's
    result = {
        "schedule": schedule.to_dict(),
        "replay": f"python benchmarks/chaos_cluster.py --replay benchmarks/results/{args.name}.json",
        "machine": machine,
        "benchmark": {"command": " ".join(sys.argv), "seed": args.seed, "wall_s": time.time() - started},
        "totals": totals_over(segments, DP),
        "segments": segments,
    }
    lines = summary_lines(result, args, machine)
    for k, record in enumerate(segments):
        record["replay"] = f"{result['replay']} (segment {k}: the faults it got, re-based to its steps)"
        table = markdown(record).replace("# Chaos campaign\n", f"## Segment {k}\n")
        lines += ["", table]
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / f"{args.name}.json", result, indent=1)
    (args.out / f"{args.name}.md").write_text(portable("\n".join(lines)).rstrip() + "\n")
    print((args.out / f"{args.name}.md").read_text())
    t = result["totals"]
    return 0 if t["jobs_failed"] == 0 and t["jobs_completed_not_equal"] == 0 and t["hangs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
