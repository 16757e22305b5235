"""``watch`` in a real terminal and the Prometheus endpoint, during a real ``launch`` run.

dp=3 with re-join: replica 0, the logging replica, is killed by an injected fault at step 30; the
survivors repair the step, replica 1 takes the logging role over, and replica 0 is spawned again.
Meanwhile ``nanotron-recover watch`` runs in a tmux pane of its own (a private tmux server, killed by
its unique name at the end) and the test scrapes the endpoint over HTTP: before the fault (served by
rank 0), after it (served again, on the same port, by the new logger, counting the crash) and after
the re-join. The pane must show the loss, the incident and the replica coming back, and, once the
run has ended, the last step's loss as metrics.jsonl records it.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

import nanotron_recover
from nanotron_recover.logging import read_incidents, read_metrics
from tests.helpers.mpirun_utils import REPO, BackgroundJob, layout

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS, FAULT_STEP = 60, 30

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _wait(
    condition: Callable[[], object], what: str, timeout: float, job: BackgroundJob | None = None
) -> object:
    """Poll until ``condition()`` is truthy (returned); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{job.proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _scrape(port: int) -> dict[str, float] | None:
    """The endpoint's samples (``name{labels}`` -> value), or None while nothing answers."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    samples = {}
    for line in body.splitlines():
        if line.startswith("nanotron_recover_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _logger_pid(samples: dict[str, float]) -> int:
    (key,) = [k for k in samples if k.startswith("nanotron_recover_logger_info{")]
    return int(key.split('pid="')[1].split('"')[0])


class Pane:
    """One tmux session on a private server (``-L``), named uniquely; only it is ever killed."""

    def __init__(self, command: list[str]) -> None:
        self.name = f"nr-watch-{uuid.uuid4().hex[:12]}"
        self.tmux = ["tmux", "-L", self.name]
        line = " ".join(subprocess.list2cmdline([c]) for c in command)
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", self.name, "-x", "160", "-y", "60", line],
            check=True,
            timeout=30,
        )
        found = subprocess.run(
            [*self.tmux, "display-message", "-p", "#{socket_path}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        self.socket = Path(found.stdout.strip()) if found.stdout.strip() else None

    def text(self) -> str:
        result = subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", self.name], capture_output=True, text=True, timeout=30
        )
        return result.stdout

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-session", "-t", self.name], capture_output=True, timeout=30)
        subprocess.run([*self.tmux, "kill-server"], capture_output=True, timeout=30)
        if self.socket is not None and self.socket.name == self.name:
            self.socket.unlink(missing_ok=True)  # the server of this session alone; it has exited


def _observe(look: Callable[[], object], stop: threading.Event, seen: list) -> None:
    """Call ``look`` until ``stop``, keeping each result that differs from the one before. The
    pane and the endpoint are watched by a thread each: a scrape may wait on a busy logger."""
    while not stop.is_set():
        value = look()
        if not seen or seen[-1] != value:
            seen.append(value)
        stop.wait(0.05)


def _pane_step_and_loss(text: str) -> tuple[int, str] | None:
    step = re.search(r"running  step (\d+)/", text)
    loss = re.search(r"│ loss +(\d+\.\d{4}) ", text)
    return (int(step.group(1)), loss.group(1)) if step and loss else None


def test_watch_and_prometheus_through_a_fault_and_a_rejoin(tmp_path: Path, local_dataset) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = _free_port()
    sets = [
        f"tokens.train_steps={STEPS}",
        f"data_stages.0.data.dataset={{dataset_folder: {local_dataset.corpus_dir}}}",
        f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}",
        "checkpoints.save_final_state=false",
        "recover.watchdog_timeout_s=120",
        "recover.gate_timeout_s=30",
        "recover.enabled=true",
        "recover.rejoin.mode=spawn",
        "recover.rejoin.after_steps=3",  # a few steps at two replicas before it comes back
        f"recover.faults={json.dumps([{'step': FAULT_STEP, 'replica': 0, 'phase': 'forward'}])}",
        f"logging.prometheus_port={port}",
        *layout(1, 1, 3, 2),
    ]
    args = ["launch", "--config", CONFIG, "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    src = str(Path(nanotron_recover.__file__).resolve().parents[1])
    pane = Pane(
        [
            "env",
            # The pane's own size, not one inherited from this process's environment.
            "-u",
            "COLUMNS",
            "-u",
            "LINES",
            f"PYTHONPATH={src}",
            sys.executable,
            "-m",
            "nanotron_recover.cli",
            "watch",
            str(run_dir),
            "--interval",
            "0.2",
        ]
    )
    job = BackgroundJob(run_dir, args)
    stop, scrapes, panes = threading.Event(), [], []
    observers = [
        threading.Thread(target=_observe, args=(lambda: _scrape(port), stop, scrapes), daemon=True),
        threading.Thread(target=_observe, args=(pane.text, stop, panes), daemon=True),
    ]
    for observer in observers:
        observer.start()
    try:
        result = job.finish(timeout=400)
        stop.set()
        for observer in observers:
            observer.join(timeout=60)
        assert result.returncode == 0, result.output[-3000:]
        final = _wait(lambda: "completed" in (t := pane.text()) and t, "the ended run in the pane", 60)
    finally:
        stop.set()
        pane.close()
        job.kill()

    metrics = read_metrics(run_dir)
    (victim,) = [
        json.loads(p.read_text())["pid"] for p in (run_dir / "faults").glob(f"step{FAULT_STEP}_*rank0.json")
    ]
    scrapes = [s for s in scrapes if s is not None]
    # Before the fault: rank 0, the logging replica's, serves the run's values.
    before = next(s for s in scrapes if s.get("nanotron_recover_step", 0) >= 1)
    assert before["nanotron_recover_step"] < FAULT_STEP
    assert not any(k.startswith("nanotron_recover_incidents_total") for k in before)
    assert before["nanotron_recover_replicas_alive"] == 3 and before["nanotron_recover_target_step"] == STEPS
    assert _logger_pid(before) == victim
    # After it: the same port answers again, from the new logger, and counts the crash.
    crashed = [s for s in scrapes if s.get('nanotron_recover_incidents_total{kind="crash"}') == 1]
    after = [s for s in crashed if 'nanotron_recover_rejoins_total{status="joined"}' not in s][-1]
    assert _logger_pid(after) != victim and after["nanotron_recover_step"] >= FAULT_STEP
    assert after['nanotron_recover_ranks{state="lost"}'] == 1
    # After the re-join: the spawned rank is counted, nothing is lost.
    back = [s for s in crashed if s.get('nanotron_recover_rejoins_total{status="joined"}') == 1][-1]
    assert (
        back['nanotron_recover_ranks{state="spawned"}'] == 1
        and back['nanotron_recover_ranks{state="lost"}'] == 0
    )
    assert _logger_pid(back) == _logger_pid(after)  # a re-joined replica does not take the role back

    # The pane while the run ran: the loss of the step it showed, the replica lost, then back.
    shown = [x for t in panes if (x := _pane_step_and_loss(t))]
    assert shown and all(f"{metrics[step - 1]['loss']:.4f}" == loss for step, loss in shown)
    lost = [t for t in panes if "lost in forward" in t]
    (tmp_path / "panes.txt").write_text("\n=====\n".join(panes))  # for a failure's post-mortem
    assert any("0:lost@" in t and "replicas [0] lost in forward" in t and "running" in t for t in lost), (
        lost[:1] or panes[-1:]
    )
    assert any("0:spawned@" in t and "re-joined (1 spawned)" in t and "running" in t for t in lost), lost[-1:]
    # And once it ended: the last step and its loss, the incident with its cost.
    assert f"completed  step {STEPS}/{STEPS}" in final
    assert f"loss      {metrics[-1]['loss']:.4f}" in final and "replicas  3/3" in final
    crash = next(i for i in read_incidents(run_dir) if i.get("kind") == "crash")
    assert f"detect {crash['detect_s']:.3f}s" in final
