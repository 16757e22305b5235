"""Non-blocking collectives under ULFM: a failure while several ``Iallreduce`` are in flight.

Each test launches ``tests/helpers/mpi_workers/nonblocking_worker.py`` (plain mpi4py, see its
docstring) on 4 ranks with a window of 6 ``Iallreduce`` per iteration and checks, on the JSON every
rank wrote, that every survivor:

- saw a fault error class (``ERR_PROC_FAILED``, ``ERR_PROC_FAILED_PENDING``, ``ERR_REVOKED``) or
  ``ERR_OTHER`` (see :func:`_is_fault`) from ``Wait`` (with ``Waitall``: ``ERR_IN_STATUS``, the
  classes are then per request) in the iteration the victim died in, or, for a kill from outside
  at a moment the code does not choose, from ``Wait`` or the ``Agree`` that ends the iteration;
- completed every other request of the window after revoking (none can write into its buffer
  later), each with success, a fault class or ``ERR_OTHER``;
- then shrank to the same world and went on with correct sums.

A hang anywhere fails the test through the job's timeout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.mpirun_utils import rank_results, start_mpirun

WORKER = Path(__file__).resolve().parents[3] / "tests" / "helpers" / "mpi_workers" / "nonblocking_worker.py"
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
RUN_TIMEOUT_S = 90.0
N = 4
WINDOW = 6
FAULTS = {"MPI_ERR_PROC_FAILED", "MPI_ERR_PROC_FAILED_PENDING", "MPI_ERR_REVOKED"}

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI with ULFM) not available"),
]


def _start(out: Path, *args: str) -> subprocess.Popen[str]:
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--with-ft", "ulfm"]
    cmd += [
        "--mca",
        "coll",
        "^han,cuda",
        "--mca",
        "btl",
        "^ofi",
        "-n",
        str(N),
        sys.executable,
        str(WORKER),
        "--out",
        str(out),
    ]
    cmd += ["--window", str(WINDOW), *args]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return start_mpirun(cmd, env)


def _finish(proc: subprocess.Popen[str], out: Path, started: float) -> dict[int, dict[str, Any]]:
    try:
        log, _ = proc.communicate(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the job's own process group: mpirun, prted, ranks
        log, _ = proc.communicate()
        pytest.fail(f"the job hung (killed after {RUN_TIMEOUT_S}s):\n{log[-4000:]}")
    return rank_results(out, proc.returncode, log)


def _error_name(error: str) -> str:
    return error.split(":", 1)[0]


def _is_fault(fault: dict[str, Any]) -> bool:
    """A fault class, or ``ERR_OTHER``: Open MPI 5.0's non-blocking collectives (libnbc) sometimes
    end a request torn by a failure or a revoke with ``ERR_OTHER``, on a communicator that this
    rank may not yet see as revoked; the worker records whether it did (``revoked``)."""
    return _error_name(fault["error"]) in FAULTS | {"MPI_ERR_OTHER"}


def _check(results: dict[int, dict[str, Any]], victim: int | None, kill_iter: int | None, wait: str) -> None:
    alive = [r for r in range(N) if r != victim]
    assert sorted(r for r, d in results.items() if d.get("done")) == alive
    for r in alive:
        d = results[r]
        assert len(d["faults"]) == 1, f"rank {r} saw {d['faults']}"
        fault = d["faults"][0]
        if kill_iter is not None:
            assert fault["iter"] == kill_iter
            assert fault["where"] == "wait", f"rank {r}: the in-flight requests did not report it: {fault}"
        name = _error_name(fault["error"])
        if fault["where"] == "wait" and wait == "all":
            assert name == "MPI_ERR_IN_STATUS", fault
        else:
            assert _is_fault(fault), fault
        ends = FAULTS | {"MPI_ERR_OTHER"}
        for drain in d["drains"]:
            assert all(e == "ok" or _error_name(e) in ends for e in drain["ends"]), drain
        assert [x["members"] for x in d["recoveries"]] == [alive]
        assert d["final_members"] == alive
        assert d["committed"] and all(c["sums_right"] for c in d["committed"]), d["committed"]
        assert all(c["size"] == len(alive) for c in d["committed"] if c["iter"] >= fault["iter"])


@pytest.mark.parametrize(
    ("point", "wait"),
    [("before_post", "each"), ("mid_post", "each"), ("after_post", "each"), ("after_post", "all")],
)
def test_kill_while_requests_in_flight(tmp_path: Path, point: str, wait: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    res = _finish(_start(out, "--kill", f"2:1:{point}", "--wait", wait), out, started)
    assert res[2].get("killed") and res[2]["killed_point"] == point
    _check(res, victim=2, kill_iter=1, wait=wait)


def test_revoke_interrupts_requests_in_flight(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    res = _finish(_start(out, "--revoke", "3:1"), out, started)
    assert sorted(r for r, d in res.items() if d.get("done")) == list(range(N))
    for r, d in res.items():
        assert [(f["iter"], f["where"]) for f in d["faults"]] == [(1, "wait")], r
        assert _is_fault(d["faults"][0]), d["faults"]
        assert all(_error_name(e) in {"MPI_ERR_REVOKED", "MPI_ERR_OTHER"} for e in d["drains"][0]["ends"])
        assert [x["members"] for x in d["recoveries"]] == [list(range(N))]
        assert all(c["sums_right"] and c["size"] == N for c in d["committed"])


def test_sigkill_from_outside(tmp_path: Path) -> None:
    """The test picks the moment and the victim; the code is somewhere in its loop."""
    out = tmp_path / "out"
    out.mkdir()
    rng = random.Random()
    victim, delay = rng.randrange(N), rng.uniform(0.2, 2.5)
    started = time.monotonic()
    proc = _start(out, "--min-seconds", "5", "--k", str(1 << 17))
    while len(list(out.glob("ready*"))) < N:
        if proc.poll() is not None or time.monotonic() - started > RUN_TIMEOUT_S / 2:
            break
        time.sleep(0.05)
    pid = json.loads((out / f"ready{victim}").read_text())["pid"]
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    res = _finish(proc, out, started)
    assert victim not in res or not res[victim].get("done"), f"victim {victim} finished before the kill"
    _check(res, victim=victim, kill_iter=None, wait="each")
