"""Step time of a fault-free job on the emulated cluster, by where its replicas' processes came from:
all started by ``mpirun`` (launch ranks), one of them replaced by a re-join's spawned process, then
two.

The chaos campaigns showed the same job stepping at very different speeds at full width: in
``chaos_sparse.md`` every stretch after a re-join that spawned two replicas at once ran at 0.04-0.07 s per step with no step
over 3 times the median, every other stretch at 0.14-0.23 s with a fifth of the steps over 3 times
the median and all 113 steps over 10 times it (up to 7 s, counted as not at full width). This
benchmark tests whether the processes' origin explains that (measured: it does not; see
``docs/architecture.md``, faults in sequence): dp=3, one rank per node on 3 of 6 emulated nodes,
the tiny CPU model in exact mode; after ``--phase-steps`` steps replica 1's rank is SIGKILLed (repaired in place, its
replacement spawned on a spare node), ``--phase-steps`` steps later replica 2's. Each phase's steps
(the first ``--skip`` after a change left out) are summarised from ``metrics.jsonl``: step time and
its parts (compute, the DP reduction, the commit agree), median and mean, and the share of steps
over 3 and 10 times the first phase's median.

Each node's processes run on its own share of the 2 CPUs (``node_cpus`` of the emulated cluster);
``--free-cpus`` lets them run on any CPU, as the first runs did. Measured so, the speed depended on
neither the origin nor anything in the job, but on how the kernel placed the three busy ranks.

Writes ``benchmarks/results/step_time_by_origin.json`` and ``.md`` (``step_time_by_origin_together`` with
``--together``; ``_free_cpus`` added with ``--free-cpus``).

    python benchmarks/step_time_by_origin.py [--phase-steps 250] [--skip 20] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.helpers: the emulated cluster

from common import describe, machine_info, markdown_table, write_report  # noqa: E402

from nanotron_recover.logging import read_metrics  # noqa: E402
from tests.helpers.chaos_cluster import render_job  # noqa: E402
from tests.helpers.emulated_cluster import emulated_cluster, unavailable_reason  # noqa: E402

CONFIG = REPO / "configs" / "tiny_cpu.yaml"
PARTS = ("step_time_s", "compute_s", "reduce_s", "agree_s")
PHASES = ("3 launch ranks", "2 launch + 1 spawned", "1 launch + 2 spawned")
PHASES_TOGETHER = ("3 launch ranks", "1 launch + 2 spawned at once", "the same, later")


def job_sets(steps: int, run_dir: Path) -> list[str]:
    return [
        "model.model_config.hidden_size=32",
        "model.model_config.intermediate_size=64",
        "tokens.sequence_length=32",
        "tokens.micro_batch_size=1",
        f"tokens.train_steps={steps}",
        "parallelism.dp=3",
        "tokens.batch_accumulation_per_replica=2",
        "data_stages.0.data.dataset=null",
        "recover.enabled=true",
        "recover.exact=true",
        "recover.rejoin.mode=spawn",
        "recover.heartbeat_period_s=1",
        "recover.heartbeat_timeout_s=5",
        "checkpoints.checkpoint_interval=20",
        "checkpoints.save_final_state=false",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
    ]


def last_step(run_dir: Path) -> int:
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    return rows[-1]["step"] if rows else 0


def wait_step(run_dir: Path, step: int, job: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while last_step(run_dir) < step:
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job did not reach step {step} (last {last_step(run_dir)})")
        time.sleep(0.3)


def one_run(
    cluster, work: Path, phase_steps: int, timeout_s: float, together: bool, extra: list[str]
) -> dict:
    run_dir = (work / "run").resolve()
    run_dir.mkdir(parents=True)
    steps = 3 * phase_steps
    script = render_job(
        cluster,
        CONFIG,
        run_dir,
        job_sets(steps, run_dir),
        nodes=3,
        spares=3,
        job_name="steptime",
        time_min=30,
    )
    env = dict(os.environ, **cluster.mpi_env, OMP_NUM_THREADS="1")
    job = subprocess.Popen(["sbatch", "--wait", str(script)], env=env, stdout=subprocess.DEVNULL)
    changes = []
    try:
        rounds = [(1,), (2,)] if not together else [(1, 2), ()]
        for k, replicas in enumerate(rounds, start=1):
            wait_step(run_dir, k * phase_steps, job, timeout_s)
            table = json.loads((run_dir / "ranks.json").read_text())
            for victim in [r for r in table if r["replica"] in replicas]:
                cluster.signal(victim["host"], victim["pid"], signal.SIGKILL)
            changes.append(last_step(run_dir))
        job.wait(timeout=timeout_s)
    finally:
        if job.poll() is None:
            job.kill()
    rows = read_metrics(run_dir)
    return {"exit": job.returncode, "changes": changes, "rows": rows}


def summarise(rows: list[dict], changes: list[int], skip: int, names: tuple[str, ...] = PHASES) -> list[dict]:
    bounds = [0, *changes, rows[-1]["step"]]
    phases = []
    for name, (lo, hi) in zip(names, zip(bounds, bounds[1:], strict=False), strict=True):
        part = [r for r in rows if lo + skip < r["step"] <= hi and r["replicas"] == 3]
        phases.append(
            {"phase": name, "steps": len(part)}
            | {
                p: {
                    "median": statistics.median(r[p] for r in part),
                    "mean": statistics.mean(r[p] for r in part),
                }
                for p in PARTS
            }
            | {"times": [r["step_time_s"] for r in part]}
        )
    base = phases[0]["step_time_s"]["median"]
    for ph in phases:
        times = ph.pop("times")
        ph["over_3x"] = sum(t > 3 * base for t in times) / len(times)
        ph["over_10x"] = sum(t > 10 * base for t in times) / len(times)
        ph["max_s"] = max(times)
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-steps", type=int, default=250)
    parser.add_argument("--skip", type=int, default=20, help="steps left out after each change")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--together",
        action="store_true",
        help="kill replicas 1 and 2 at once (one re-join spawns both into one world); the third phase "
        "is then the second's continuation",
    )
    parser.add_argument("--set", action="append", default=[], help="a config override for the job")
    parser.add_argument(
        "--free-cpus",
        action="store_true",
        help="every node's processes on any CPU (results *_free_cpus); by default each node has its own share",
    )
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"no emulated cluster on this machine: {reason}")
    results: dict = {
        "machine": machine_info(),
        "phase_steps": args.phase_steps,
        "skip": args.skip,
        "runs": [],
    }
    cluster_args = {"n_nodes": 6, "cpus_per_node": 2, "node_cpus": not args.free_cpus}
    with tempfile.TemporaryDirectory() as tmp, emulated_cluster(**cluster_args) as cluster:
        for k in range(args.repeats):
            cluster.wait_nodes_idle(timeout_s=120)
            run = one_run(
                cluster, Path(tmp, f"run{k}"), args.phase_steps, args.timeout_s, args.together, args.set
            )
            phases = summarise(
                run["rows"], run["changes"], args.skip, PHASES_TOGETHER if args.together else PHASES
            )
            results["runs"].append({"exit": run["exit"], "changes": run["changes"], "phases": phases})
            for ph in phases:
                print(ph["phase"], round(ph["step_time_s"]["mean"], 4), round(ph["over_10x"], 3), flush=True)
    lines = ["# Step time by where the replicas' processes came from, on the emulated cluster", ""]
    lines += [describe(results["machine"]), ""]
    lines += [
        "dp=3 of the tiny model in exact mode, one rank per node on 3 of 6 emulated nodes (2 cores in all, "
        + (
            "every process on any of them);"
            if args.free_cpus
            else "each node's processes on its own: odd nodes on one, even nodes on the other; a spawned process "
            "on the batch host's);"
        ),
        (
            f"replicas 1 and 2 SIGKILLed together after step {args.phase_steps} (one re-join spawns both),"
            if args.together
            else f"replica 1's rank SIGKILLed after step {args.phase_steps} (its replacement spawned on a "
            f"spare node), replica 2's after step {2 * args.phase_steps};"
        ),
        f"the first {args.skip} steps after each change left out. Times in ms, median / mean; 'over 3x'",
        "and 'over 10x': steps slower than 3 and 10 times the first phase's median step.",
        "",
    ]
    rows = []
    for i, run in enumerate(results["runs"]):
        for ph in run["phases"]:
            cells = [f"{1e3 * ph[p]['median']:.0f} / {1e3 * ph[p]['mean']:.0f}" for p in PARTS]
            rows.append([i, ph["phase"], ph["steps"], *cells, f"{100 * ph['over_3x']:.0f}%",
                         f"{100 * ph['over_10x']:.1f}%", f"{ph['max_s']:.2f}"])  # fmt: skip
    lines += markdown_table(
        [
            "run",
            "processes",
            "steps",
            "step",
            "compute",
            "reduce",
            "agree",
            "over 3x",
            "over 10x",
            "max step s",
        ],
        rows,
    )
    name = (
        "step_time_by_origin"
        + ("_together" if args.together else "")
        + ("_free_cpus" if args.free_cpus else "")
    )
    write_report(args.out, name, results, lines)


if __name__ == "__main__":
    main()
