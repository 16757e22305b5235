"""``nanotron-recover simulate``: run the event model for every mode and report it like the paper.

For each checkpoint interval ``N`` (default 2, 16, 64) the model runs forward recovery (saving a
checkpoint every ``N`` steps too, which is why its row is there: its stall must not depend on ``N``),
checkpoint-restart every ``N`` and, with ``--rejoin``, forward recovery with re-join, all under the
same fault schedule and for the same wall time: the *budget*, by default what forward recovery
needs for ``--steps`` steps (``--budget-s`` or ``--budget-gpu-hours`` set it: the paper compares at
234 GPU-hours). Per run:

- stall per fault (mean and max) and in total (re-joins included): what faults cost;
- effective throughput: tokens of the steps that stand at the budget, over the budget;
- late throughput: the same over the last quarter of the budget ("after successive failures");
- tokens in the same wall time and the ratio to forward recovery at the same ``N``.

Beside these job-level figures, the paper's own metric: *effective throughput per GPU in use over
the whole schedule* (:class:`ScheduleRow`): every run carried through every step of the fault
schedule (by default until the last scheduled fault's replica is gone and ``--every`` more steps
are done, for the paper's schedule down to 32 replicas), its tokens over the GPU-seconds it held
(forward recovery releases a lost replica's GPUs, checkpoint-restart holds its allocation).

With the ``a100-512`` profile the paper's figures are printed beside the model's. ``--plot PATH``
draws standing tokens and effective throughput over time for every run.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import load_config
from ..errors import InputError
from .constants import format_constants, get_profile, parse_overrides
from .events import CKPT, FORWARD, REJOIN, Fault, Run, every_k_steps, mtbf_faults, simulate
from .workload import Workload, build_workload

# The paper's 512-A100 figures (LLaMA-7B on C4, a replica group failing
# every 5 steps until 32 replicas are gone); "~" where the figure is read approximately.
PAPER = {
    "stall_per_fault_s": {FORWARD: "~10", f"{CKPT}-2": "~30", f"{CKPT}-16": "~180", f"{CKPT}-64": ">600"},
    "throughput_ratio": 2.23,  # forward over checkpoint-restart, effective throughput after successive failures
    "tokens_ratio": 1.749,  # forward over checkpoint-restart, tokens at 234 GPU-hours
    "gpu_hours": 234.0,
}


@dataclass
class Row:
    """One line of the report."""

    run: str
    mode: str
    interval: int
    faults: int
    stall_mean_s: float
    stall_max_s: float
    total_stall_s: float
    budget_s: float
    tokens: int
    throughput: float  # tokens/s over the budget
    throughput_per_device: float
    late_throughput: float  # tokens/s over the last quarter of the budget
    late_throughput_per_device: float  # ... per device held then (forward holds fewer)
    ratio_vs_forward: float  # tokens over forward recovery's at the same interval
    tokens_same_device_hours: int = 0  # at the budget's device-hours *consumed* (forward releases GPUs)
    ratio_same_device_hours: float = 1.0
    paper_stall: str = ""


@dataclass
class ScheduleRow:
    """One run carried through the whole fault schedule: the paper's effective throughput."""

    run: str
    mode: str
    interval: int
    steps: int
    wall_s: float
    gpu_hours: float  # GPU-hours held over the run (alive replicas x their GPUs)
    tokens_per_s: float
    tokens_per_s_per_gpu: float  # per GPU held: the paper's effective throughput
    final_replicas: int
    ratio_vs_forward: float  # per-GPU throughput over forward recovery's at the same N
    stall_mean_s: float = 0.0
    stall_max_s: float = 0.0


def schedule_row(run: Run, steps: int, width: int, forward: Run | None) -> ScheduleRow:
    """``run``'s tokens over the GPU-seconds it held from its start to its end."""
    tokens = steps * run.tokens_per_step
    held = run.device_s_at(run.wall_s, width)
    per_gpu = tokens / held if held > 0 else 0.0
    if forward is None:
        ratio = 1.0
    else:
        f_held = forward.device_s_at(forward.wall_s, width)
        ratio = per_gpu / (tokens / f_held) if f_held > 0 and tokens > 0 else 1.0
    stalls = [f.stall_s for f in run.faults]
    return ScheduleRow(
        stall_mean_s=sum(stalls) / len(stalls) if stalls else 0.0,
        stall_max_s=max(stalls, default=0.0),
        run=run.name,
        mode=run.mode,
        interval=run.interval,
        steps=steps,
        wall_s=run.wall_s,
        gpu_hours=held / 3600.0,
        tokens_per_s=tokens / run.wall_s,
        tokens_per_s_per_gpu=per_gpu,
        final_replicas=run.replicas[-1][1],
        ratio_vs_forward=ratio,
    )


def summarize(run: Run, budget_s: float, forward: Run | None, width: int) -> Row:
    """The report line of ``run`` at ``budget_s`` (compared with ``forward``, the forward-recovery
    run of the same interval; ``width`` devices per replica)."""
    stalls = [f.stall_s for f in run.faults if f.time_s <= budget_s]
    tokens = run.tokens_at(budget_s)
    late = (tokens - run.tokens_at(0.75 * budget_s)) / (0.25 * budget_s)
    paper_key = FORWARD if run.mode == FORWARD else run.name
    device_s = budget_s * run.initial_ranks
    same_hours = run.tokens_at(run.time_at_device_s(device_s, width))
    forward_tokens = forward.tokens_at(budget_s) if forward is not None else tokens
    forward_hours = forward.tokens_at(forward.time_at_device_s(device_s, width)) if forward else same_hours
    return Row(
        run=run.name,
        mode=run.mode,
        interval=run.interval,
        faults=len(stalls),
        stall_mean_s=sum(stalls) / len(stalls) if stalls else 0.0,
        stall_max_s=max(stalls, default=0.0),
        total_stall_s=sum(stalls) + sum(s for t, s, _ in run.joins if t <= budget_s),
        budget_s=budget_s,
        tokens=tokens,
        throughput=tokens / budget_s,
        throughput_per_device=tokens / budget_s / run.initial_ranks,
        late_throughput=late,
        late_throughput_per_device=late
        * (0.25 * budget_s)
        / max(run.device_s_at(budget_s, width) - run.device_s_at(0.75 * budget_s, width), 1e-12),
        ratio_vs_forward=tokens / forward_tokens if forward_tokens else 1.0,
        tokens_same_device_hours=same_hours,
        ratio_same_device_hours=same_hours / forward_hours if forward_hours else 1.0,
        paper_stall=PAPER["stall_per_fault_s"].get(paper_key, ""),
    )


@dataclass
class Simulation:
    """Every run of one ``simulate`` call and its report."""

    profile: str
    workload: Workload
    faults: list[Fault]
    budget_s: float
    runs: list[Run]
    rows: list[Row]
    paper: bool
    steps: int = 0  # the whole schedule's steps
    schedule: list[ScheduleRow] | None = None


def make_faults(args: argparse.Namespace, wl: Workload, horizon_s: float) -> list[Fault]:
    """The fault schedule of the command line (see :func:`add_simulate_arguments`)."""
    if args.mtbf_hours is not None:
        return mtbf_faults(args.mtbf_hours, wl.ranks, horizon_s, args.seed, args.fault_kind, args.until)
    until = args.until if args.until is not None else wl.replicas // 2
    phase = getattr(args, "fault_phase", "compute")
    return every_k_steps(args.every, until, wl.replicas, args.fault_at, args.fault_kind, phase)


def run_simulation(args: argparse.Namespace) -> Simulation:
    """Build the workload and the schedule, run every mode and interval, summarize."""
    cfg = load_config(args.config, args.overrides, check_paths=False)
    profile = get_profile(args.profile, parse_overrides(args.set_constant))
    wl = build_workload(cfg, profile)
    intervals = [int(n) for n in str(args.intervals).split(",") if n.strip()]
    if args.steps is not None:
        steps = args.steps
    elif args.mtbf_hours is None:
        until = args.until if args.until is not None else wl.replicas // 2
        steps = args.every * (until + 1)
    else:
        steps = cfg.tokens.train_steps
    horizon = 10 * steps * wl.step_s(wl.replicas, forward=True) + 3600.0
    faults = make_faults(args, wl, horizon)
    reference = simulate(wl, profile, FORWARD, faults, steps, intervals[0])
    if args.budget_s is not None:
        budget = args.budget_s
    elif args.budget_gpu_hours is not None:
        budget = args.budget_gpu_hours * 3600.0 / wl.ranks
    else:
        budget = reference.wall_s
    modes = [FORWARD, CKPT] + ([REJOIN] if args.rejoin else [])
    runs: list[Run] = []
    rows: list[Row] = []
    schedule: list[ScheduleRow] = []
    for n in intervals:
        # The whole schedule, every run to its last step: the paper's per-GPU effective throughput.
        whole = {m: simulate(wl, profile, m, faults, steps, n) for m in modes}
        for m in modes:
            schedule.append(schedule_row(whole[m], steps, wl.width, whole[FORWARD]))
    for n in intervals:
        # Past the budget too: a run that releases devices reaches the budget's device-hours later.
        by_mode = {m: simulate(wl, profile, m, faults, 10**9, n, until_s=2.5 * budget) for m in modes}
        for m in modes:
            runs.append(by_mode[m])
            rows.append(summarize(by_mode[m], budget, by_mode[FORWARD], wl.width))
    # The paper's figures are beside the model's only for the paper's run: a100-512, a replica group
    # every 5 steps until 32 are gone, 64 replicas.
    paper = (
        profile.name == "a100-512"
        and args.mtbf_hours is None
        and args.every == 5
        and (args.until if args.until is not None else wl.replicas // 2) == 32
        and wl.replicas == 64
    )
    return Simulation(
        profile.name, wl, faults, budget, runs, rows, paper=paper, steps=steps, schedule=schedule
    )


def format_rows(sim: Simulation) -> list[str]:
    """The report as a Markdown table (one line per run), the paper's figures beside the model's."""
    cols = ["run", "faults", "stall/fault mean (max) s", "total stall s", "tokens", "eff. tokens/s"]
    cols += ["tokens/s/device", "late tokens/s", "vs forward"]
    if sim.paper:
        cols += ["paper: stall/fault s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sim.rows:
        cells = [
            r.run,
            str(r.faults),
            f"{r.stall_mean_s:.1f} ({r.stall_max_s:.1f})"
            if r.stall_max_s >= 1
            else f"{r.stall_mean_s:.3f} ({r.stall_max_s:.3f})",
            f"{r.total_stall_s:.1f}",
            f"{r.tokens:,}",
            f"{r.throughput:,.0f}",
            f"{r.throughput_per_device:,.1f}",
            f"{r.late_throughput:,.0f}",
            f"{r.ratio_vs_forward:.2f}",
        ]
        if sim.paper:
            cells.append(r.paper_stall or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def format_schedule(sim: Simulation) -> list[str]:
    """The paper's metric: every run over the whole schedule, tokens per second per GPU held."""
    cols = ["run", "steps", "wall s", "stall/fault mean (max) s", "GPU-hours held", "tokens/s"]
    cols += ["tokens/s per GPU held", "replicas at the end", "per GPU vs forward"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sim.schedule or []:
        cells = [
            r.run,
            str(r.steps),
            f"{r.wall_s:,.0f}",
            f"{r.stall_mean_s:.1f} ({r.stall_max_s:.1f})",
            f"{r.gpu_hours:,.1f}",
            f"{r.tokens_per_s:,.0f}",
            f"{r.tokens_per_s_per_gpu:,.1f}",
            str(r.final_replicas),
            f"{r.ratio_vs_forward:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def header(sim: Simulation) -> list[str]:
    wl = sim.workload
    kinds = sorted({f.kind for f in sim.faults})
    by_step = [f for f in sim.faults if f.step is not None]
    if by_step:
        where = "reduction" if by_step[0].phase == "reduce" else "compute"
        sched = (
            f"a replica fails every {by_step[0].step} steps ({len(by_step)} faults, "
            f"{'/'.join(kinds)}, at {by_step[0].at:.0%} of the step's {where})"
        )
    else:
        sched = f"{len(sim.faults)} random faults ({'/'.join(kinds)}) drawn over the run"
    step0 = wl.step_s(wl.replicas, forward=True)
    return [
        f"profile {sim.profile}; {wl.ranks} ranks = {wl.replicas} replicas x {wl.width}; "
        f"{wl.parameters / 1e9:.2f}B parameters; B = {wl.B} micro-batches, {wl.tokens_per_step:,} tokens/step; "
        f"{wl.flops_per_microbatch:.3g} FLOPs/micro-batch; fault-free step {step0:.3g} s "
        f"({wl.tokens_per_step / step0:,.0f} tokens/s)",
        snapshot_line(wl),
        f"schedule: {sched}; same wall time for every run: {sim.budget_s:,.1f} s "
        f"({sim.budget_s * wl.ranks / 3600:,.1f} GPU-hours of the allocation)",
    ]


def snapshot_line(wl: Workload) -> str:
    """What the node-memory snapshots cost a forward-recovery step, in one line."""
    if wl.snapshot_copy_s <= 0:
        return "node-memory snapshots: off (recover.snapshot.interval 0), no cost"
    w = wl.replicas
    per_step = wl.snapshot_s(w)
    how = (
        "beside the next step's compute and reduction"
        if wl.snapshot_overlap
        else "taken from the step (not overlapped)"
    )
    return (
        f"node-memory snapshot every {wl.snapshot_interval} step(s): "
        f"{wl.snapshot_bytes_per_rank / 1e9:.3g} GB per rank copied in {wl.snapshot_copy_s:.3g} s "
        f"at {wl.snapshot_bw / 1e9:.3g} GB/s, {how}: {per_step:.3g} s a step "
        f"({per_step / wl.step_s(w, forward=True):.1%} of the forward-recovery step)"
    )


def paper_lines(sim: Simulation) -> list[str]:
    """The model's ratios beside the paper's two headline figures."""
    ckpt = [r for r in sim.rows if r.mode == CKPT]
    fwd = {r.interval: r for r in sim.rows if r.mode == FORWARD}
    lines = [
        f"paper: forward recovery {PAPER['throughput_ratio']}x the effective throughput of "
        f"checkpoint-restart after successive failures, +{PAPER['tokens_ratio'] - 1:.1%} tokens at "
        f"{PAPER['gpu_hours']:g} GPU-hours"
    ]
    for r in ckpt:
        late = fwd[r.interval].late_throughput / r.late_throughput if r.late_throughput > 0 else math.inf
        f_dev, c_dev = fwd[r.interval].late_throughput_per_device, r.late_throughput_per_device
        per_device = f_dev / c_dev if c_dev > 0 else math.inf
        tokens = f"{1 / r.ratio_vs_forward - 1:+.1%}" if r.ratio_vs_forward > 0 else "infinitely more"
        hours = (
            f"{1 / r.ratio_same_device_hours - 1:+.1%}"
            if r.ratio_same_device_hours > 0
            else "infinitely more"
        )
        lines.append(
            f"model, N={r.interval}: forward {late:.2f}x the late throughput of checkpoint-restart "
            f"({per_device:.2f}x per GPU held); "
            f"{tokens} tokens in the same wall time, {hours} for the same GPU-hours consumed "
            "(forward recovery releases a lost replica's GPUs)"
        )
    return lines


def plot(sim: Simulation, path: str | Path) -> None:
    """Standing tokens and effective throughput over wall time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {FORWARD: "tab:blue", CKPT: "tab:red", REJOIN: "tab:green"}
    intervals = sorted({run.interval for run in sim.runs})
    dashes = ["-", "--", ":", "-."]
    n_points = 500
    times = [sim.budget_s * (i + 1) / n_points for i in range(n_points)]
    for run in sim.runs:
        tokens = [run.tokens_at(t) for t in times]
        style = dashes[intervals.index(run.interval) % len(dashes)]
        kw = {"color": colors[run.mode], "linestyle": style, "label": run.name, "linewidth": 1.2}
        a.plot(times, tokens, **kw)
        b.plot(times, [k / t for k, t in zip(tokens, times, strict=True)], **kw)
    first = next(run for run in sim.runs if run.mode == FORWARD)
    for f in first.faults:  # when forward recovery met each fault
        if f.time_s <= sim.budget_s:
            a.axvline(f.time_s, color="grey", alpha=0.12, linewidth=0.8)
    a.set_xlabel("wall time (s)")
    a.set_ylabel("tokens of the steps that stand")
    a.set_title("Committed tokens over time")
    b.set_xlabel("wall time (s)")
    b.set_ylabel("tokens / s since the start")
    b.set_title("Effective throughput over time")
    for ax in (a, b):
        ax.legend(fontsize=7)
    fig.suptitle(f"nanotron-recover simulate, profile {sim.profile}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def to_json(sim: Simulation) -> dict:
    """The report's data, JSON-serialisable."""
    return {
        "profile": sim.profile,
        "workload": asdict(sim.workload),
        "budget_s": sim.budget_s,
        "faults": [asdict(f) for f in sim.faults],
        "rows": [asdict(r) for r in sim.rows],
        "schedule_steps": sim.steps,
        "schedule": [asdict(r) for r in sim.schedule or []],
        "runs": [
            {
                "run": run.name,
                "wall_s": run.wall_s,
                "faults": [asdict(f) for f in run.faults],
                "joins": run.joins,
                "progress": run.progress,
            }
            for run in sim.runs
        ],
        "paper": PAPER if sim.paper else None,
    }


def run_simulate(args: argparse.Namespace) -> int:
    """``nanotron-recover simulate``: print the constants or the report."""
    try:
        profile = get_profile(args.profile, parse_overrides(args.set_constant))
    except (KeyError, ValueError) as e:
        raise InputError(str(e).strip("'\"")) from None
    if args.constants:
        print(format_constants(profile))
        return 0
    if args.every < 1 or not 0.0 <= args.fault_at <= 1.0:
        raise InputError("--every must be >= 1 and --fault-at within 0..1")
    try:
        sim = run_simulation(args)
    except ValueError as e:
        raise InputError(str(e)) from None
    print("\n".join(header(sim) + [""] + format_rows(sim)))
    print(f"\nthe whole schedule ({sim.steps} steps), tokens per second per GPU held:\n")
    print("\n".join(format_schedule(sim)))
    if sim.paper:
        print("\n" + "\n".join(paper_lines(sim)))
    if args.plot:
        plot(sim, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(sim), indent=2))
        print(f"wrote {args.json}")
    return 0
