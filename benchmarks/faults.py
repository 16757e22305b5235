"""The paper's comparison at the scale of this machine: forward recovery vs checkpoint-restart.

``W`` replicas train the tiny LLaMA; a replica fails every ``k`` steps until half of them are gone.
Runs: plain (no faults, the reference curve), recover (forward recovery, same faults), and
checkpoint-restart with several checkpoint intervals (the paper used 2, 16 and 64 steps), same
faults by step, each failure relaunching the whole job on ``W`` replicas (replacement hardware).

Per run: wall time, committed tokens, effective tokens/s per rank (committed tokens over the whole
wall time, every stall included, divided by the initial number of ranks), per-fault stall split into
what it is made of, and the max loss deviation from the plain run:

- forward recovery: ``detect`` (the failure to a survivor seeing it), ``repair`` (noticing to the
  commit, without the redone work) and ``redo`` (recomputing the lost micro-batches), from the
  incidents;
- checkpoint-restart: ``recompute`` (the steps between the last checkpoint and the failure, at the
  run's median step time) and ``relaunch`` (the rest: the job's exit, a new mpirun, start-up, load).

Two schedules:

- ``--quick`` (what ``benchmarks/simulate_validation.py`` and the simulator's test compare with):
  30 steps of the tiny model (a step ~0.03 s), a fault every 10 steps; writes ``faults.*``;
- the default, closer to the paper's: a fault every 5 steps until half the replicas are gone, 40 steps
  of a micro-batch 32x larger (16 x 256 tokens, a step ~1 s), so that recomputing from the last
  checkpoint weighs beside the relaunch; writes ``faults_paper.*``.

Each writes ``<name>.json``, ``<name>.md`` and ``<name>.png`` (loss per step for every run;
committed tokens over wall time) to ``--out``.

    python benchmarks/faults.py --quick        # about 2 minutes on 2 CPU cores
    python benchmarks/faults.py                # about 8 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from common import describe, machine_info, markdown_table, write_report  # noqa: E402

from nanotron_recover.config import load_config  # noqa: E402
from nanotron_recover.data import ensure_local_dataset  # noqa: E402
from nanotron_recover.demo import tiny_config_path  # noqa: E402
from nanotron_recover.logging import read_incidents, read_metrics  # noqa: E402


def launch(run_dir: Path, sets: list[str], timeout_s: float) -> float:
    """``nanotron-recover launch`` (which relaunches checkpoint-restart jobs itself); wall seconds."""
    args = [sys.executable, "-m", "nanotron_recover.cli", "launch", "--config", str(tiny_config_path())]
    args += ["--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.perf_counter()
    subprocess.run(
        args, check=True, timeout=timeout_s, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return time.perf_counter() - started


def fault_schedule(replicas: int, every: int, steps: int) -> list[dict]:
    """Replica W-1 fails at step k, W-2 at 2k, ... until half are gone (forward pass, 1st micro-batch)."""
    faults = []
    for n in range(1, replicas // 2 + 1):
        if n * every <= steps:
            faults.append({"step": n * every, "replica": replicas - n, "phase": "forward"})
    return faults


def summarize(name: str, run_dir: Path, wall_s: float, ranks: int, plain: list[dict] | None) -> dict:
    metrics = read_metrics(run_dir)
    incidents = read_incidents(run_dir)
    committed = sum(r["tokens"] for r in metrics)
    typical = statistics.median(r["step_time_s"] for r in metrics)
    parts: dict[str, float] = {}
    if name.startswith("ckpt-restart"):
        stalls = [i["stall_s"] for i in incidents if i.get("stall_s") is not None]
        recompute = [i["recomputed_steps"] * typical for i in incidents if i.get("stall_s") is not None]
        if stalls:
            parts["recompute"] = statistics.mean(recompute)
            parts["relaunch"] = statistics.mean(s - r for s, r in zip(stalls, recompute, strict=True))
    else:
        # Forward recovery stalls only the step the fault hit: its extra time over a normal step.
        fault_steps = {i["step"] for i in incidents}
        stalls = [r["step_time_s"] - typical for r in metrics if r["step"] in fault_steps]
        for key in ("detect", "recover", "redo"):
            values = [i[f"{key}_s"] for i in incidents if i.get(f"{key}_s") is not None]
            if values:
                parts["repair" if key == "recover" else key] = statistics.mean(values)
    deviation = None
    if plain is not None:
        deviation = max(abs(r["loss"] - p["loss"]) for r, p in zip(metrics, plain, strict=True))
        assert all(r["ids_digest"] == p["ids_digest"] for r, p in zip(metrics, plain, strict=True))
    return {
        "run": name,
        "wall_s": wall_s,
        "committed_steps": len(metrics),
        "committed_tokens": committed,
        "effective_tokens_per_s_per_rank": committed / wall_s / ranks,
        "faults": len(incidents),
        "stall_s": stalls,
        "mean_stall_s": statistics.mean(stalls) if stalls else 0.0,
        "mean_stall_parts_s": parts,
        "median_step_s": typical,
        "max_abs_loss_deviation": deviation,
        "loss": [r["loss"] for r in metrics],
        "commit_times": [r["time"] for r in metrics],
    }


def plot(results: list[dict], out: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        a.plot(range(1, len(r["loss"]) + 1), r["loss"], label=r["run"], linewidth=1.2)
        start = r["start_time"]  # commit times are wall clock
        tokens = [r["committed_tokens"] / r["committed_steps"] * (i + 1) for i in range(r["committed_steps"])]
        b.plot([t - start for t in r["commit_times"]], tokens, label=r["run"], linewidth=1.2)
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_title("Loss per step")
    a.legend()
    b.set_xlabel("wall time (s)")
    b.set_ylabel("committed tokens")
    b.set_title("Committed tokens over wall time")
    b.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny steps, about 2 minutes on 2 cores")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--every", type=int, help="a fault every k steps")
    parser.add_argument("--intervals", type=int, nargs="+", default=[2, 16, 64])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    steps = args.steps or (30 if args.quick else 40)
    every = args.every or (max(steps // (args.replicas // 2 + 1), 1) if args.quick else 5)
    report = "faults" if args.quick else "faults_paper"
    # The paper-like schedule's steps are long enough for recompute to weigh beside the relaunch.
    size = [] if args.quick else ["tokens.micro_batch_size=16", "tokens.sequence_length=256"]
    w = args.replicas
    faults = fault_schedule(w, every, steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = ensure_local_dataset(tmp / "data")
        common = [
            f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}",
            f"parallelism.dp={w}",
            "tokens.batch_accumulation_per_replica=2",
            f"tokens.train_steps={steps}",
            "checkpoints.save_final_state=false",
            *size,
        ]
        cfg = load_config(
            tiny_config_path(), [s for s in common if not s.startswith("data_stages")], check_paths=False
        )
        ranks = cfg.world_size
        runs = [("plain", []), ("recover", ["recover.enabled=true", f"recover.faults={json.dumps(faults)}"])]
        for k in args.intervals:
            runs.append(
                (
                    f"ckpt-restart-{k}",
                    [
                        "recover.enabled=true",
                        "recover.mode=checkpoint_restart",
                        f"checkpoints.checkpoint_interval={k}",
                        f"recover.faults={json.dumps(faults)}",
                    ],
                )
            )
        plain = None
        for name, extra in runs:
            run_dir = tmp / name
            start = time.time()
            wall = launch(
                run_dir, common + [f"checkpoints.checkpoints_path={run_dir / 'ckpt'}"] + extra, 3600
            )
            summary = summarize(name, run_dir, wall, ranks, plain)
            summary["start_time"] = start
            results.append(summary)
            if name == "plain":
                plain = read_metrics(run_dir)
            print(
                f"{name}: {wall:.1f}s, {summary['effective_tokens_per_s_per_rank']:.0f} tokens/s/rank",
                flush=True,
            )
    plot(results, out / f"{report}.png")
    recover = next(r for r in results if r["run"] == "recover")
    machine = machine_info()
    for r in results:
        r["throughput_vs_recover"] = (
            r["effective_tokens_per_s_per_rank"] / recover["effective_tokens_per_s_per_rank"]
        )
    columns = ["run", "wall (s)", "committed tokens", "effective tokens/s/rank", "vs recover", "faults"]
    columns += ["mean stall (s)", "made of (mean s per fault)", "max abs loss dev. vs plain"]
    rows = [
        [
            r["run"],
            f"{r['wall_s']:.1f}",
            r["committed_tokens"],
            f"{r['effective_tokens_per_s_per_rank']:.0f}",
            f"{r['throughput_vs_recover']:.2f}",
            r["faults"],
            f"{r['mean_stall_s']:.2f}",
            ", ".join(f"{k} {v:.3f}" for k, v in r["mean_stall_parts_s"].items()) or "-",
            "-" if r["max_abs_loss_deviation"] is None else f"{r['max_abs_loss_deviation']:.2e}",
        ]
        for r in results
    ]
    header = (
        f"{describe(machine)}. Tiny LLaMA, {w} replicas (tp=pp=1, {ranks} ranks), "
        f"micro-batch {cfg.tokens.micro_batch_size} x {cfg.tokens.sequence_length} tokens, {steps} steps, "
        f"a replica fails every {every} steps until half are gone ({len(faults)} faults)."
    )
    data = {
        "machine": machine,
        "replicas": w,
        "steps": steps,
        "every": every,
        "overrides": size,
        "faults": faults,
        "runs": results,
    }
    write_report(out, report, data, [header, "", *markdown_table(columns, rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
