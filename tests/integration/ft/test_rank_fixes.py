"""The fixes for Open MPI every rank loads (``ft/rank_fixes.py``).

The revoke fix: a process reported failed while the survivors create a communicator crashes them
in Open MPI 5.0.x (a null ``c_coll`` in ``ompi_comm_revoke_local``, the trace of
sandialabs/Fenix#136); with the fix loaded they finish the creation, shrink and go on.
``tests/helpers/mpi_workers/rank_fixes_worker.py`` on 3 ranks, the last one SIGKILLed as it enters
``ompi_comm_activate`` of a ``Dup`` (``die_in_activate.c``). A hang fails through the job's timeout.

The context-id fix: the root of a ``Spawn`` SIGKILLed as it starts the allocation's exchange with
the spawned process's root (``die_in_nextcid.c``, ``spawn_root_death_worker.py``): without the fix
the other parent's ``Spawn`` never returns, printing ``NBC_Progress: an error 75`` for every round;
with it, it raises ``MPI_ERR_PROC_FAILED`` at once.

The launch filter: a crafted TCP handshake from "another launch"; the abort's reason: ``MPI_Abort``
in one process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotron_recover.ft import native, rank_fixes
from tests.helpers.mpirun_utils import kill_tree, start_mpirun, wait_mpirun

WORKERS = Path(__file__).resolve().parents[3] / "tests" / "helpers" / "mpi_workers"
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
RUN_TIMEOUT_S = 60.0

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI with ULFM) not available"),
    pytest.mark.skipif(native.compiler() is None, reason="needs a C compiler"),
]


def _job_env(tmp_path: Path, fixed: bool) -> dict[str, str]:
    """The environment of a plain-mpi4py job, with the fix's library named or not."""
    env = {
        **os.environ,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1",
    }
    env.pop(rank_fixes.ENV, None)
    if fixed:
        env.update(rank_fixes.rank_env(tmp_path))
        assert env.get(rank_fixes.ENV), "the fix did not build"
    return env


def _run(tmp_path: Path, fixed: bool) -> tuple[dict[int, dict], str]:
    import json

    out = tmp_path / ("fixed" if fixed else "bare")
    out.mkdir()
    die = native.build(WORKERS / "die_in_activate.c", tmp_path, native.compiler())
    env = _job_env(tmp_path, fixed)
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--with-ft", "ulfm"]
    cmd += ["--mca", "coll", "^han,cuda", "--mca", "btl", "^ofi", "-n", "3"]
    cmd += [sys.executable, str(WORKERS / "rank_fixes_worker.py"), "--out", str(out), "--die-lib", str(die)]
    log = wait_mpirun(start_mpirun(cmd, env), RUN_TIMEOUT_S)
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in out.glob("rank*.json")}
    return results, log


def test_survivors_of_a_death_during_a_creation_finish_it_shrink_and_reduce(tmp_path):
    results, log = _run(tmp_path, fixed=True)
    assert sorted(results) == [0, 1], log[-4000:]
    for rank in (0, 1):
        r = results[rank]
        assert r["fix_loaded"] is True, r
        assert (r["size"], r["total"]) == (2, 0 + 1), r
    # The notice met the Dup's communicator before its collectives on one survivor at least (the
    # other may learn of the death once the first has left the Dup).
    assert results[0]["caught"] + results[1]["caught"] >= 1, results
    assert "Failing at address" not in log, log[-4000:]


def test_without_the_fix_the_survivors_crash_in_open_mpi(tmp_path):
    """Shows the defect is still in the Open MPI the tests run on: if this test fails, Open MPI no
    longer dereferences a missing ``c_coll`` and the fix can go."""
    results, log = _run(tmp_path, fixed=False)
    assert results == {}, results
    assert "ompi_comm_revoke_local" in log and "Failing at address: 0x450" in log, log[-4000:]


MPI_ERR_PROC_FAILED = 75  # Open MPI's mpi-ext.h (MPIX_ERR_PROC_FAILED)
# How long the unfixed Spawn is watched after the root entered it (the fixed one returns in well
# under a second: 0.3 s measured).
HANG_WATCH_S = 10.0


def _spawn_with_dying_root(tmp_path: Path, fixed: bool) -> tuple[dict | None, str]:
    """The spawn of ``spawn_root_death_worker.py``: rank 1's record (None if its ``Spawn`` had not
    ended ``HANG_WATCH_S`` after the root entered it, or by ``RUN_TIMEOUT_S`` with the fix) and the
    job's output. The job is ended here either way: the spawned process waits in ``MPI_Init`` for
    the dead root."""
    import json

    out = tmp_path / ("fixed" if fixed else "bare")
    out.mkdir()
    die = native.build(WORKERS / "die_in_nextcid.c", tmp_path, native.compiler())
    env = _job_env(tmp_path, fixed)
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--with-ft", "ulfm"]
    cmd += ["--prtemca", "state_base_recoverable", "1", "--mca", "coll", "^han,cuda", "--mca", "btl", "^ofi"]
    cmd += ["-n", "2", sys.executable, str(WORKERS / "spawn_root_death_worker.py")]
    cmd += ["--out", str(out), "--die-lib", str(die)]
    proc = start_mpirun(cmd, env)
    record_path = out / "rank1.json"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (out / "rank0.spawning").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not fixed:
            deadline = min(deadline, time.monotonic() + HANG_WATCH_S)
        while not record_path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        kill_tree(proc.pid)
        log, _ = proc.communicate()
    assert (out / "rank0.spawning").exists() and (out / "rank1.spawning").exists(), log[-4000:]
    return (json.loads(record_path.read_text()) if record_path.exists() else None), log


def test_a_spawn_whose_root_dies_in_the_context_id_allocation_raises(tmp_path):
    record, log = _spawn_with_dying_root(tmp_path, fixed=True)
    assert record is not None, log[-4000:]
    assert record["fix_loaded"] is True, record
    assert record["spawn"] == MPI_ERR_PROC_FAILED, record
    assert record["kept"] >= 1, record  # the error came back through the fix, not another path


def test_without_the_fix_a_spawn_whose_root_died_never_returns(tmp_path):
    """Shows the defect is still in the Open MPI the tests run on: if this test fails, Open MPI no
    longer drops the error of a context-id round and that part of the fix can go."""
    record, log = _spawn_with_dying_root(tmp_path, fixed=False)
    assert record is None, record
    assert log.count("NBC_Progress: an error 75") >= 10, log[-4000:]  # one per round, retried


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_ulfm_loads_the_fix_before_libmpi_so_libmpi_binds_to_it(tmp_path):
    """Imported through ``ft.ulfm`` with the launch's variable set, the first
    ``ompi_comm_revoke_local`` in the process's global scope (what libmpi's calls bind to) is the
    fix's; without the variable, there is none there but libmpi's own (if any)."""
    code = (
        "import ctypes\n"
        "from nanotron_recover.ft import rank_fixes\n"
        "from nanotron_recover.ft.ulfm import MPI\n"
        "try:\n"
        "    first = ctypes.cast(ctypes.CDLL(None).ompi_comm_revoke_local, ctypes.c_void_p).value\n"
        "except AttributeError:\n"
        "    first = None  # not in the global scope at all (mpi4py loads libmpi locally)\n"
        "fix = rank_fixes._loaded\n"
        "print(fix is not None and first == ctypes.cast(fix.ompi_comm_revoke_local, ctypes.c_void_p).value)\n"
    )
    fixed = _python(code, rank_fixes.rank_env(tmp_path))
    assert fixed.stdout.strip() == "True", fixed.stderr[-2000:]
    bare = _python(code, {rank_fixes.ENV: ""})
    assert bare.stdout.strip() == "False", bare.stderr[-2000:]


def test_a_fix_that_cannot_bind_is_said_once_and_not_loaded(tmp_path):
    """libmpi already in the process (MPI imported some other way first), or a library that is not
    there: the rank goes on without the fix and says why, once."""
    late = _python(
        "from mpi4py import MPI\nfrom nanotron_recover.ft import rank_fixes\n"
        "print(rank_fixes.load(), rank_fixes.load())\n",
        rank_fixes.rank_env(tmp_path),
    )
    assert late.stdout.strip() == "False False", late.stderr[-2000:]
    assert (
        late.stderr.count("Open MPI fixes not loaded") == 1 and "libmpi was loaded before it" in late.stderr
    )
    missing = _python(
        "from nanotron_recover.ft import rank_fixes\nprint(rank_fixes.load())\n",
        {rank_fixes.ENV: str(tmp_path / "absent.so")},
    )
    assert missing.stdout.strip() == "False" and "Open MPI fixes not loaded" in missing.stderr, missing.stderr


def test_without_a_compiler_the_ranks_go_without_it_and_it_is_said(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_fixes, "compiler", lambda: None)
    said: list[str] = []
    assert rank_fixes.rank_env(tmp_path, said.append) == {}
    assert len(said) == 1 and "no C compiler" in said[0] and "Fenix#136" in said[0], said


def test_a_rank_open_mpi_aborts_says_why_on_stderr(tmp_path):
    """Open MPI ends a rank on an internal error through ``ompi_rte_abort``, whose reason goes only
    to the runtime (with a recoverable runtime nothing prints it): with the library loaded, the
    reason, host and pid are on the rank's stderr first; without it, they are not."""
    code = "from nanotron_recover.ft.ulfm import MPI\nMPI.COMM_WORLD.Abort(3)\n"
    fixed = _python(code, rank_fixes.rank_env(tmp_path))
    assert fixed.returncode != 0
    assert "Open MPI aborts this rank" in fixed.stderr and "(code 3)" in fixed.stderr, fixed.stderr[-2000:]
    bare = _python(code, {rank_fixes.ENV: ""})
    assert bare.returncode != 0 and "Open MPI aborts this rank" not in bare.stderr, bare.stderr[-2000:]


def test_a_connection_from_another_launch_is_refused(tmp_path):
    """A process of another launch dials a rank's TCP port (a crafted handshake with another job's
    name, as a process of an earlier launch still running on a node would send). Open MPI alone
    takes the name for one of its own job; with the library the rank refuses it, says so, and MPI
    goes on."""
    out = tmp_path / "fixed"
    out.mkdir()
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--with-ft", "ulfm", "--mca", "btl", "tcp,self"]
    cmd += ["-n", "2", sys.executable, str(WORKERS / "foreign_connection_worker.py"), str(out)]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env.update(rank_fixes.rank_env(tmp_path))
    log = wait_mpirun(start_mpirun(cmd, env), RUN_TIMEOUT_S)
    assert "refused a connection from process 1 of job family" in log, log[-4000:]
    results = {f.name: f.read_text() for f in out.glob("rank*.txt")}
    assert results == {"rank0.txt": "allreduce 2 refused 0", "rank1.txt": "allreduce 2 refused 1"}, log[
        -4000:
    ]
    bare_out = tmp_path / "bare"
    bare_out.mkdir()
    env[rank_fixes.ENV] = ""
    bare = wait_mpirun(start_mpirun([*cmd[:-1], str(bare_out)], env), RUN_TIMEOUT_S)
    assert "appears to be part of this MPI job" in bare and "refused a connection" not in bare, bare[-4000:]
