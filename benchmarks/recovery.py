"""Cost of forward recovery on this machine.

1. Steady state: median step time of the fault-tolerant mode with no faults over the plain mode, same
   config and layout (the price of per-replica worlds, MPI reduction in snapshotted buckets, the
   gate and the commit agree). Target: <= 1.05 on CPU.
2. Per crash: ``detect_s`` (the victim's SIGKILL to the first survivor seeing it in MPI),
   ``recover_s`` (noticing to the step committed, minus the redone micro-batches) and ``redo_s``
   (recomputing the lost micro-batches), from runs that lose one replica in each phase. Target:
   medians of detect_s and recover_s < 0.5 s on CPU.
3. Per hang: a replica freezes (SIGSTOP) in compute, in the reduction or at the agree; ``freeze ->
   commit`` is the time from the freeze to the commit of the step it struck (what the hang cost the
   job), median and max over repeats, for each heartbeat setting (period, timeout) measured.
4. Exact mode (``recover.exact``): steady-state median step time and peak resident set per rank of
   the plain and the fault-tolerant modes, each normal and exact, on a model large enough for the
   gradient buffers to show in memory (hidden 256, 4 layers: 2.6M parameters); the gradient buffer
   bytes per rank are computed (fp32: 4 bytes per parameter; exact: 4 + 8).

Writes ``benchmarks/results/recovery.json`` and ``recovery.md`` (1-3), ``recovery_exact.json`` and
``recovery_exact.md`` (4).

    python benchmarks/recovery.py [--steps 40] [--replicas 4] [--repeats 2] [--heartbeats 0.5:2,1:5]
    python benchmarks/recovery.py --exact-only          # part 4 alone, about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from common import describe, machine_info, markdown_table, run_training, write_report
from throughput import PeakRSS

from nanotron_recover.data import ensure_local_dataset
from nanotron_recover.ft.records import read_records
from nanotron_recover.logging import read_incidents, read_metrics

WARMUP_STEPS = 3
PHASES = ["forward", "backward", "gate", "reduce", "optimizer", "recovery"]
# Where a frozen replica stops: (fault phase, micro-batch or bucket index) -> row name.
FREEZES = {("forward", 1): "compute", ("reduce", 1): "reduce", ("agree", 0): "agree"}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def freeze_to_commit(run_dir: Path) -> list[float]:
    """For each injected freeze: the freeze's wall time to the commit of the step it struck."""
    committed = {r["step"]: r["time"] for r in read_metrics(run_dir)}
    return [committed[r["step"]] - r["time"] for r in read_records(run_dir) if r["kind"] == "hang"]


def median_step_time(run_dir: Path) -> float:
    return statistics.median(r["step_time_s"] for r in read_metrics(run_dir)[WARMUP_STEPS:])


EXACT_MODEL = [
    "model.model_config.hidden_size=256",
    "model.model_config.intermediate_size=512",
    "model.model_config.num_hidden_layers=4",
]
EXACT_RUNS = [
    ("plain", []),
    ("plain, exact", ["recover.exact=true"]),
    ("recover", ["recover.enabled=true"]),
    ("recover, exact", ["recover.enabled=true", "recover.exact=true"]),
]


def exact_cost(tmp: Path, base: list[str], w: int, steps: int, repeats: int, machine: dict) -> tuple:
    """Part 4: (summary, markdown lines) of the exact mode's steady-state cost."""
    from nanotron_recover.config import load_config
    from nanotron_recover.demo import tiny_config_path
    from nanotron_recover.estimate import plan_summary

    overrides = base + EXACT_MODEL + [f"tokens.train_steps={steps}"]
    params = plan_summary(
        load_config(
            tiny_config_path(), [o for o in overrides if not o.startswith("data_stages")], check_paths=False
        )
    )["parameters"]
    rows, results = [], []
    for name, extra in EXACT_RUNS:
        times, peaks = [], []
        for rep in range(repeats):
            run_dir = tmp / f"exact-{name.replace(', ', '-')}-{rep}"
            with PeakRSS(run_dir) as memory:
                run_training(run_dir, overrides + extra, w)
            times.append(median_step_time(run_dir))
            peaks.append(max(memory.per_rank_mib(), default=float("nan")))
        grad_bytes = params * (12 if "exact" in name else 4)
        results.append(
            {
                "run": name,
                "median_step_time_s": statistics.median(times),
                "peak_rss_mib_max_over_ranks": statistics.median(peaks),
                "gradient_buffer_bytes_per_rank": grad_bytes,
            }
        )
    by = {r["run"]: r for r in results}
    for r in results:
        normal = by[r["run"].removesuffix(", exact")]
        rows.append(
            [
                r["run"],
                f"{r['median_step_time_s']:.4f}",
                f"{r['median_step_time_s'] / normal['median_step_time_s']:.3f}",
                f"{r['peak_rss_mib_max_over_ranks']:.0f}",
                f"{r['peak_rss_mib_max_over_ranks'] - normal['peak_rss_mib_max_over_ranks']:+.0f}",
                f"{r['gradient_buffer_bytes_per_rank'] / 2**20:.1f}",
            ]
        )
    header = (
        f"{describe(machine)}. LLaMA of {params / 1e6:.1f}M parameters (hidden 256, 4 layers), {w} replicas "
        f"(tp=pp=1), B={2 * w}, {steps} steps, medians over {repeats} runs of the steady-state step "
        f"(after {WARMUP_STEPS} steps)."
    )
    table = markdown_table(
        [
            "run",
            "median step time (s)",
            "vs normal",
            "peak RSS per rank (MiB)",
            "vs normal (MiB)",
            "gradient buffers per rank (MiB)",
        ],
        rows,
    )
    summary = {"machine": machine, "replicas": w, "steps": steps, "parameters": params, "runs": results}
    return summary, [header, "", *table]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="fault runs per phase")
    parser.add_argument(
        "--heartbeats", default="0.5:2,1:5", help="heartbeat settings period:timeout (s), comma-separated"
    )
    parser.add_argument("--exact-only", action="store_true", help="only part 4, the exact mode's cost")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = args.replicas
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = ensure_local_dataset(tmp / "data")
        base = [
            f"data_stages.0.data.dataset={{dataset_folder: {data.corpus_dir}}}",
            f"parallelism.dp={w}",
            "tokens.batch_accumulation_per_replica=2",
            "checkpoints.save_final_state=false",
        ]
        exact_summary, exact_lines = exact_cost(tmp, base, w, args.steps, args.repeats, machine)
        write_report(out, "recovery_exact", exact_summary, exact_lines)
        if args.exact_only:
            return 0
        steady = {}
        for mode, extra in (("plain", []), ("recover", ["recover.enabled=true"])):
            times = []
            for rep in range(args.repeats):
                run_dir = tmp / f"steady-{mode}-{rep}"
                run_training(run_dir, base + [f"tokens.train_steps={args.steps}"] + extra, w)
                times.append(median_step_time(run_dir))
            steady[mode] = statistics.median(times)
        ratio = steady["recover"] / steady["plain"]

        incidents = []
        fault_steps = 8
        for phase in PHASES:
            for rep in range(args.repeats):
                faults = [{"step": 4, "replica": 1, "phase": phase}]
                if phase == "recovery":
                    faults = [
                        {"step": 4, "replica": 1, "phase": "forward"},
                        {"step": 4, "replica": 2, "phase": "recovery"},
                    ]
                run_dir = tmp / f"fault-{phase}-{rep}"
                sets = base + [
                    f"tokens.train_steps={fault_steps}",
                    "recover.enabled=true",
                    f"recover.faults={json.dumps(faults)}",
                ]
                run_training(run_dir, sets, w)
                for inc in read_incidents(run_dir):
                    incidents.append({**inc, "injected_phase": phase})

        hangs = []
        for setting in args.heartbeats.split(","):
            period, timeout = (float(x) for x in setting.split(":"))
            for (phase, index), name in FREEZES.items():
                for rep in range(args.repeats):
                    freeze = {"step": 4, "replica": 1, "phase": phase, "microbatch": index, "kind": "freeze"}
                    run_dir = tmp / f"hang-{period}-{timeout}-{name}-{rep}"
                    sets = base + [
                        f"tokens.train_steps={fault_steps}",
                        "recover.enabled=true",
                        f"recover.heartbeat_period_s={period}",
                        f"recover.heartbeat_timeout_s={timeout}",
                        f"recover.faults={json.dumps([freeze])}",
                    ]
                    run_training(run_dir, sets, w)
                    (inc,) = read_incidents(run_dir)
                    for cost in freeze_to_commit(run_dir):
                        hangs.append(
                            {
                                "period_s": period,
                                "timeout_s": timeout,
                                "where": name,
                                "freeze_to_commit_s": cost,
                                "detect_s": inc["detect_s"],
                                "kind": inc["kind"],
                            }
                        )
    detect = [i["detect_s"] for i in incidents if i["detect_s"] is not None]
    recover = [i["recover_s"] for i in incidents]
    per_phase = {
        phase: {
            "detect_s_median": statistics.median(
                [i["detect_s"] for i in incidents if i["phase"] == phase] or [float("nan")]
            ),
            "recover_s_median": statistics.median(
                [i["recover_s"] for i in incidents if i["phase"] == phase] or [float("nan")]
            ),
            "redo_s_median": median([i["redo_s"] for i in incidents if i["phase"] == phase]),
            "faults": sum(i["phase"] == phase for i in incidents),
        }
        for phase in PHASES
    }
    summary = {
        "machine": machine,
        "replicas": w,
        "steps": args.steps,
        "steady_step_time_s": steady,
        "steady_ratio_recover_over_plain": ratio,
        "faults": len(incidents),
        "detect_s_median": statistics.median(detect),
        "recover_s_median": statistics.median(recover),
        "redo_s_median": median([i["redo_s"] for i in incidents]),
        "per_phase": per_phase,
        "incidents": incidents,
        "hangs": hangs,
    }
    steady_table = markdown_table(
        ["steady state", "plain", "recover", "ratio recover/plain (target <= 1.05)"],
        [["median step time (s)", f"{steady['plain']:.4f}", f"{steady['recover']:.4f}", f"{ratio:.3f}"]],
    )
    fault_rows = [
        [
            phase,
            v["faults"],
            f"{v['detect_s_median']:.4f}",
            f"{v['recover_s_median']:.4f}",
            f"{v['redo_s_median']:.4f}",
        ]
        for phase, v in per_phase.items()
    ]
    fault_rows.append(
        [
            "**all**",
            len(incidents),
            f"{summary['detect_s_median']:.4f}",
            f"{summary['recover_s_median']:.4f}",
            f"{summary['redo_s_median']:.4f}",
        ]
    )
    fault_table = markdown_table(
        ["crash phase", "faults", "median detect_s", "median recover_s", "median redo_s"], fault_rows
    )
    hang_rows = []
    for setting in sorted({(h["period_s"], h["timeout_s"]) for h in hangs}):
        for name in FREEZES.values():
            costs = [
                h["freeze_to_commit_s"]
                for h in hangs
                if (h["period_s"], h["timeout_s"]) == setting and h["where"] == name
            ]
            detects = [
                h["detect_s"]
                for h in hangs
                if (h["period_s"], h["timeout_s"]) == setting and h["where"] == name
            ]
            if costs:
                hang_rows.append(
                    [
                        f"{setting[0]:g} / {setting[1]:g}",
                        name,
                        len(costs),
                        f"{median(detects):.2f}",
                        f"{median(costs):.2f}",
                        f"{max(costs):.2f}",
                    ]
                )
    hang_table = markdown_table(
        [
            "heartbeat period / timeout (s)",
            "frozen in",
            "hangs",
            "median detect_s",
            "median freeze -> commit (s)",
            "max freeze -> commit (s)",
        ],
        hang_rows,
    )
    header = f"{describe(machine)}. Tiny LLaMA, {w} replicas (tp=pp=1), B={2 * w}."
    write_report(out, "recovery", summary, [header, "", *steady_table, "", *fault_table, "", *hang_table])
    return 0


if __name__ == "__main__":
    sys.exit(main())
