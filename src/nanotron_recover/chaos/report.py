"""Judging a chaos campaign: what the job did about each fault, and whether it still trained the
fault-free run. Writes ``chaos.json`` and ``chaos.md``.

Per fault (``faults``): its kind, target (rank, replica, pid of each signal), the step it was
scheduled for and the step in progress when it was sent, what the job did -- the incidents the job
recorded between this fault and the next one (``incidents.jsonl``: kind and action of a repair, a
re-join's status, a relaunch's generation from ``generation.json``), the time from the fault to the
next commit and to the next commit at full width, and the steps redone (a relaunch's
``steps_redone``).

Totals: the share of the wall time (first to last commit) spent training at full width (``replicas``
equal to the initial ``dp`` at both ends of the time between two commits, a relaunch's gap excluded:
:func:`full_width_share`), where the rest went (:func:`below_full_width`: inside some fault's
window, from the fault to the next commit at full width, or outside every window), relaunches,
failed and given-up re-joins, healthy ranks declared dead (a rank in an incident's ``failed_ranks``
whose replica no fault of that window struck, or any before the first fault), relaunches at full
width (a relaunch in a fault's window after the job was back at full width, or before the first
fault: no reaction to a fault, the job was lost with every replica in it), the launch's exit status,
the final width, and equality with the plain run: every step 1..N committed with the reference's
``ids_digest`` and a loss within 1e-5 relative (bit for bit, loss and grad norm, with
``recover.exact``), the comparison :mod:`..compare` makes.

The campaign's own exit status (:func:`verdict`): 0 only when the job exited 0, equals the plain
run and did not hang, and every fault was sent; 3 for a hang; 1 for a job that failed or left the
fault-free curve; 4 when the job was fine but some faults could not be sent.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
from pathlib import Path
from typing import Any

from ..compare import compare_pair, load_run
from ..logging.watch import RELAUNCH_KINDS as WATCH_RELAUNCH_KINDS
from .runner import CampaignRun
from .schedule import Schedule

REL_TOL = 1e-5
# A time between two commits longer than this many times the run's median is a stall, not
# training: it counts as time not at full width whatever the width at both ends.
STALL_FACTOR = 10.0
# The supervisor relaunched the job (a regrow too: it was counted as a rank's failure before).
RELAUNCH_KINDS = WATCH_RELAUNCH_KINDS
JOB_KINDS = ("rejoin", *RELAUNCH_KINDS)  # incidents that are not a rank's failure


def compare_with_reference(run_dir: Path, ref_dir: Path, steps: int, exact: bool) -> dict[str, Any]:
    """Every step 1..steps in both runs, the same ids, the loss within REL_TOL (equal with exact)."""
    ref, job = load_run(ref_dir), load_run(run_dir)
    c = compare_pair(ref, job)
    want = list(range(1, steps + 1))
    missing = [s for s in want if s not in job.steps]
    mismatched_ids = [
        s for s in want if s in job.steps and job.steps[s].get("ids_digest") != ref.steps[s].get("ids_digest")
    ]
    loss_off = []
    for s in want:
        if s not in job.steps:
            continue
        a, b = ref.steps[s].get("loss"), job.steps[s].get("loss")
        if exact:
            bad = a != b or ref.steps[s].get("grad_norm") != job.steps[s].get("grad_norm")
        else:
            bad = not isinstance(b, (int, float)) or not math.isclose(a, b, rel_tol=REL_TOL, abs_tol=0.0)
        if bad:
            loss_off.append(s)
    return {
        "reference": str(ref_dir),
        "steps": len(job.steps),
        "missing_steps": missing,
        "ids_mismatch_steps": mismatched_ids,
        "loss_mismatch_steps": loss_off,
        "max_abs_loss_diff": c.max_abs_loss_diff,
        "max_rel_loss_diff": c.max_rel_loss_diff,
        "tolerance": "bitwise (recover.exact)" if exact else f"{REL_TOL:g} relative",
        "equal": not missing and not mismatched_ids and not loss_off and sorted(job.steps) == want,
    }


def _gaps(
    metrics: list[dict[str, Any]], dp: int, relaunched_steps: set[int] | frozenset[int]
) -> list[tuple[float, float, bool]]:
    """Each time between two timed commits as ``(start, end, at_full_width)``: see
    :func:`full_width_share` for which count as full width."""
    timed = [r for r in metrics if isinstance(r.get("time"), (int, float))]
    if len(timed) < 2:
        return []
    stall_s = STALL_FACTOR * statistics.median(
        b["time"] - a["time"] for a, b in zip(timed, timed[1:], strict=False)
    )
    # A relaunch may redo a step: the new launch's commit of it is the last record of that step.
    last_of_step = {r["step"]: i for i, r in enumerate(timed)}
    gaps = []
    for i, (a, b) in enumerate(zip(timed, timed[1:], strict=False), start=1):
        full = (
            a.get("replicas") == dp
            and b.get("replicas") == dp
            and not (b["step"] in relaunched_steps and last_of_step.get(b["step"]) == i)
            and b["time"] - a["time"] <= stall_s
        )
        gaps.append((a["time"], b["time"], full))
    return gaps


def full_width_share(
    metrics: list[dict[str, Any]], dp: int, relaunched_steps: set[int] | frozenset[int] = frozenset()
) -> float | None:
    """Share of the wall time from the first to the last commit spent training at full width.

    The time between two commits counts only when both are at full width, the later one is not
    the first commit of a relaunched launch (``relaunched_steps``: the ``step`` of each relaunch
    incident, the first step the new launch committed), and it is no stall: at most
    :data:`STALL_FACTOR` times the run's median time between commits. So a stall, a relaunch, and
    the wait of a re-join before its first full step count for their seconds as time not at full
    width, whatever width the job comes back at. A stall with every replica still in the job (the
    others waiting for a cut-off one) is no time at full width either: nothing trained."""
    gaps = _gaps(metrics, dp, relaunched_steps)
    if not gaps:
        return None
    total = gaps[-1][1] - gaps[0][0]
    full = sum(b - a for a, b, at_full in gaps if at_full)
    return full / total if total > 0 else None


def below_full_width(
    metrics: list[dict[str, Any]],
    dp: int,
    relaunched_steps: set[int] | frozenset[int],
    fault_windows: list[tuple[float, float]],
) -> dict[str, Any]:
    """Where the time not at full width went: the seconds inside some fault's window (from the
    fault to the job's next commit at full width) and the seconds outside every window -- a stall
    with every replica in the job that no fault explains (a busy machine, a slow save), listed by
    its commit times so it can be found in the logs."""
    merged: list[list[float]] = []  # a fault sent before the last one's window closed
    for start, end in sorted(fault_windows):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    inside = outside = 0.0
    stalls = []
    for a, b, at_full in _gaps(metrics, dp, relaunched_steps):
        if at_full:
            continue
        covered = sum(max(0.0, min(b, end) - max(a, start)) for start, end in merged)
        inside += covered
        if b - a - covered > 0:
            outside += b - a - covered
            stalls.append({"from": a, "to": b, "outside_s": b - a - covered})
    stalls.sort(key=lambda s: -s["outside_s"])
    return {
        "in_fault_windows_s": inside,
        "outside_s": outside,
        "outside_gaps": len(stalls),
        "longest_outside": stalls[:10],
    }


def _back_at_full_width(commits: list[Any], sent_at: float, window: list[dict[str, Any]], dp: int) -> Any:
    """The commit that ended a fault's time below full width: the first at full width after the
    fault and not before its reaction. A fault that strikes as a step commits lets that step
    commit at full width; its crash, repair or relaunch comes with the next step (seen in the long
    campaign: 4 of 40 faults), so the commit must be of the step the window's first incident names
    or later, and the last commit of that step (a relaunch may redo it). Later incidents of the
    window are not waited for: a relaunch after the job was whole again is no reaction (``judge``)."""
    steps = [int(i["step"]) for i in window if isinstance(i.get("step"), int)]
    after = steps[0] if steps else 0
    last = {c.step: k for k, c in enumerate(commits)}
    return next(
        (
            c
            for k, c in enumerate(commits)
            if c.time > sent_at and c.replicas == dp and c.step >= after and last[c.step] == k
        ),
        None,
    )


def _describe_incident(i: dict[str, Any]) -> str:
    kind = i.get("kind")
    if kind == "rejoin":
        extra = f" ({i['reason']})" if i.get("reason") else ""
        return f"rejoin {i.get('status')} @{i.get('step')}{extra}"
    if kind in RELAUNCH_KINDS:
        return f"{kind} -> generation {i.get('generation')} from {i.get('state_from')} @{i.get('step')}"
    return (
        f"{kind} in {i.get('phase')} @{i.get('step')} replicas {i.get('failed_replicas')} ({i.get('action')})"
    )


def judge(
    *,
    run: CampaignRun,
    schedule: Schedule,
    run_dir: Path,
    ref_dir: Path | None,
    dp: int,
    replica_size: int,
    steps: int,
    exact: bool,
    replay_cmd: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The campaign's record (what ``chaos.json`` holds)."""
    watch = run.watch
    assert watch is not None
    incidents = list(watch.incidents)
    metrics = list(watch.metrics.records)
    sent = run.sent
    faults = []
    windows: list[tuple[float, float]] = []  # each sent fault's, up to the next commit at full width
    healthy_dead: list[dict[str, Any]] = []
    starts = [f["incidents_before"] for f in sent] + [len(incidents)]
    unexplained_relaunches: list[dict[str, Any]] = [
        {"incident": i, "step": incident.get("step"), "kind": incident.get("kind"), "after_fault": None}
        for i, incident in enumerate(incidents[: starts[0]] if sent else incidents)
        if incident.get("kind") in RELAUNCH_KINDS
    ]
    for i, incident in enumerate(incidents[: starts[0]] if sent else incidents):
        if incident.get("kind") not in JOB_KINDS and incident.get("failed_ranks"):
            healthy_dead.append({"incident": i, "ranks": incident["failed_ranks"], "before_any_fault": True})
    for n, f in enumerate(sent):
        window = incidents[starts[n] : starts[n + 1]]
        struck = {s["replica"] for s in f["signals"] if s["sent"] and s["replica"] is not None}
        if f["kind"] == "kill_all":
            struck = set(range(dp))
        for k, incident in enumerate(window):
            if incident.get("kind") in JOB_KINDS:
                continue
            unexplained = [r for r in incident.get("failed_ranks", []) if r // replica_size not in struck]
            if unexplained:
                healthy_dead.append({"incident": starts[n] + k, "ranks": unexplained, "fault": f["index"]})
        sent_at = f.get("sent_at")
        full = None
        if sent_at is not None:
            full = _back_at_full_width(watch.commits, sent_at, window, dp)
            windows.append((sent_at, full.time if full is not None else math.inf))
        relaunches = [i for i in window if i.get("kind") in RELAUNCH_KINDS]
        redone = sum(int(i.get("steps_redone", 0)) for i in relaunches)
        # A relaunch after the job was back at full width is no reaction to this fault: the job
        # was lost with every replica healthy (or by the fault's aftermath, e.g. a thawed node).
        if full is not None:
            unexplained_relaunches += [
                {
                    "incident": starts[n] + k,
                    "step": i.get("step"),
                    "kind": i.get("kind"),
                    "after_fault": f["index"],
                }
                for k, i in enumerate(window)
                if i.get("kind") in RELAUNCH_KINDS and int(i.get("step", 0)) > full.step
            ]
        faults.append(
            {
                **{k: v for k, v in f.items() if k not in ("incidents_before", "generation_before")},
                "target": [
                    {k: s[k] for k in ("rank", "replica", "pid")} | {"signal": signal.Signals(s["sig"]).name}
                    for s in f["signals"]
                    if s["sent"]
                ],
                "reaction": [_describe_incident(i) for i in window],
                "incident_kinds": [i.get("kind") for i in window],
                "relaunches": [i.get("generation") for i in relaunches],
                "to_full_width_s": (full.time - sent_at)
                if full is not None and sent_at is not None
                else None,
                "steps_redone": redone,
            }
        )
    comparison = (
        compare_with_reference(run_dir, ref_dir, steps, exact) if ref_dir is not None and metrics else None
    )
    rejoins = [i for i in incidents if i.get("kind") == "rejoin"]
    relaunched_steps = {int(i["step"]) for i in incidents if i.get("kind") in RELAUNCH_KINDS and "step" in i}
    totals = {
        "faults_planned": len(schedule.faults),
        "faults_sent": sum(1 for f in sent if f.get("sent_at") is not None),
        "faults_with_reaction": sum(1 for f in faults if f["reaction"]),
        "wall_s": run.ended_at - run.started_at,
        "full_width_share": full_width_share(metrics, dp, relaunched_steps),
        "below_full_width": below_full_width(metrics, dp, relaunched_steps, windows),
        "initial_replicas": dp,
        "final_replicas": metrics[-1].get("replicas") if metrics else None,
        "last_step": metrics[-1]["step"] if metrics else 0,
        "target_step": steps,
        "relaunches": sum(1 for i in incidents if i.get("kind") in RELAUNCH_KINDS),
        "generation": watch.generation,
        "rejoins_joined": sum(1 for i in rejoins if i.get("status") == "joined"),
        "rejoins_failed": sum(1 for i in rejoins if i.get("status") == "failed"),
        "rejoins_given_up": sum(1 for i in rejoins if i.get("status") == "given_up"),
        "healthy_ranks_declared_dead": sum(len(h["ranks"]) for h in healthy_dead),
        "relaunches_at_full_width": len(unexplained_relaunches),
        "exit_status": run.exit_code,
        "outcome": watch.outcome,
        "hang": run.hang,
        "equal_to_plain": bool(comparison and comparison["equal"]),
        "frozen_left_behind": run.left_behind,
    }
    record = {
        "schedule": schedule.to_dict(),
        "replay": replay_cmd,
        "launch": " ".join(run.launch_cmd),
        "faults": faults,
        "unsent": run.unsent,
        "healthy_declared_dead": healthy_dead,
        "relaunches_at_full_width": unexplained_relaunches,
        "comparison": comparison,
        "incidents": incidents,
        "totals": totals,
        **(extra or {}),
    }
    record["exit_status"], record["verdict"] = verdict(totals, run)
    return record


def verdict(totals: dict[str, Any], run: CampaignRun) -> tuple[int, str]:
    """The campaign's exit status and why (see the module)."""
    if totals["hang"] is not None:
        return 3, f"hang: {totals['hang']['message']}"
    if totals["exit_status"] != 0:
        return 1, f"the job exited {totals['exit_status']}"
    if not totals["equal_to_plain"]:
        return 1, "the job did not train the plain run's steps"
    if run.unsent:
        return 4, f"{len(run.unsent)} fault(s) not sent: {run.unsent[0]['why']}"
    return 0, "the job exited 0, trained the plain run's steps and never hung"


def _num(value: Any, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def markdown(record: dict[str, Any]) -> str:
    t = record["totals"]
    lines = [
        "# Chaos campaign",
        "",
        f"Verdict: **exit {record['exit_status']}**: {record['verdict']}.",
        "",
        f"Replay: `{record['replay']}`",
        "",
        "| # | kind | target (rank/replica, signal) | scheduled step | struck step | what the job did | "
        "fault -> next commit (s) | -> full width (s) | steps redone | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in record["faults"]:
        target = ", ".join(f"{s['rank']}/{s['replica']} {s['signal']}" for s in f["target"]) or "-"
        windows = [s.get("in_window") for s in f["signals"] if "in_window" in s]
        notes = list(f.get("notes", []))
        if windows:
            notes.append("in window" if all(windows) else "missed its window")
        if f.get("role"):
            notes.append(f"role {f['role']}")
        lines.append(
            f"| {f['index']} | {f['kind']} | {target} | {f['scheduled_step']} | {f.get('step', '-')} | "
            f"{'; '.join(f['reaction']) or 'nothing recorded'} | {_num(f.get('to_next_commit_s'))} | "
            f"{_num(f.get('to_full_width_s'))} | {f['steps_redone']} | {'; '.join(notes)} |"
        )
    for u in record["unsent"]:
        lines.append(
            f"| {u['index']} | {u['kind']} | - | {u['scheduled_step']} | not sent | {u['why']} | - | - | - | |"
        )
    c = record["comparison"] or {}
    lines += [
        "",
        "| total | value |",
        "|---|---|",
        f"| faults sent / planned | {t['faults_sent']} / {t['faults_planned']} |",
        f"| faults with a recorded reaction | {t['faults_with_reaction']} |",
        f"| wall time | {t['wall_s']:.1f} s |",
        f"| share of wall time at full width ({t['initial_replicas']} replicas) | {_num(t['full_width_share'], '{:.1%}')} |",
        "| time not at full width: in the faults' windows (fault to full width) / outside them | "
        + (
            f"{b['in_fault_windows_s']:.1f} / {b['outside_s']:.1f} s ({b['outside_gaps']} gaps) |"
            if (b := t.get("below_full_width"))
            else "- |"
        ),
        f"| final replicas | {t['final_replicas']} |",
        f"| relaunches | {t['relaunches']} |",
        f"| re-joins joined / failed / given up | {t['rejoins_joined']} / {t['rejoins_failed']} / {t['rejoins_given_up']} |",
        f"| healthy ranks declared dead | {t['healthy_ranks_declared_dead']} |",
        f"| relaunches at full width (no fault's reaction) | {t.get('relaunches_at_full_width', 0)} |",
        f"| exit status of the job | {t['exit_status'] if t['exit_status'] is not None else 'ended by the runner'} |",
        f"| last step / target | {t['last_step']} / {t['target_step']} |",
        f"| equal to the plain run ({c.get('tolerance', '-')}) | {'yes' if t['equal_to_plain'] else 'no'} "
        f"(max rel loss diff {_num(c.get('max_rel_loss_diff'), '{:.2e}')}) |",
        f"| hang | {t['hang']['message'] if t['hang'] else 'none'} |",
        f"| frozen processes left behind | {len(t['frozen_left_behind'])} |",
    ]
    return "\n".join(lines) + "\n"


def write_report(record: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "chaos.json", out / "chaos.md"
    js.write_text(json.dumps(record, indent=1, default=str) + "\n")
    md.write_text(markdown(record))
    return js, md
