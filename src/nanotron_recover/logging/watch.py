"""``nanotron-recover watch RUN_DIR``: a running job seen from its run directory alone.

Everything comes from the files the job writes (so it works from a login node that shares the
run directory's filesystem, and never touches the job): ``metrics.jsonl``, ``incidents.jsonl``,
``ranks.json``, ``run.json``, ``outcome.json``, ``generation.json``, ``fence/`` and, for spawned
processes, ``heartbeats/``. Three steps, the last two pure:

- :func:`read_run` reads those files into :class:`RunRecords` (the only I/O; torn or missing files
  read as absent);
- :func:`summarize` turns records into a :class:`RunView`: each rank's state (``alive``,
  ``spawned``, ``parked``, ``lost``), each host's heartbeat age, step / target and ETA, recent
  loss and tokens/s, where the step's time goes, the last incidents with their cost, re-joins and
  relaunches;
- :func:`render` draws a view as ``rich`` renderables; :func:`render_text` as a string.

A rank's state follows the incidents in order: a failure marks the replicas it names lost, their
failed (or hung) ranks lost and their other ranks parked when the run re-joins lost replicas
(``recover.rejoin.mode: spawn``, from ``run.json``), lost when they left with their replica; a
joined re-join makes the replica alive again, its spawned ranks ``spawned``; a relaunch (a lost
node or job) keeps the replicas it names alive.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..fencing import REMOVED_DIR
from ..generation import FILENAME as GENERATION_FILE
from .progress import format_duration, format_rate
from .runinfo import read_run_info

# The phases of a step, as its metrics record names them (timing.PhaseTimes.record), in order.
PHASES = ("compute_s", "gate_s", "reduce_s", "agree_s", "optimizer_s", "checkpoint_s", "recovery_s")
RELAUNCH_KINDS = ("node_lost", "job_lost", "stalled", "regrow")
STATES = ("alive", "spawned", "parked", "lost")
SPARK = "▁▂▃▄▅▆▇█"
TAIL_BYTES = 1 << 20  # metrics.jsonl is read from its last MiB: recent steps are what is shown
STATE_STYLE = {"alive": "green", "spawned": "cyan", "parked": "yellow", "lost": "bold red"}


# -- reading --------------------------------------------------------------------------------------
@dataclass
class RunRecords:
    """What a run directory holds, as read at ``now`` (wall clock)."""

    metrics: list[dict[str, Any]] = field(default_factory=list)  # the most recent ones
    incidents: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # ranks.json
    info: dict[str, Any] | None = None  # run.json
    outcome: dict[str, Any] | None = None  # outcome.json
    relaunch: dict[str, Any] | None = None  # generation.json
    heartbeats: dict[tuple[str, int], float] = field(default_factory=dict)  # (host, pid) -> mtime
    fenced: set[tuple[str, int]] = field(default_factory=set)  # processes removed from the job
    now: float = 0.0
    name: str = ""


def _parse_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Each complete JSON object; a torn line (being written, or cut by a tail) is skipped."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _read_tail(path: Path, max_bytes: int = TAIL_BYTES) -> list[dict[str, Any]]:
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(size - max_bytes, 0))
            data = f.read()
    except OSError:
        return []
    return _parse_lines(data.decode(errors="replace").splitlines())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _host_pid(name: str, sep: str) -> tuple[str, int] | None:
    host, _, pid = name.rpartition(sep)
    return (host, int(pid)) if host and pid.isdigit() else None


def read_run(run_dir: str | Path, now: float | None = None, logs: bool = True) -> RunRecords:
    """Read ``run_dir``'s records (see the module docstring); a file not there yet reads as empty.
    ``logs=False`` skips the metrics and incident logs (for a reader that holds them already)."""
    run_dir = Path(run_dir)
    heartbeats: dict[tuple[str, int], float] = {}
    try:
        beats = list((run_dir / "heartbeats").iterdir())
    except OSError:
        beats = []
    for path in beats:
        key = _host_pid(path.name, ".")
        try:
            if key is not None:
                heartbeats[key] = path.stat().st_mtime
        except OSError:
            continue  # removed while we looked
    try:
        fenced = {k for p in (run_dir / REMOVED_DIR).iterdir() if (k := _host_pid(p.name, "-")) is not None}
    except OSError:
        fenced = set()
    ranks = _read_json(run_dir / "ranks.json")
    outcome = _read_json(run_dir / "outcome.json")
    relaunch = _read_json(run_dir / GENERATION_FILE)
    return RunRecords(
        metrics=_read_tail(run_dir / "metrics.jsonl") if logs else [],
        incidents=_read_tail(run_dir / "incidents.jsonl", max_bytes=1 << 62) if logs else [],
        ranks=ranks if isinstance(ranks, list) else [],
        info=read_run_info(run_dir),
        outcome=outcome if isinstance(outcome, dict) else None,
        relaunch=relaunch if isinstance(relaunch, dict) else None,
        heartbeats=heartbeats,
        fenced=fenced,
        now=time.time() if now is None else now,
        name=run_dir.resolve().name,
    )


# -- the view -------------------------------------------------------------------------------------
@dataclass
class RankView:
    rank: int
    replica: int
    host: str
    pid: int | None
    state: str
    heartbeat_age_s: float | None = None  # spawned processes only (ULFM watches the others)


@dataclass
class ReplicaView:
    replica: int
    state: str  # alive or lost
    ranks: list[RankView]
    failures: int = 0  # times lost
    rejoins: int = 0  # times it came back


@dataclass
class HostView:
    host: str
    ranks: list[int]
    heartbeat_age_s: float | None  # the oldest heartbeat of its spawned processes; None: none beat


@dataclass
class RunView:
    name: str
    status: str  # waiting (no step yet), running, completed, stopped
    step: int
    target: int | None
    eta_s: float | None
    last_step_age_s: float | None
    loss: float | None
    tokens_per_s: float | None
    replicas_alive: int
    replicas_target: int
    losses: list[float]
    tokens_per_s_history: list[float]
    phases: dict[str, float]  # the last step's seconds per phase, and wall_s
    phases_mean: dict[str, float]  # over the recent steps
    replicas: list[ReplicaView]
    hosts: list[HostView]
    rank_states: dict[str, int]
    incidents: list[dict[str, Any]]  # the last few, oldest first
    incident_counts: dict[str, int]  # by kind
    rejoins_joined: int
    rejoins_failed: int
    relaunches: int
    generation: int
    hosts_lost: list[str]
    message: str | None  # a stopped run's reason


def incident_kind(record: Mapping[str, Any]) -> str:
    """The kind an incident counts under: its ``kind``, or ``restart`` for a checkpoint-restart."""
    kind = record.get("kind")
    if kind:
        return str(kind)
    return "restart" if record.get("action") == "restart" else "unknown"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _eta(metrics: Sequence[Mapping[str, Any]], target: int | None) -> float | None:
    """Seconds to ``target`` at the rate of the recent steps (their wall-clock ``time`` stamps, or
    their ``wall_s`` where the records have no stamps)."""
    if not metrics or target is None:
        return None
    step = int(metrics[-1]["step"])
    if step >= target:
        return 0.0
    recent = [r for r in metrics[-20:] if _number(r.get("time")) is not None]
    if len(recent) >= 2 and recent[-1]["step"] > recent[0]["step"]:
        per_step = (recent[-1]["time"] - recent[0]["time"]) / (recent[-1]["step"] - recent[0]["step"])
    else:
        walls = [
            w for r in metrics[-20:] if (w := _number(r.get("wall_s", r.get("step_time_s")))) is not None
        ]
        if not walls:
            return None
        per_step = sum(walls) / len(walls)
    return max(per_step, 0.0) * (target - step)


def _ranks_per_replica(records: RunRecords) -> tuple[int, int]:
    """(replicas, ranks per replica) of the grid."""
    info = records.info or {}
    size = int(info.get("replica_size") or 0)
    replicas = int(info.get("dp") or 0)
    if records.ranks:
        per: Counter[int] = Counter(int(r.get("replica", 0)) for r in records.ranks)
        size = size or max(per.values())
        replicas = replicas or max(per) + 1
    if not replicas and records.metrics:
        replicas = max(int(r.get("replicas") or 0) for r in records.metrics)
    return replicas, max(size, 1)


def summarize(records: RunRecords, incidents_shown: int = 6, history: int = 60) -> RunView:
    """The view of a run from its records (pure: no I/O, ``records.now`` is the clock)."""
    info = records.info or {}
    W, size = _ranks_per_replica(records)
    table = {int(r["rank"]): r for r in records.ranks if "rank" in r}
    rejoin_on = info.get("rejoin") == "spawn"

    replica_state = dict.fromkeys(range(W), "alive")
    rank_state = {k: "alive" for k in range(W * size)}
    failures: Counter[int] = Counter()
    rejoined: Counter[int] = Counter()
    joined = failed_joins = relaunches = 0
    hosts_lost: list[str] = []
    back: set[int] = set()  # ranks brought back by a re-join since their last failure

    def ranks_of(replica: int) -> range:
        return range(replica * size, (replica + 1) * size)

    for inc in records.incidents:
        kind = incident_kind(inc)
        if kind == "rejoin":
            if inc.get("status") != "joined":
                failed_joins += 1
                continue
            joined += 1
            spawned = set(inc.get("spawned_ranks") or [])
            for rep in inc.get("replicas") or []:
                replica_state[rep] = "alive"
                rejoined[rep] += 1
                for k in ranks_of(rep):
                    rank_state[k] = "spawned" if k in spawned else "alive"
                    back.add(k)
        elif kind in RELAUNCH_KINDS or kind == "restart":
            relaunches += 1
            hosts_lost += [h for h in inc.get("hosts_lost") or [] if h not in hosts_lost]
            alive = set(inc.get("alive_replicas") or range(W))
            for rep in range(W):
                replica_state[rep] = "alive" if rep in alive else "lost"
                for k in ranks_of(rep):
                    rank_state[k] = "alive" if rep in alive else "lost"
        else:
            dead = set(inc.get("failed_ranks") or []) | set(inc.get("hung_ranks") or [])
            for rep in inc.get("failed_replicas") or []:
                failures[rep] += 1
                replica_state[rep] = "lost"
                for k in ranks_of(rep):
                    back.discard(k)
                    rank_state[k] = "lost" if k in dead or not rejoin_on else "parked"
            if inc.get("alive_replicas") is not None:
                for rep in set(range(W)) - set(inc["alive_replicas"]):
                    replica_state[rep] = "lost"
                    for k in ranks_of(rep):
                        if rank_state[k] in ("alive", "spawned"):
                            rank_state[k] = "lost"

    rank_views: dict[int, RankView] = {}
    for k, state in rank_state.items():
        row = table.get(k, {})
        host, pid = str(row.get("host", "?")), row.get("pid")
        beat = records.heartbeats.get((host, pid)) if pid is not None else None
        if (host, pid) in records.fenced and k not in back:
            # A removed process still in the table; once its rank re-joined, the table (rewritten
            # just after the re-join's incident) may lag behind it.
            state = "lost"
        elif beat is not None and state == "alive":
            state = "spawned"  # only spawned processes keep a heartbeat file
        age = max(records.now - beat, 0.0) if beat is not None and state != "lost" else None
        rank_views[k] = RankView(k, k // size, host, pid, state, age)
    replicas = [
        ReplicaView(
            rep, replica_state[rep], [rank_views[k] for k in ranks_of(rep)], failures[rep], rejoined[rep]
        )
        for rep in range(W)
    ]
    by_host: dict[str, list[RankView]] = {}
    for rv in rank_views.values():
        by_host.setdefault(rv.host, []).append(rv)
    hosts = [
        HostView(
            host,
            [rv.rank for rv in rvs],
            max((rv.heartbeat_age_s for rv in rvs if rv.heartbeat_age_s is not None), default=None),
        )
        for host, rvs in sorted(by_host.items())
    ]

    metrics = records.metrics
    last = metrics[-1] if metrics else {}
    target = info.get("target_step")
    if records.outcome is not None:
        target = records.outcome.get("target_step", target)
    status = "waiting" if not metrics else "running"
    message = None
    if records.outcome is not None:
        status = str(records.outcome.get("status", "stopped"))
        message = records.outcome.get("message")
    recent = metrics[-history:]
    phases = {p: v for p in (*PHASES, "wall_s") if (v := _number(last.get(p))) is not None}
    phases_mean = {}
    for p in (*PHASES, "wall_s"):
        values = [v for r in recent if (v := _number(r.get(p))) is not None]
        if values:
            phases_mean[p] = sum(values) / len(values)
    stamp = _number(last.get("time"))
    alive_now = (
        int(last.get("replicas") or 0) if metrics else sum(s == "alive" for s in replica_state.values())
    )
    relaunch = records.relaunch or {}
    return RunView(
        name=str(info.get("run") or records.name),
        status=status,
        step=int(last.get("step", 0)),
        target=int(target) if isinstance(target, int) else None,
        eta_s=None if status in ("completed", "stopped") else _eta(metrics, target),
        last_step_age_s=max(records.now - stamp, 0.0) if stamp is not None else None,
        loss=_number(last.get("loss")),
        tokens_per_s=_number(last.get("tokens_per_s")),
        replicas_alive=alive_now,
        replicas_target=W,
        losses=[v for r in recent if (v := _number(r.get("loss"))) is not None],
        tokens_per_s_history=[v for r in recent if (v := _number(r.get("tokens_per_s"))) is not None],
        phases=phases,
        phases_mean=phases_mean,
        replicas=replicas,
        hosts=hosts,
        rank_states={s: sum(rv.state == s for rv in rank_views.values()) for s in STATES},
        incidents=records.incidents[-incidents_shown:],
        incident_counts=dict(Counter(incident_kind(i) for i in records.incidents)),
        rejoins_joined=joined,
        rejoins_failed=failed_joins,
        relaunches=relaunches,
        generation=int(relaunch.get("generation") or 0),
        hosts_lost=sorted(set(hosts_lost) | set(relaunch.get("hosts_lost") or [])),
        message=message,
    )


# -- drawing --------------------------------------------------------------------------------------
def sparkline(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as block characters, lowest to highest."""
    values = list(values)[-max(width, 1) :]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo <= 0:
        return SPARK[0] * len(values)
    top = len(SPARK) - 1
    return "".join(SPARK[round((v - lo) / (hi - lo) * top)] for v in values)


def _s(value: Any, digits: int = 3, unit: str = "s") -> str:
    number = _number(value)
    return "-" if number is None else f"{number:.{digits}f}{unit}"


def describe_incident(record: Mapping[str, Any]) -> tuple[str, str]:
    """(what happened, what it cost) of an incident record, in a few words each."""
    kind = incident_kind(record)
    if kind == "rejoin":
        if record.get("status") == "joined":
            what = f"replicas {record.get('replicas')} re-joined ({len(record.get('spawned_ranks') or [])} spawned)"
            cost = (
                f"join {_s(record.get('join_s'), 2)} (spawn {_s(record.get('spawn_s'), 2)}, "
                f"transfer {_s(record.get('transfer_s'))})"
            )
            return what, cost
        return f"re-join of {record.get('replicas')} {record.get('status')}: {record.get('reason', '')}", "-"
    if kind in RELAUNCH_KINDS:
        lost = record.get("hosts_lost") or []
        what = (
            f"relaunched, generation {record.get('generation')} from the {record.get('state_from')} of step "
            f"{record.get('restored_step')}" + (f"; hosts lost {lost}" if lost else "")
        )
        return what, f"restart {_s(record.get('restart_s'), 1)}, {record.get('steps_redone', 0)} steps redone"
    if kind == "restart":
        what = f"restart {record.get('restart')} from step {record.get('resumed_from_step')}"
        return what, f"stall {_s(record.get('stall_s'), 1)}"
    what = (
        f"replicas {record.get('failed_replicas')} lost in {record.get('phase')}, {record.get('action')}, "
        f"{record.get('extra_microbatches', 0)} redone"
    )
    cost = (
        f"detect {_s(record.get('detect_s'))} recover {_s(record.get('recover_s'))} "
        f"redo {_s(record.get('redo_s'))}"
    )
    return what, cost


def _state(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, ""))


def _rank_cell(ranks: Sequence[RankView]) -> Text:
    """Each rank (few per replica), or counts per state (many)."""
    text = Text()
    if len(ranks) <= 4:
        for i, rv in enumerate(ranks):
            if i:
                text.append("  ")
            text.append(f"{rv.rank}:")
            text.append(rv.state, style=STATE_STYLE.get(rv.state, ""))
            text.append(f"@{rv.host}")
        return text
    counts = Counter(rv.state for rv in ranks)
    hosts = sorted({rv.host for rv in ranks})
    for i, state in enumerate(s for s in STATES if counts[s]):
        if i:
            text.append(" ")
        text.append(f"{counts[state]} {state}", style=STATE_STYLE[state])
    text.append(f" on {', '.join(hosts[:3])}" + (f" +{len(hosts) - 3}" if len(hosts) > 3 else ""))
    return text


def _replica_table(view: RunView) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("replica", "state", "rank:state@host", "lost", "back"):
        table.add_column(column)
    # With many replicas, a run of untroubled alive ones is one row.
    group: list[ReplicaView] = []

    def flush() -> None:
        if len(group) > 2 and len(view.replicas) > 16:
            ranks = [rv for rep in group for rv in rep.ranks]
            table.add_row(
                f"{group[0].replica}-{group[-1].replica}", _state("alive"), _rank_cell(ranks), "", ""
            )
        else:
            for rep in group:
                row(rep)
        group.clear()

    def row(rep: ReplicaView) -> None:
        table.add_row(
            str(rep.replica),
            _state(rep.state),
            _rank_cell(rep.ranks),
            str(rep.failures or ""),
            str(rep.rejoins or ""),
        )

    for rep in view.replicas:
        if rep.state == "alive" and not rep.failures and all(r.state == "alive" for r in rep.ranks):
            group.append(rep)
            continue
        flush()
        row(rep)
    flush()
    return table


def _host_table(view: RunView) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("host", "ranks", "heartbeat"):
        table.add_column(column)
    for host in view.hosts:
        ranks = ",".join(str(k) for k in host.ranks[:8]) + ("..." if len(host.ranks) > 8 else "")
        age = "-" if host.heartbeat_age_s is None else f"{host.heartbeat_age_s:.1f}s ago"
        table.add_row(host.host, ranks, age)
    return table


def _progress(view: RunView, width: int) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    spark_width = max(min(width // 2 - 24, 60), 8)
    loss = "-" if view.loss is None else f"{view.loss:.4f}"
    rate = "-" if view.tokens_per_s is None else format_rate(view.tokens_per_s)
    table.add_row("loss", loss, sparkline(view.losses, spark_width))
    table.add_row("tokens/s", rate, sparkline(view.tokens_per_s_history, spark_width))
    table.add_row("replicas", f"{view.replicas_alive}/{view.replicas_target}", "")
    return table


def _phase_table(view: RunView) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("phase", "last", "mean", "share"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    wall = view.phases_mean.get("wall_s") or 0.0
    for p in (*PHASES, "wall_s"):
        if p not in view.phases_mean:
            continue
        share = view.phases_mean[p] / wall if wall > 0 and p != "wall_s" else None
        bar = "" if share is None else "█" * round(min(share, 1.0) * 10) + f" {share:5.1%}"
        table.add_row(p[:-2], _s(view.phases.get(p), unit=""), _s(view.phases_mean[p], unit=""), bar)
    return table


def _incident_table(view: RunView) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("step", "kind", "what", "cost"):
        table.add_column(column, overflow="fold")
    for record in view.incidents:
        what, cost = describe_incident(record)
        table.add_row(str(record.get("step", "?")), incident_kind(record), what, cost)
    return table


def header(view: RunView) -> Text:
    """The first line: run, status, step / target, ETA, age of the last step."""
    text = Text()
    text.append(f"{view.name}  ", style="bold")
    text.append(view.status, style={"completed": "green", "stopped": "bold red"}.get(view.status, "cyan"))
    target = "?" if view.target is None else str(view.target)
    text.append(f"  step {view.step}/{target}")
    if view.target:
        text.append(f" ({min(view.step / view.target, 1.0):.0%})")
    if view.eta_s is not None and view.status == "running":
        text.append(f"  ETA {format_duration(view.eta_s)}")
    if view.last_step_age_s is not None and view.status == "running":
        text.append(f"  last step {format_duration(view.last_step_age_s)} ago")
    if view.generation:
        text.append(f"  generation {view.generation}")
    if view.message:
        text.append(f"\n{view.message}", style="red")
    return text


def _side_by_side(left: RenderableType, right: RenderableType) -> Table:
    grid = Table.grid(expand=True)
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    grid.add_row(left, right)
    return grid


def render(view: RunView, width: int = 100) -> RenderableType:
    """The whole frame of a view."""
    states = "  ".join(f"{n} {s}" for s, n in view.rank_states.items() if n)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(view.incident_counts.items())) or "none"
    summary = Text(
        f"{counts}; re-joins: {view.rejoins_joined} joined, {view.rejoins_failed} failed; "
        f"relaunches: {view.relaunches}"
        + (f" (hosts lost: {', '.join(view.hosts_lost)})" if view.hosts_lost else "")
    )
    parts: list[RenderableType] = [
        header(view),
        _side_by_side(
            Panel(_progress(view, width), title="progress", title_align="left"),
            Panel(_phase_table(view), title="step time (s)", title_align="left"),
        ),
        _side_by_side(
            Panel(
                Group(_replica_table(view), Text(f"ranks: {states}")), title="replicas", title_align="left"
            ),
            Panel(_host_table(view), title="hosts (spawned processes' heartbeat)", title_align="left"),
        ),
        Panel(Group(summary, _incident_table(view)), title="incidents", title_align="left"),
    ]
    return Group(*parts)


def render_text(records: RunRecords, width: int = 100, color: bool = False) -> str:
    """One frame as a string: plain text (no escape codes) unless ``color``."""
    out = io.StringIO()
    console = Console(
        file=out,
        width=width,
        force_terminal=color,
        color_system="standard" if color else None,
        highlight=False,
        emoji=False,
        legacy_windows=False,
    )
    console.print(render(summarize(records), width))
    return out.getvalue()


def watch(run_dir: str | Path, once: bool = False, interval_s: float = 1.0, width: int | None = None) -> int:
    """The command: one frame (``once``), or a frame redrawn every ``interval_s`` until Ctrl-C."""
    from ..errors import InputError

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir} is not a run directory")
    console = Console(highlight=False, emoji=False, width=width)
    if once:
        console.print(render(summarize(read_run(run_dir)), console.width))
        return 0
    from rich.live import Live

    def frame() -> RenderableType:
        return render(summarize(read_run(run_dir)), console.width)

    try:
        with Live(frame(), console=console, screen=True, auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0
