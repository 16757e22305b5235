"""Communicator creations torn by a failure or a revoke, on Open MPI 5.0.11, and their workarounds.

Three defects of Open MPI on the fault-tolerant communicator's path, each reproduced here with plain
mpi4py and handled in ``nanotron_recover.ft.ulfm``, which every creation and every retired communicator in
``ft/`` (``comm.py``, ``membership.py``, ``join.py``) goes through:

- the context-id gate (``ulfm.reset_cid_gate``): a ``Dup`` torn by a SIGKILLed member leaves
  ``ompi_comm_cid_lowest_id`` set (ompi/communicator/comm_cid.c), and every later creation from a
  communicator with a higher context id spins forever; ``tests/helpers/mpi_workers/cid_gate_worker.py``;
- ``MPI_ERR_OTHER`` from libnbc (``ulfm.LIBNBC_FAULT_ERROR_CLASSES``, open-mpi/ompi#14353): a
  ``Dup`` or ``Split`` torn by a revoke sometimes raises ``ERR_OTHER`` instead of
  ``ERR_REVOKED``; ``tests/helpers/mpi_workers/creation_race_worker.py``;
- a context id and ULFM epoch used twice (``ulfm.retire_comm``): a communicator freed after its
  members agreed on it gives its context id to a later creation, whose epoch can repeat, and the
  ERA agreement meets the freed one's decisions in its history;
  ``tests/helpers/mpi_workers/epoch_reuse_worker.py``.

A hang fails a test through its job's timeout (the job is then killed as a whole).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.mpirun_utils import kill_tree, rank_results, start_mpirun, wait_mpirun

WORKERS = Path(__file__).resolve().parents[3] / "tests" / "helpers" / "mpi_workers"
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
RUN_TIMEOUT_S = 60.0
# How long survivors must stay stuck after their torn Dup for the gate to count as closed; a Shrink
# and a Dup of 3 ranks take milliseconds (seconds at worst on 2 busy cores).
HANG_S = 8.0
# MPI_ERR_PROC_FAILED, MPI_ERR_PROC_FAILED_PENDING, MPI_ERR_REVOKED (Open MPI 5.0's values), MPI_ERR_OTHER
FAULTS, ERR_OTHER = {75, 76, 77}, 16

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI with ULFM) not available"),
]


def _start(out: Path, n: int, worker: str, *args: str) -> subprocess.Popen[str]:
    out.mkdir()
    cmd = [
        MPIRUN,
        "--allow-run-as-root",
        "--oversubscribe",
        "--with-ft",
        "ulfm",
        "--mca",
        "coll",
        "^han,cuda",
        "--mca",
        "btl",
        "^ofi",  # launcher.NO_OFI_BTL: a second less in every MPI_Init
    ]
    cmd += ["-n", str(n), sys.executable, str(WORKERS / worker), "--out", str(out), *args]
    env = {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1",
    }
    return start_mpirun(cmd, env)


def _finish(
    proc: subprocess.Popen[str], out: Path, timeout: float = RUN_TIMEOUT_S
) -> dict[int, dict[str, Any]]:
    def stages() -> str:
        return f"; stages { ({f.name: json.loads(f.read_text()).get('stage') for f in sorted(out.glob('stage*.json'))}) }"

    log = wait_mpirun(proc, timeout, stages)
    return rank_results(out, proc.returncode, log)


def _stages(out: Path) -> dict[int, str]:
    stages = {}
    for f in out.glob("stage*.json"):
        d = json.loads(f.read_text())
        stages[d["rank"]] = d["stage"]
    return stages


def test_torn_dup_then_creations_from_higher_ids_complete(tmp_path: Path) -> None:
    """4 ranks; the last is SIGKILLed while the others are in ``low.Dup()``. Handled by
    ``creation_failed`` (a fault, the gate reset), the survivors then shrink ``high`` (a higher
    context id than ``low``) and duplicate the result: without the reset both would spin forever."""
    res = _finish(_start(tmp_path / "out", 4, "cid_gate_worker.py", "--reset"), tmp_path / "out")
    assert res[3].get("killed")
    for r in (0, 1, 2):
        d = res[r]
        assert d.get("done"), d
        assert d["error_class"] in FAULTS | {ERR_OTHER}, d
        assert d["fault"] is True, d
        assert (d["size"], d["total"]) == (3, 0 + 1 + 2), d


def test_torn_dup_closes_the_gate_without_the_reset(tmp_path: Path) -> None:
    """The same without the reset: the survivors' ``Dup`` fails, and then their ``Shrink`` of
    ``high`` never returns. Shows the defect is still there in the Open MPI the tests run on; if
    this test fails, Open MPI reopens the gate itself and ``ulfm.reset_cid_gate`` can go."""
    out = tmp_path / "out"
    proc = _start(out, 4, "cid_gate_worker.py")
    survivors = (0, 1, 2)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all(_stages(out).get(r) for r in survivors):
            assert proc.poll() is None, f"job ended early: {proc.communicate()[0][-3000:]}"
            assert time.monotonic() < deadline, f"no torn Dup in {RUN_TIMEOUT_S}s: {_stages(out)}"
            time.sleep(0.1)
        time.sleep(HANG_S)
        stages = _stages(out)
    finally:
        kill_tree(proc.pid)
        proc.communicate()
    assert stages == {0: "failed", 1: "failed", 2: "failed"}, stages


def test_creations_torn_by_a_revoke_count_as_faults(tmp_path: Path) -> None:
    """4 ranks, 60 trials: one rank revokes a communicator while every rank loops over ``Dup`` and
    ``Split`` from it. Each error goes through ``creation_failed``, which must call it a fault: a
    rank that re-raised would be missing here. Open MPI 5.0.11 raises ``ERR_OTHER`` for some of
    them (libnbc, open-mpi/ompi#14353); the plain classification of blocking calls (``is_fault``)
    refuses it, and the rank would die with a traceback, its replica lost without a failure."""
    res = _finish(_start(tmp_path / "out", 4, "creation_race_worker.py", "--trials", "60"), tmp_path / "out")
    assert sorted(res) == [0, 1, 2, 3] and all(d.get("done") for d in res.values()), res
    errors = [e for d in res.values() for e in d["errors"]]
    assert len(errors) == 4 * 60
    assert {e["error_class"] for e in errors} <= FAULTS | {ERR_OTHER}
    others = [e for e in errors if e["error_class"] == ERR_OTHER]
    # About 3-4% of the errors: not seeing one in 240 means the race was not reproduced (then this
    # run proves nothing), or Open MPI no longer has the defect (then LIBNBC_FAULT_ERROR_CLASSES
    # can go back to the fault classes).
    assert others, f"no ERR_OTHER in {len(errors)} torn creations"
    assert not any(e["blocking_is_fault"] for e in others)
    assert {e["op"] for e in errors} == {"dup", "split"}


# What Open MPI 5.0.11 prints when an agreement's identifier is already in its history.
CYCLED = "due to cycling of identifiers"


def _epoch_reuse(out: Path, *args: str) -> tuple[dict[int, dict[str, Any]], str]:
    """Run ``epoch_reuse_worker.py`` on 4 ranks: every rank's record and mpirun's output."""
    proc = _start(out, 4, "epoch_reuse_worker.py", *args)
    log = wait_mpirun(proc, RUN_TIMEOUT_S)
    res = rank_results(out, proc.returncode, log)
    assert proc.returncode == 0 and sorted(res) == [0, 1, 2, 3], (proc.returncode, res, log[-3000:])
    return res, log


def test_a_retired_communicator_keeps_its_identifiers_from_the_next_one(tmp_path: Path) -> None:
    """Ranks 0-2 agree on a communicator and retire it (``ulfm.retire_comm``); ranks 0, 1 and 3
    then create and agree on communicators until their epoch passes the retired one's. None may
    take the retired one's context id, so no agreement meets an old decision, and every agree
    returns the value agreed on."""
    res, log = _epoch_reuse(tmp_path / "out")
    assert all(d["done"] and d["all_one"] for d in res.values()), res
    assert [res[r]["agrees"] for r in range(4)] == [5 + 6 * 20, 5 + 6 * 20, 5, 6 * 20], res
    assert CYCLED not in log, log[-3000:]


def test_a_freed_communicator_gives_its_identifiers_to_the_next_one(tmp_path: Path) -> None:
    """The same with ``Free``: one of the later communicators takes the freed one's context id and
    epoch, and its 5th agree meets the freed one's 5th in the history of ranks 0 and 1. Shows the
    defect is still there in the Open MPI the tests run on; if this test fails, Open MPI no longer
    reuses the identifiers and ``ulfm.retire_comm`` can free again."""
    _, log = _epoch_reuse(tmp_path / "out", "--free")
    assert CYCLED in log, log[-3000:]
