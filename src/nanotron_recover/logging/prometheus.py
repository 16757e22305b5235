"""Prometheus metrics of a run, served over HTTP by its logging rank (``logging.prometheus_port``).

The values are a function of the run's records, like ``nanotron-recover watch``: the last metrics
record (step, loss, tokens/s, replicas, seconds per phase), every incident (counted by kind, with
the last detection, recovery, redo and restart times), and the rank grid that ``logging/watch.py``
derives from ``ranks.json``, ``run.json`` and the incidents (ranks per state). So a rank that takes
the logging role over from a failed replica rebuilds the same values from the run directory
(:meth:`RunExporter.start` replays ``incidents.jsonl`` and the last metrics record) and goes on
serving them: counters never restart from zero because the logger moved.

The endpoint. Only the logging rank serves, on ``prometheus_port`` (0: a free port the system
picks). The port is bound without ``SO_REUSEPORT``, so one process on a host holds it: a second
rank (or run) asking for the same port is refused and says so once; a rank taking over from a
predecessor on the same host that still holds the port (frozen, not yet killed) retries at each
step until it is free. Where the endpoint is now -- the logging role moves between hosts -- is
written to ``<run_dir>/prometheus_targets.json`` in Prometheus' ``file_sd_configs`` format, so a
Prometheus server that reads that file follows it. A rank that stops logging (parked, or the role
moved) closes its endpoint.

Metric names (prefix ``nanotron_recover_``): ``step``, ``target_step``, ``loss``,
``tokens_per_second``, ``consumed_tokens``, ``step_seconds{phase}`` (compute, gate, reduce, agree,
optimizer, checkpoint, recovery, wall), ``replicas_alive``, ``replicas_target``,
``ranks{state}`` (alive, spawned, parked, lost), ``incidents_total{kind}``, ``restarts_total``
(relaunches of the job: a lost node or job, a checkpoint-restart), ``rejoins_total{status}``,
``generation``, ``last_detect_seconds``, ``last_recover_seconds``, ``last_redo_seconds``,
``last_restart_seconds``, ``logger_info{host,pid}``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.exposition import start_wsgi_server

from ..atomic_file import write_text_atomically
from .watch import PHASES, RELAUNCH_KINDS, STATES, RunRecords, incident_kind, read_run, summarize

PREFIX = "nanotron_recover"
TARGETS_FILE = "prometheus_targets.json"
GRID_REFRESH_S = 5.0  # the rank grid is re-read at most this often, and after every incident


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class RunMetrics:
    """The run's metrics in a registry of their own, set from records."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

        self.step = gauge("step", "Last committed step")
        self.target_step = gauge("target_step", "Step the run trains to")
        self.loss = gauge("loss", "Loss of the last committed step")
        self.tokens_per_second = gauge("tokens_per_second", "Tokens per second of the last step")
        self.consumed_tokens = gauge("consumed_tokens", "Tokens consumed up to the last step")
        self.step_seconds = gauge("step_seconds", "Seconds of the last step per phase", ("phase",))
        self.replicas_alive = gauge("replicas_alive", "Replicas that computed the last step")
        self.replicas_target = gauge("replicas_target", "Replicas the run was started with")
        self.ranks = gauge("ranks", "Ranks per state (alive, spawned, parked, lost)", ("state",))
        self.generation = gauge("generation", "Relaunch generation of the job (0: never relaunched)")
        self.last_detect = gauge("last_detect_seconds", "Detection time of the last failure")
        self.last_recover = gauge("last_recover_seconds", "Recovery time of the last failure")
        self.last_redo = gauge("last_redo_seconds", "Time recomputing the last failure's micro-batches")
        self.last_restart = gauge(
            "last_restart_seconds", "Failure (or job end) to the relaunched job's commit"
        )
        self.incidents = Counter(
            f"{PREFIX}_incidents", "Incidents by kind", ("kind",), registry=self.registry
        )
        self.restarts = Counter(f"{PREFIX}_restarts", "Relaunches of the job", registry=self.registry)
        self.rejoins = Counter(
            f"{PREFIX}_rejoins", "Re-join attempts by status", ("status",), registry=self.registry
        )
        self.logger = Info(f"{PREFIX}_logger", "The process serving these metrics", registry=self.registry)
        self.incident_records: list[dict[str, Any]] = []
        for state in STATES:
            self.ranks.labels(state).set(0)

    def observe_step(self, record: Mapping[str, Any]) -> None:
        """A metrics record (``metrics.jsonl``)."""
        for gauge, key in (
            (self.step, "step"),
            (self.loss, "loss"),
            (self.tokens_per_second, "tokens_per_s"),
            (self.consumed_tokens, "consumed_tokens"),
            (self.replicas_alive, "replicas"),
        ):
            value = _number(record.get(key))
            if value is not None:
                gauge.set(value)
        for phase in (*PHASES, "wall_s"):
            value = _number(record.get(phase))
            if value is not None:
                self.step_seconds.labels(phase[:-2]).set(value)

    def observe_incident(self, record: Mapping[str, Any]) -> None:
        """An incident record (``incidents.jsonl``)."""
        self.incident_records.append(dict(record))
        kind = incident_kind(record)
        self.incidents.labels(kind).inc()
        if kind == "rejoin":
            self.rejoins.labels(str(record.get("status", "unknown"))).inc()
            return
        if kind in RELAUNCH_KINDS or kind == "restart":
            self.restarts.inc()
            if _number(record.get("generation")) is not None:
                self.generation.set(record["generation"])
            restart = _number(record.get("restart_s", record.get("stall_s")))
            if restart is not None:
                self.last_restart.set(restart)
            return
        for gauge, key in (
            (self.last_detect, "detect_s"),
            (self.last_recover, "recover_s"),
            (self.last_redo, "redo_s"),
        ):
            value = _number(record.get(key))
            if value is not None:
                gauge.set(value)

    def observe_grid(self, records: RunRecords) -> None:
        """The rank grid (``ranks.json``, ``run.json``, heartbeats, fences) with the incidents seen."""
        records.incidents = self.incident_records
        view = summarize(records)
        for state, n in view.rank_states.items():
            self.ranks.labels(state).set(n)
        if view.replicas_target:
            self.replicas_target.set(view.replicas_target)
        if view.target is not None:
            self.target_step.set(view.target)
        self.generation.set(view.generation)

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """A sample's value by its full name (``nanotron_recover_step``), for tests and tools."""
        return self.registry.get_sample_value(name, dict(labels or {}))


def write_targets(run_dir: Path, host: str, port: int, run: str) -> None:
    """``<run_dir>/prometheus_targets.json``: where the endpoint is, for ``file_sd_configs``."""
    path = run_dir / TARGETS_FILE
    try:
        targets = [{"targets": [f"{host}:{port}"], "labels": {"run": run}}]
        write_text_atomically(path, json.dumps(targets, indent=1) + "\n")
    except OSError as e:
        print(f"[nanotron-recover] could not write {path}: {e}", file=sys.stderr, flush=True)


def read_targets(run_dir: str | Path) -> list[str]:
    """The ``host:port`` entries of ``<run_dir>/prometheus_targets.json`` (none if absent)."""
    try:
        groups = json.loads((Path(run_dir) / TARGETS_FILE).read_text())
        return [t for g in groups for t in g["targets"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


class RunExporter:
    """The logging rank's endpoint: :class:`RunMetrics` fed by the trainer, served on ``port``."""

    def __init__(self, run_dir: str | Path, port: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = Path(run_dir)
        self.port = port
        self.metrics = RunMetrics()
        self.host = socket.gethostname()
        self._clock = clock
        self._server: Any = None
        self._thread: Any = None
        self._warned = False
        self._grid_at = -float("inf")
        self._grid_due = False
        self.metrics.logger.info({"host": self.host, "pid": str(os.getpid())})

    @classmethod
    def start(cls, run_dir: str | Path, port: int) -> RunExporter:
        """An exporter holding what the run directory records so far, serving if the port is free."""
        exporter = cls(run_dir, port)
        exporter.replay()
        exporter.serve()
        return exporter

    def replay(self) -> None:
        """Take over the values of the records already written (a logger that moved here)."""
        records = read_run(self.run_dir)
        for record in records.incidents:
            self.metrics.observe_incident(record)
        if records.metrics:
            self.metrics.observe_step(records.metrics[-1])
        self.refresh_grid(force=True)

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def bound_port(self) -> int | None:
        return None if self._server is None else int(self._server.server_port)

    def serve(self) -> bool:
        """Listen on the port (once); False while another process holds it."""
        if self._server is not None:
            return True
        try:
            self._server, self._thread = start_wsgi_server(
                self.port, addr="0.0.0.0", registry=self.metrics.registry
            )
        except OSError as e:
            if not self._warned:
                self._warned = True
                print(
                    f"[nanotron-recover] Prometheus endpoint not served yet: port {self.port} on {self.host}: {e}; "
                    "retrying at each step",
                    file=sys.stderr,
                    flush=True,
                )
            return False
        write_targets(self.run_dir, self.host, self.bound_port, self.run_dir.resolve().name)
        return True

    def refresh_grid(self, force: bool = False) -> None:
        now = self._clock()
        if not (force or self._grid_due or now - self._grid_at >= GRID_REFRESH_S):
            return
        self._grid_at, self._grid_due = now, False
        self.metrics.observe_grid(read_run(self.run_dir, logs=False))

    def observe_step(self, record: Mapping[str, Any]) -> None:
        self.metrics.observe_step(record)
        self.refresh_grid()
        self.serve()  # a port its previous holder (the last logger) has let go of by now

    def observe_incident(self, record: Mapping[str, Any]) -> None:
        self.metrics.observe_incident(record)
        self.refresh_grid(force=True)  # ranks per state follow the incident at once,
        self._grid_due = True  # and again at the next step, when ranks.json names new processes

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
