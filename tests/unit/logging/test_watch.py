"""The watch view, drawn from run-directory records that each test writes itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nanotron_recover.cli import main
from nanotron_recover.logging.watch import (
    describe_incident,
    read_run,
    render_text,
    sparkline,
    summarize,
)

T0 = 1_800_000_000.0


def step_record(step: int, **extra: object) -> dict:
    record = {
        "step": step,
        "loss": 6.0 - 0.1 * step,
        "tokens_per_s": 1000.0 + step,
        "replicas": 4,
        "time": T0 + 2.0 * step,
        "compute_s": 1.5,
        "gate_s": 0.01,
        "reduce_s": 0.3,
        "agree_s": 0.01,
        "optimizer_s": 0.1,
        "checkpoint_s": 0.0,
        "recovery_s": 0.0,
        "wall_s": 2.0,
    }
    record.update(extra)
    return record


CRASH = {
    "step": 3,
    "phase": "backward",
    "kind": "crash",
    "failed_replicas": [1],
    "failed_ranks": [2],
    "hung_ranks": [],
    "epoch": 1,
    "action": "policy_boundary",
    "lost_ids": [8, 9],
    "extra_microbatches": 2,
    "detect_s": 0.0412,
    "detect_method": "record",
    "recover_s": 0.0023,
    "redo_s": 0.0121,
    "alive_replicas": [0, 2, 3],
}
JOINED = {
    "step": 4,
    "kind": "rejoin",
    "status": "joined",
    "replicas": [1],
    "spawned_ranks": [2],
    "orphans_reused": [3],
    "state_bytes": 1 << 20,
    "transfer_s": 0.004,
    "spawn_s": 2.2,
    "join_s": 3.25,
    "alive_replicas": [0, 1, 2, 3],
}


def write_run(
    run_dir: Path,
    steps: int = 5,
    incidents: list[dict] = (),
    rejoin: str = "spawn",
    target: int = 20,
    outcome: dict | None = None,
) -> Path:
    """A run of 4 replicas x 2 ranks (tp=2): replicas 0-1 on host a, 2-3 on host b."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps(step_record(s)) + "\n" for s in range(1, steps + 1))
    )
    (run_dir / "incidents.jsonl").write_text("".join(json.dumps(i) + "\n" for i in incidents))
    ranks = [{"rank": k, "host": "a" if k < 4 else "b", "pid": 100 + k, "replica": k // 2} for k in range(8)]
    (run_dir / "ranks.json").write_text(json.dumps(ranks))
    info = {
        "run": "demo-run",
        "target_step": target,
        "dp": 4,
        "tp": 2,
        "pp": 1,
        "replica_size": 2,
        "rejoin": rejoin,
    }
    (run_dir / "run.json").write_text(json.dumps(info))
    if outcome is not None:
        (run_dir / "outcome.json").write_text(json.dumps(outcome))
    return run_dir


def frame(run_dir: Path, now: float = T0 + 13.0) -> str:
    return render_text(read_run(run_dir, now=now), width=140)


def test_progress_eta_and_phases(tmp_path: Path) -> None:
    text = frame(write_run(tmp_path, steps=5, target=20))
    # Steps 2 s apart: 15 steps left take 30 s; the last step was stamped 3 s before "now".
    assert "demo-run  running  step 5/20 (25%)  ETA 30s  last step 3s ago" in text
    assert "loss      5.5000" in text and "1.0k" in text
    assert "replicas  4/4" in text
    assert "▁" in text and "█" in text  # the loss and tokens/s sparklines
    compute = next(line for line in text.splitlines() if "compute" in line)
    assert "1.500" in compute and "75.0%" in compute  # 1.5 of the 2.0 s wall
    assert "ranks: 8 alive" in text
    assert "\x1b" not in text  # plain text: no escape codes


def test_a_lost_replica_parks_its_healthy_rank_then_comes_back(tmp_path: Path) -> None:
    run = write_run(tmp_path, incidents=[CRASH])
    view = summarize(read_run(run, now=T0))
    states = {rv.rank: rv.state for rep in view.replicas for rv in rep.ranks}
    assert states == {
        0: "alive",
        1: "alive",
        2: "lost",
        3: "parked",
        4: "alive",
        5: "alive",
        6: "alive",
        7: "alive",
    }
    assert [rep.state for rep in view.replicas] == ["alive", "lost", "alive", "alive"]
    text = frame(run)
    assert "2:lost@a" in text and "3:parked@a" in text
    assert "ranks: 6 alive  1 parked  1 lost" in text
    assert "replicas [1] lost in backward, policy_boundary, 2 redone" in text
    assert "detect 0.041s recover 0.002s redo 0.012s" in text

    write_run(tmp_path, incidents=[CRASH, JOINED])
    view = summarize(read_run(run, now=T0))
    assert [rep.state for rep in view.replicas] == ["alive"] * 4
    assert (view.replicas[1].failures, view.replicas[1].rejoins) == (1, 1)
    text = frame(run)
    assert "2:spawned@a" in text and "3:alive@a" in text
    assert "re-joins: 1 joined, 0 failed" in text
    assert (
        "replicas [1] re-joined (1 spawned)" in text and "join 3.25s (spawn 2.20s, transfer 0.004s)" in text
    )


def test_without_rejoin_the_whole_replica_is_lost(tmp_path: Path) -> None:
    view = summarize(read_run(write_run(tmp_path, incidents=[CRASH], rejoin="off"), now=T0))
    assert [rv.state for rv in view.replicas[1].ranks] == ["lost", "lost"]
    assert view.rank_states == {"alive": 6, "spawned": 0, "parked": 0, "lost": 2}


def test_a_relaunch_after_a_lost_node(tmp_path: Path) -> None:
    relaunch = {
        "step": 4,
        "kind": "node_lost",
        "generation": 1,
        "hosts_lost": ["b"],
        "restart_s": 9.5,
        "state_from": "snapshot",
        "restored_step": 3,
        "steps_redone": 0,
        "alive_replicas": [0, 1],
    }
    run = write_run(tmp_path, incidents=[relaunch])
    (run / "generation.json").write_text(
        json.dumps({"generation": 1, "cause": "node_lost", "hosts_lost": ["b"]})
    )
    view = summarize(read_run(run, now=T0))
    assert [rep.state for rep in view.replicas] == ["alive", "alive", "lost", "lost"]
    assert (view.relaunches, view.generation, view.hosts_lost) == (1, 1, ["b"])
    text = frame(run)
    assert "generation 1" in text.splitlines()[0]
    assert "relaunches: 1 (hosts lost: b)" in text
    assert "relaunched, generation 1 from the snapshot of step 3; hosts lost ['b']" in text
    assert "restart 9.5s, 0 steps redone" in text


def test_heartbeat_age_per_host(tmp_path: Path) -> None:
    run = write_run(tmp_path, incidents=[CRASH, JOINED])
    beats = run / "heartbeats"
    beats.mkdir()
    (beats / "a.102").touch()
    os.utime(beats / "a.102", (T0 - 2.5, T0 - 2.5))
    view = summarize(read_run(run, now=T0))
    assert {h.host: h.heartbeat_age_s for h in view.hosts} == {"a": pytest.approx(2.5), "b": None}
    text = frame(run, now=T0)
    row_a = next(line for line in text.splitlines() if "│ a " in line)
    assert "2.5s ago" in row_a


def test_ended_runs(tmp_path: Path) -> None:
    done = {"status": "completed", "last_step": 5, "target_step": 5, "message": None}
    text = frame(write_run(tmp_path / "done", steps=5, target=5, outcome=done))
    assert "demo-run  completed  step 5/5 (100%)" in text and "ETA" not in text
    stopped = {
        "status": "stopped",
        "last_step": 5,
        "target_step": 20,
        "message": "fewer than 2 replicas left",
    }
    text = frame(write_run(tmp_path / "stopped", steps=5, outcome=stopped))
    assert "stopped  step 5/20" in text and "fewer than 2 replicas left" in text


def test_a_run_not_started_and_a_torn_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    text = frame(empty)
    assert "waiting  step 0/?" in text and "none; re-joins: 0 joined" in text
    run = write_run(tmp_path / "torn", steps=3)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": ')  # being written
    assert summarize(read_run(run, now=T0)).step == 3


def test_incident_descriptions() -> None:
    assert describe_incident(
        {"kind": "rejoin", "status": "failed", "replicas": [2], "reason": "no free slot"}
    ) == (
        "re-join of [2] failed: no free slot",
        "-",
    )
    restart = {"action": "restart", "restart": 2, "resumed_from_step": 4, "stall_s": 8.86}
    assert describe_incident(restart) == ("restart 2 from step 4", "stall 8.9s")


def test_sparkline() -> None:
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([3, 3, 3], 8) == "▁▁▁"
    assert sparkline(list(range(100)), 10) == "▁▂▃▃▄▅▆▆▇█"  # the last 10 values only
    assert sparkline([], 5) == ""


def test_watch_once_prints_one_plain_frame(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path, incidents=[CRASH])
    assert main(["watch", str(run), "--once", "--width", "120"]) == 0
    out = capsys.readouterr().out
    assert "demo-run  running  step 5/20" in out and "3:parked@a" in out
    assert "\x1b" not in out
    assert main(["watch", str(tmp_path / "missing"), "--once"]) == 2


def test_a_fenced_process_is_lost_until_its_rank_rejoins(tmp_path: Path) -> None:
    run = write_run(tmp_path, incidents=[CRASH])
    (run / "fence").mkdir()
    (run / "fence" / "a-102").touch()  # rank 2's process, removed from the job
    assert summarize(read_run(run, now=T0)).replicas[1].ranks[0].state == "lost"
    # The re-join's incident is written just before ranks.json names the spawned process.
    write_run(tmp_path, incidents=[CRASH, JOINED])
    assert summarize(read_run(run, now=T0)).replicas[1].ranks[0].state == "spawned"
