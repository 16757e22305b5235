"""The Prometheus metrics of a run: values after feeding records, and the endpoint's port."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest

from nanotron_recover.logging.prometheus import RunExporter, RunMetrics, read_targets
from nanotron_recover.logging.watch import read_run
from tests.unit.logging.test_watch import CRASH, JOINED, step_record, write_run

P = "nanotron_recover_"

RELAUNCH = {
    "step": 7,
    "kind": "node_lost",
    "generation": 1,
    "hosts_lost": ["b"],
    "restart_s": 9.5,
    "state_from": "snapshot",
    "restored_step": 6,
    "steps_redone": 0,
    "alive_replicas": [0, 1, 2, 3],
}


def test_values_after_records(tmp_path: Path) -> None:
    metrics = RunMetrics()
    metrics.observe_step(step_record(5, replicas=3, consumed_tokens=7680))
    assert metrics.value(P + "step") == 5
    assert metrics.value(P + "loss") == pytest.approx(5.5)
    assert metrics.value(P + "tokens_per_second") == 1005
    assert metrics.value(P + "consumed_tokens") == 7680
    assert metrics.value(P + "replicas_alive") == 3
    assert metrics.value(P + "step_seconds", {"phase": "compute"}) == 1.5
    assert metrics.value(P + "step_seconds", {"phase": "wall"}) == 2.0

    for record in (CRASH, JOINED, RELAUNCH, {**CRASH, "step": 9, "detect_s": 5.2, "kind": "hang"}):
        metrics.observe_incident(record)
    assert metrics.value(P + "incidents_total", {"kind": "crash"}) == 1
    assert metrics.value(P + "incidents_total", {"kind": "hang"}) == 1
    assert metrics.value(P + "incidents_total", {"kind": "rejoin"}) == 1
    assert metrics.value(P + "incidents_total", {"kind": "node_lost"}) == 1
    assert metrics.value(P + "rejoins_total", {"status": "joined"}) == 1
    assert metrics.value(P + "restarts_total") == 1
    assert metrics.value(P + "generation") == 1
    assert metrics.value(P + "last_detect_seconds") == 5.2  # the last failure's
    assert metrics.value(P + "last_recover_seconds") == pytest.approx(0.0023)
    assert metrics.value(P + "last_redo_seconds") == pytest.approx(0.0121)
    assert metrics.value(P + "last_restart_seconds") == 9.5


def test_ranks_per_state_from_the_grid(tmp_path: Path) -> None:
    run = write_run(tmp_path, incidents=[])
    metrics = RunMetrics()
    metrics.observe_incident(CRASH)
    metrics.observe_grid(read_run(run, logs=False))
    states = {s: metrics.value(P + "ranks", {"state": s}) for s in ("alive", "spawned", "parked", "lost")}
    assert states == {"alive": 6, "spawned": 0, "parked": 1, "lost": 1}
    assert metrics.value(P + "replicas_target") == 4
    assert metrics.value(P + "target_step") == 20
    metrics.observe_incident(JOINED)
    metrics.observe_grid(read_run(run, logs=False))
    assert metrics.value(P + "ranks", {"state": "spawned"}) == 1
    assert metrics.value(P + "ranks", {"state": "lost"}) == 0


def test_a_new_logger_takes_over_the_values_from_the_run_directory(tmp_path: Path) -> None:
    run = write_run(tmp_path, steps=5, incidents=[CRASH, JOINED])
    exporter = RunExporter(run, port=0)
    exporter.replay()
    values = exporter.metrics
    assert values.value(P + "step") == 5
    assert values.value(P + "incidents_total", {"kind": "crash"}) == 1
    assert values.value(P + "rejoins_total", {"status": "joined"}) == 1
    assert values.value(P + "ranks", {"state": "spawned"}) == 1
    assert not exporter.serving


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_the_endpoint_serves_and_one_process_holds_its_port(tmp_path: Path) -> None:
    run = write_run(tmp_path, steps=3)
    port = _free_port()
    first = RunExporter.start(run, port)
    try:
        assert first.serving and first.bound_port == port
        assert read_targets(run) == [f"{socket.gethostname()}:{port}"]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert f"{P}step 3.0" in body
        # A second logger on this host (another rank, another run) cannot take the same port ...
        second = RunExporter.start(run, port)
        assert not second.serving
        second.observe_step(step_record(4))
        assert not second.serving
    finally:
        first.close()
    # ... until its holder has let it go: then the next step serves it.
    try:
        second.observe_step(step_record(5))
        assert second.serving
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert f"{P}step 5.0" in body
    finally:
        second.close()


def test_port_zero_picks_a_free_port_and_says_where(tmp_path: Path) -> None:
    run = write_run(tmp_path, steps=2)
    exporter = RunExporter.start(run, 0)
    try:
        (target,) = read_targets(run)
        assert target.endswith(f":{exporter.bound_port}") and exporter.bound_port > 0
        groups = json.loads((run / "prometheus_targets.json").read_text())
        assert groups[0]["labels"] == {"run": run.resolve().name}
    finally:
        exporter.close()


def test_the_grafana_dashboard_names_only_metrics_we_export() -> None:
    dashboard = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "nanotron_recover.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"nanotron_recover_\w+", e)}
    metrics = RunMetrics()
    metrics.observe_step(step_record(1))  # labelled series exist once set
    metrics.observe_incident(CRASH)
    metrics.observe_incident(JOINED)
    exported = {s.name for family in metrics.registry.collect() for s in family.samples}
    assert used and used <= exported, used - exported
