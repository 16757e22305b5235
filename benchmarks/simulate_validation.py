"""Check the fault simulator against this machine: predicted vs measured, both modes.

Two parts:

``--calibrate`` measures the constants of the ``this-machine`` profile on short runs of the tiny
LLaMA that are *not* the runs validated below (other step counts, other fault steps, 8 and 16
replicas): job start-up and exit per mode, the step time per micro-batch, the cross-replica
reduction, the forward repair (ULFM revoke/shrink/agree, fitted as ``a + b*log2(ranks)`` over 4, 8
and 16 ranks), and the checkpoint-restart relaunch. It writes
``benchmarks/results/simulate_calibration.json``; the numbers were then copied, with this command
as their source, into ``src/nanotron_recover/simulate/constants.py``.

The default run validates: it runs ``benchmarks/faults.py --quick`` into a temporary folder (or
reads a ``faults.json`` given with ``--from-json``), simulates the same schedule with the
``this-machine`` profile and writes ``benchmarks/results/simulate_validation.{json,md}``: effective
throughput and stall per fault, predicted vs measured, and the error, for forward recovery and for
checkpoint-restart every 2, 16 and 64 steps. It also compares the model with the committed
``faults_paper.json`` (the paper-like schedule: 40 steps of 16 x 256-token micro-batches) and the
forward-recovery reduction term with ``reduction.json`` (``benchmarks/reduction.py``). Each quantity
is held to its own bound (``nanotron_recover.simulate.validation.TOLERANCES``); the report gives the
largest error of each, and says where the model misses.

    python benchmarks/simulate_validation.py --calibrate         # about 3 minutes on 2 cores
    python benchmarks/simulate_validation.py                     # runs faults.py --quick (~2 min)
    python benchmarks/simulate_validation.py --from-json benchmarks/results/faults.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import describe, machine_info, markdown_table, write_report

from nanotron_recover.data import ensure_local_dataset
from nanotron_recover.demo import tiny_config_path
from nanotron_recover.ft.records import read_records
from nanotron_recover.logging import read_incidents, read_metrics
from nanotron_recover.simulate import validation
from nanotron_recover.simulate.constants import measure_peak_flops

HERE = Path(__file__).parent
RESULTS = HERE / "results"


# -- calibration ----------------------------------------------------------------------------------
def _launch(run_dir: Path, sets: list[str], timeout_s: float = 900) -> tuple[float, float]:
    """``nanotron-recover launch`` of the tiny config; (start wall clock, wall seconds)."""
    args = [sys.executable, "-m", "nanotron_recover.cli", "launch", "--config", str(tiny_config_path())]
    args += ["--run-dir", str(run_dir)] + [a for s in sets for a in ("--set", s)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    started = time.perf_counter()
    subprocess.run(
        args, check=True, timeout=timeout_s, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return t0, time.perf_counter() - started


def wait_quiet(threshold: float, max_s: float) -> float:
    """Wait (up to ``max_s``) until the 1-minute load average is below ``threshold``: the cores are
    shared with other people's jobs, which slow every phase of ours. The load average then."""
    deadline = time.monotonic() + max_s
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]


def _launch_retry(run_dir: Path, sets: list[str]) -> tuple[float, float]:
    """:func:`_launch`, once more in a fresh run dir if it fails (a 16-rank start-up on 2 busy cores
    sometimes does); the second failure raises."""
    try:
        return _launch(run_dir, sets)
    except subprocess.CalledProcessError:
        print(f"{run_dir.name}: launch failed, once more", flush=True)
        retry = run_dir.with_name(run_dir.name + "-retry")
        return _launch(retry, [s.replace(str(run_dir), str(retry)) for s in sets])


def _timing(run_dir: Path, t0: float, wall: float) -> dict:
    """Start-up (launch to the first step's start), exit (last commit to the launcher's return) and
    the step times of one launch."""
    metrics = read_metrics(run_dir)
    first, last = metrics[0], metrics[-1]
    return {
        "wall_s": wall,
        "start_s": first["time"] - first["step_time_s"] - t0,
        "exit_s": t0 + wall - last["time"],
        "step_time_s": {r["step"]: r["step_time_s"] for r in metrics},
        "replicas": {r["step"]: r.get("replicas") for r in metrics},
        "commit_times": {r["step"]: r["time"] for r in metrics},
    }


def _common(data_dir: Path, dp: int, g: int, steps: int) -> list[str]:
    return [
        f"data_stages.0.data.dataset={{dataset_folder: {data_dir}}}",
        f"parallelism.dp={dp}",
        f"tokens.batch_accumulation_per_replica={g}",
        f"tokens.train_steps={steps}",
        "checkpoints.save_final_state=false",
    ]


def _launcher_s(repeats: int = 3) -> float:
    """What the launch command does before mpirun starts, at most: a Python process importing the
    launcher and the restart loop (which imports torch), best of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import nanotron_recover.restart"], check=True)
        best = min(best, time.perf_counter() - started)
    return best


def calibrate(out: Path, repeats: int, quiet: float) -> dict:
    """Run the calibration jobs one after the other (one mpirun at a time), ``repeats`` times, each
    when the load average is below ``quiet`` (or after waiting 15 minutes for it)."""
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = ensure_local_dataset(tmp / "data").corpus_dir

        def fault(step: int, replica: int) -> str:
            return "recover.faults=" + json.dumps([{"step": step, "replica": replica, "phase": "forward"}])

        plan = [
            ("plain-4", _common(data, 4, 2, 12), None),
            ("forward-4", _common(data, 4, 2, 12) + ["recover.enabled=true", fault(6, 3)], 6),
            ("forward-8", _common(data, 8, 1, 8) + ["recover.enabled=true", fault(4, 7)], 4),
            ("forward-16", _common(data, 16, 1, 6) + ["recover.enabled=true", fault(3, 15)], 3),
            ("ckpt-restart-4", _common(data, 4, 2, 12), 6),
        ]
        for rep in range(repeats):
            for name, sets, fault_step in plan:
                run_dir = tmp / f"{name}-{rep}"
                sets = sets + [f"checkpoints.checkpoints_path={run_dir / 'ckpt'}"]
                if name.startswith("ckpt"):
                    # A save every 4 steps, a fault in step 6: resumes from 4, recomputes 5.
                    sets += ["recover.enabled=true", "recover.mode=checkpoint_restart"]
                    sets += ["checkpoints.checkpoint_interval=4", fault(6, 3)]
                load = wait_quiet(quiet, 900)
                t0, wall = _launch_retry(run_dir, sets)
                if not (run_dir / "metrics.jsonl").exists():
                    run_dir = run_dir.with_name(run_dir.name + "-retry")
                r = _timing(run_dir, t0, wall)
                r["loadavg_1min_before"] = load
                if name.startswith("forward"):
                    inc = read_incidents(run_dir)[0]
                    steady = [t for st, t in r["step_time_s"].items() if st != fault_step]
                    r["fault_step_extra_s"] = r["step_time_s"][fault_step] - statistics.median(steady)
                    r["incident"] = {k: inc.get(k) for k in ("detect_s", "recover_s", "redo_s", "shrink_s")}
                    r["ranks"] = int(name.split("-")[1])
                if name.startswith("ckpt"):
                    inc = read_incidents(run_dir)[0]
                    death = min(rec["time"] for rec in read_records(run_dir))
                    resumed = inc["resumed_from_step"]
                    first = r["commit_times"][resumed + 1] - r["step_time_s"][resumed + 1]
                    r["restart_s"] = first - death  # death -> the relaunched job's first step begins
                    r["resumed_from_step"] = resumed
                    r["stall_s"] = inc["stall_s"]
                    ct = r["commit_times"]  # the relaunched job saves after step 8, then runs 9
                    others = [ct[s] - ct[s - 1] for s in (7, 8, 11, 12)]
                    r["save_s"] = max(ct[9] - ct[8] - statistics.median(others), 0.0)
                runs.setdefault(name, []).append(r)
                print(
                    f"{name}: wall {wall:.1f}s start {r['start_s']:.2f}s exit {r['exit_s']:.2f}s "
                    f"(load {load:.1f})",
                    flush=True,
                )
    launcher = _launcher_s()
    summary = summarize_calibration(runs, launcher)
    data = {"machine": machine_info(), "launcher_s": launcher, "runs": runs, "constants": summary}
    for reps in runs.values():  # JSON keys must be strings
        for r in reps:
            for k in ("step_time_s", "replicas", "commit_times"):
                r[k] = {str(st): v for st, v in r[k].items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate_calibration.json").write_text(json.dumps(data, indent=2))
    print(json.dumps(summary, indent=2))
    return data


def _fit_log2(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b*log2(n)``."""
    xs = [math.log2(n) for n, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def summarize_calibration(runs: dict[str, list[dict]], launcher_s: float, cores: int = 2) -> dict:
    """The this-machine constants (see src/nanotron_recover/simulate/constants.py for their meaning).

    Start-up, exit, restart and save take the least over the repeats (the least disturbed by other
    jobs on the shared cores); step, detection and repair times the median. On ``cores`` cores, ``n`` ranks run
    ``n / cores`` times slower: the start-up fit is of start-up / contention.
    """

    def least(name: str, key: str) -> float:
        return min(r[key] for r in runs[name])

    def med(values: list[float]) -> float:
        return statistics.median(values)

    def steady(name: str, replicas: int) -> float:
        return med(
            [
                t
                for r in runs[name]
                for s, t in r["step_time_s"].items()
                if r["replicas"][s] == replicas and s != 1
            ]
        )

    def contention(ranks: int) -> float:
        return max(1.0, ranks / cores)

    forward = {n: int(n.split("-")[1]) for n in ("forward-4", "forward-8", "forward-16")}
    start = _fit_log2([(n, (least(k, "start_s") - launcher_s) / contention(n)) for k, n in forward.items()])
    job_start_4 = (start[0] + start[1] * 2) * contention(4)
    repair = _fit_log2([(n, med([r["incident"]["recover_s"] for r in runs[k]])) for k, n in forward.items()])
    # Step model: step(W) = contention(W) * (ceil(B/W) * t_mb + latency), B = 8: W=4 -> 2, W=3 -> 3;
    # two equations, two unknowns, with latency >= 0 (else t_mb alone, least squares).
    s4, s3 = steady("forward-4", 4) / contention(4), steady("forward-4", 3) / contention(3)
    t_mb, latency_ft = s3 - s4, s4 - 2 * (s3 - s4)
    if latency_ft < 0:
        t_mb, latency_ft = (2 * s4 + 3 * s3) / 13, 0.0
    latency_plain = max(steady("plain-4", 4) / contention(4) - 2 * t_mb, 0.0)
    # A crash in the forward pass surfaces on the survivors this long after it, at 4 ranks: with 8
    # and 16 on 2 cores every rank runs 4-8x oversubscribed, and the report comes later for that
    # alone (the calibration JSON keeps those runs' detect_s too).
    detect = med([r["incident"]["detect_s"] for r in runs["forward-4"]])
    plain_job_start = least("plain-4", "start_s") - launcher_s
    return {
        "launcher_s": launcher_s,
        "start_base_s": start[0],
        "start_per_log2_rank_s": start[1],
        "start_plain_extra_s": plain_job_start - job_start_4,
        "microbatch_s": t_mb,
        "peak_flops": measure_peak_flops(),
        "dp_latency_ft_s": latency_ft,
        "dp_latency_plain_s": latency_plain,
        "repair_base_s": repair[0],
        "repair_per_log2_rank_s": repair[1],
        "exit_ft_s": least("forward-4", "exit_s"),
        "exit_plain_s": min(least("plain-4", "exit_s"), least("ckpt-restart-4", "exit_s")),
        "relaunch_s": least("ckpt-restart-4", "restart_s") - detect - plain_job_start,
        "save_fixed_s": least("ckpt-restart-4", "save_s"),
        "detect_crash_s": detect,
        "steady_step_s": {
            "ft_4": steady("forward-4", 4),
            "ft_3": steady("forward-4", 3),
            "plain_4": steady("plain-4", 4),
        },
        "fault_step_extra_s": [r["fault_step_extra_s"] for k in forward for r in runs[k]],
    }


# -- validation -----------------------------------------------------------------------------------
def run_faults_quick(out: Path) -> Path:
    """``benchmarks/faults.py --quick --out OUT``; the path of the faults.json it wrote."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(
        [sys.executable, str(HERE / "faults.py"), "--quick", "--out", str(out)], check=True, env=env
    )
    return out / "faults.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", action="store_true", help="measure the this-machine constants")
    parser.add_argument("--repeats", type=int, default=2, help="calibration: runs of each job")
    parser.add_argument("--quiet", type=float, default=1.5, help="calibration: wait for a load below this")
    parser.add_argument("--from-json", help="validate against this faults.json instead of running faults.py")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    out = Path(args.out)
    if args.calibrate:
        calibrate(out, args.repeats, args.quiet)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        if args.from_json:
            source = Path(args.from_json)
            measured = json.loads(source.read_text())
            origin = f"`{source.name}` (given with --from-json)"
        else:
            load_before = wait_quiet(args.quiet, 900)
            measured = json.loads(run_faults_quick(Path(tmp)).read_text())
            origin = (
                "a fresh `python benchmarks/faults.py --quick` run (1-minute load average "
                f"{load_before:.1f} before it, {os.getloadavg()[0]:.1f} after it, on 2 cores)"
            )
    rows = validation.compare(measured)
    committed = json.loads((RESULTS / "faults.json").read_text())
    committed_rows = validation.compare(committed)
    paper_like = json.loads((RESULTS / "faults_paper.json").read_text())
    paper_rows = validation.compare(paper_like)
    reduction = json.loads((RESULTS / "reduction.json").read_text())
    reduction_rows = validation.reduction_rows(reduction)
    sm_fit = validation.fit_sm_bandwidth(reduction)
    machine = machine_info()
    columns = ["run", "quantity", "measured", "predicted", "error"]

    def table(rs: list[dict]) -> list[str]:
        return markdown_table(
            columns,
            [
                [
                    r["run"],
                    r["quantity"],
                    f"{r['measured']:.3f}",
                    f"{r['predicted']:.3f}",
                    f"{r['error']:+.1%}",
                ]
                for r in rs
            ],
        )

    def bounds(rs: list[dict], measurement: str) -> list[str]:
        worst = validation.worst_by_quantity(rs, measurement)
        limits = validation.TOLERANCES[measurement]
        table = markdown_table(
            ["quantity", "largest error", "bound"],
            [[q, f"{worst[q]:.1%}", f"{limits[q]:.0%}"] for q in validation.QUANTITIES],
        )
        skipped = [
            f"- not held to a bound: {run} {q}, {why}."
            for (run, q), why in validation.UNCHECKED.get(measurement, {}).items()
        ]
        return table + ([""] + skipped if skipped else [])

    worst = max(abs(r["error"]) for r in rows)
    worst_committed = max(abs(r["error"]) for r in committed_rows)
    paper_stall = next(r for r in paper_rows if r["run"] == "recover" and r["quantity"] == "mean_stall_s")
    paper_walls = [r["error"] for r in paper_rows if r["quantity"] == "wall_s"]
    red = {(r["params"], r["quantity"]): r for r in reduction_rows}
    lines = [
        "# Fault simulator vs this machine",
        "",
        f"{describe(machine)}.",
        "",
        "The `this-machine` profile of `nanotron-recover simulate` (constants measured by "
        "`python benchmarks/simulate_validation.py --calibrate` on other runs than these: see "
        "`nanotron-recover simulate --profile this-machine --constants`) predicts the runs of "
        "`benchmarks/faults.py --quick`: 4 replicas, 30 steps, a replica killed every 10 steps until "
        "half are gone. Effective throughput is committed tokens over the whole wall time per initial "
        "rank; the stall per fault is measured as faults.py measures it (forward: the fault step's "
        "time over the median step; checkpoint-restart: the failure to the *last* commit of the failed "
        "step, so with no checkpoint before the second fault the first fault's stall includes the "
        "second one: the model reproduces that definition).",
        "",
        f"## Against {origin}",
        "",
        *table(rows),
        "",
        *bounds(rows, "faults"),
        "",
        "## Against the committed `benchmarks/results/faults.json` (what `tests/unit/simulate/test_simulate.py` checks)",
        "",
        *table(committed_rows),
        "",
        *bounds(committed_rows, "faults"),
        "",
        "## Against the committed `benchmarks/results/faults_paper.json` (the paper-like schedule)",
        "",
        "4 replicas, 40 steps of 16 x 256-token micro-batches (about 0.5 s a step), a replica killed "
        "every 5 steps until half are gone; the model runs the same config (`overrides` of the file).",
        "",
        *table(paper_rows),
        "",
        *bounds(paper_rows, "faults_paper"),
        "",
        "These bounds are the model's present error rounded up (they catch a change that makes it "
        "worse), not a target it was built to meet.",
        "",
        "Where the model misses: its micro-batch. The MFU is calibrated on 1 x 128-token micro-batches "
        "(`--calibrate`); at 16 x 256 tokens the measured steps are faster than that MFU says, so the "
        f"model's wall times are {min(paper_walls):+.0%} to {max(paper_walls):+.0%} and its forward "
        f"stall, which is the redone micro-batch, is {paper_stall['predicted']:.2f} s against "
        f"{paper_stall['measured']:.2f} s measured. Checkpoint-restart's stall per fault (relaunch, "
        "start-up, recompute) is within 8%.",
        "",
        "## The forward-recovery reduction against `benchmarks/results/reduction.json`",
        "",
        "4 ranks on 2 cores, fp32 gradients in 25 MiB buckets plus the bookkeeping vector; seconds "
        "per step's reduction (the slowest rank, median of 15). The model: each bucket's snapshot "
        "(a host copy at `host_memcpy_bw`), then the ring all-reduce (`2 (W-1)/W` of the bucket over "
        "the sm transport, `(W-1)/W` summed at `cpu_sum_bw`), one bucket at a time, every rank "
        "running at half speed (4 ranks, 2 cores). `host_memcpy_bw` and `cpu_sum_bw` are measured "
        "apart (`python -m nanotron_recover.simulate.constants --measure-host`); the sm bandwidth, "
        f"{sm_fit / 1e9:.2f} GB/s per rank, is fitted to the 50M row's bare per-bucket `Allreduce`: "
        "that row checks the bucket code's own cost, not the transport.",
        "",
        *markdown_table(
            ["parameters", "quantity", "measured s", "predicted s", "error"],
            [
                [
                    f"{r['params'] / 1e6:.0f}M",
                    r["quantity"],
                    f"{r['measured']:.4f}",
                    f"{r['predicted']:.4f}",
                    f"{r['error']:+.1%}",
                ]
                for r in reduction_rows
            ],
        ),
        "",
        "The snapshots (`ours_other_s`) are predicted within "
        f"{max(abs(red[(p, 'ours_other_s')]['error']) for p in (10_000_000, 50_000_000)):.0%} at both "
        f"sizes; the whole reduction within {abs(red[(50_000_000, 'ours_s')]['error']):.0%} at 50M "
        f"and {red[(10_000_000, 'ours_s')]['error']:+.0%} at 10M, where the fitted transport is too "
        "fast: smaller buckets (a 14 MB tail, a 128-byte bookkeeping bucket) pay per-message costs "
        "that the per-byte fit does not carry.",
    ]
    keep = (
        "run",
        "wall_s",
        "committed_steps",
        "committed_tokens",
        "effective_tokens_per_s_per_rank",
        "faults",
    )
    data = {
        "machine": machine,
        "source": origin,
        # The measurement itself (faults.json's format, without the per-step curves), so that
        # tests/unit/simulate/test_simulate.py can compare the model with it again, deterministically.
        "measured": {
            "machine": measured["machine"],
            "replicas": measured["replicas"],
            "steps": measured["steps"],
            "faults": measured["faults"],
            "runs": [
                {**{k: r[k] for k in keep}, "stall_s": r["stall_s"], "mean_stall_s": r["mean_stall_s"]}
                for r in measured["runs"]
            ],
        },
        "rows": rows,
        "max_abs_error": worst,
        "committed_faults_json_rows": committed_rows,
        "committed_max_abs_error": worst_committed,
        "tolerances": validation.TOLERANCES,
        "worst_by_quantity": {
            "faults": validation.worst_by_quantity(committed_rows, "faults"),
            "faults_paper": validation.worst_by_quantity(paper_rows, "faults_paper"),
        },
        "faults_paper_rows": paper_rows,
        "reduction_rows": reduction_rows,
        "sm_bandwidth_fit": sm_fit,
    }
    write_report(out, "simulate_validation", data, lines)
    bad = validation.out_of_bounds(rows, "faults") + validation.out_of_bounds(committed_rows, "faults")
    bad += validation.out_of_bounds(paper_rows, "faults_paper")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
