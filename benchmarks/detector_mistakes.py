"""Healthy ranks declared dead: how often ULFM's heartbeat detector makes a mistake on a busy
machine, and that a real freeze is still found within its timeout.

Fault-free forward-recovery jobs with more ranks than cores (``--ranks`` on this machine's cores:
8 ranks on 2 cores is 4x oversubscription), a node-memory snapshot after every step and a disk
checkpoint every ``--checkpoint-interval`` steps (writes that compete with the heartbeats). No fault
is injected, so every incident and every relaunch is a mistake: a healthy rank declared dead
("reported dead by someone else"). Each configuration runs ``--runs`` times.

The control: the same job, one rank SIGSTOPped from outside halfway; its ``hang`` incident's
``detect_s`` must stay within the heartbeat timeout (plus a period).

Writes ``benchmarks/results/detector_mistakes.json`` and ``.md``.

    python benchmarks/detector_mistakes.py [--ranks 8] [--runs 3] [--steps 60] [--timeouts 5,3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import describe, machine_info, markdown_table, write_report

from nanotron_recover.demo import tiny_config_path
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.outcome import read_outcome


def launch(run_dir: Path, ranks: int, steps: int, timeout_s: float, interval: int) -> subprocess.Popen:
    period = max(0.25, timeout_s / 5)
    sets = [
        f"parallelism.dp={ranks}",
        "tokens.batch_accumulation_per_replica=1",
        f"tokens.train_steps={steps}",
        "recover.enabled=true",
        f"recover.heartbeat_period_s={period:g}",
        f"recover.heartbeat_timeout_s={timeout_s:g}",
        f"recover.snapshot.dir={run_dir / 'node_memory'}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        f"checkpoints.checkpoint_interval={interval}",
        "checkpoints.save_final_state=false",
    ]
    cmd = [sys.executable, "-m", "nanotron_recover.cli", "launch", "--config", str(tiny_config_path())]
    cmd += ["--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, limit_s: float = 1200) -> int:
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def count(run_dir: Path) -> dict:
    incidents = read_incidents(run_dir)
    return {
        "exit": (read_outcome(run_dir) or {}).get("exit_code"),
        "steps": len(read_metrics(run_dir)),
        "declared_dead": sum(
            len(i.get("failed_ranks", [])) for i in incidents if i["kind"] in ("crash", "hang")
        ),
        "relaunches": sum(1 for i in incidents if i["kind"] in ("job_lost", "node_lost", "stalled")),
        "incidents": [(i["kind"], i["step"]) for i in incidents],
    }


def fault_free(tmp: Path, ranks: int, steps: int, timeout_s: float, interval: int, run: int) -> dict:
    run_dir = tmp / f"free_t{timeout_s:g}_{run}"
    run_dir.mkdir()
    started = time.monotonic()
    code = finish(launch(run_dir, ranks, steps, timeout_s, interval))
    return {**count(run_dir), "launch_exit": code, "wall_s": time.monotonic() - started}


def frozen(tmp: Path, ranks: int, steps: int, timeout_s: float, interval: int) -> dict:
    """One rank SIGSTOPped from outside at half the run: found within the timeout?"""
    run_dir = tmp / f"frozen_t{timeout_s:g}"
    run_dir.mkdir()
    proc = launch(run_dir, ranks, steps, timeout_s, interval)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        done = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if len(done) >= steps // 2:
            break
        time.sleep(0.2)
    table = json.loads((run_dir / "ranks.json").read_text())
    victim = table[-1]["pid"]
    os.kill(victim, signal.SIGSTOP)
    code = finish(proc)
    hangs = [i for i in read_incidents(run_dir) if i["kind"] == "hang"]
    return {
        **count(run_dir),
        "launch_exit": code,
        "detect_s": hangs[0]["detect_s"] if hangs else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-interval", type=int, default=5)
    parser.add_argument("--timeouts", default="5,3", help="heartbeat timeouts to measure, seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    timeouts = [float(t) for t in args.timeouts.split(",")]
    results: dict = {"machine": machine_info(), "args": vars(args) | {"out": str(args.out)}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for t in timeouts:
            free = [
                fault_free(Path(tmp), args.ranks, args.steps, t, args.checkpoint_interval, r)
                for r in range(args.runs)
            ]
            control = frozen(Path(tmp), args.ranks, args.steps, t, args.checkpoint_interval)
            results["runs"][f"{t:g}"] = {"fault_free": free, "frozen": control}
    over = args.ranks / (os.cpu_count() or 1)
    lines = ["# Healthy ranks declared dead on a busy machine", "", describe(results["machine"]), ""]
    lines += [
        f"{args.ranks} ranks on {os.cpu_count()} cores ({over:g}x oversubscribed), the tiny model, a "
        f"node snapshot every step and a checkpoint every {args.checkpoint_interval} steps, "
        f"{args.steps} steps, {args.runs} fault-free runs per heartbeat timeout; the control freezes "
        "one rank halfway.",
        "",
    ]
    rows = []
    for t, r in results["runs"].items():
        free = r["fault_free"]
        steps = sum(x["steps"] for x in free)
        dead = sum(x["declared_dead"] for x in free)
        rows.append(
            [
                t,
                len(free),
                steps,
                dead,
                sum(x["relaunches"] for x in free),
                sum(1 for x in free if x["exit"] == 0),
                "-" if r["frozen"]["detect_s"] is None else f"{r['frozen']['detect_s']:.1f}",
                r["frozen"]["exit"],
            ]
        )
    lines += markdown_table(
        [
            "heartbeat timeout s",
            "fault-free runs",
            "steps",
            "healthy ranks declared dead",
            "relaunches",
            "runs exit 0",
            "frozen rank found after s",
            "frozen run exit",
        ],
        rows,
    )
    write_report(args.out, "detector_mistakes", results, lines)


if __name__ == "__main__":
    main()
