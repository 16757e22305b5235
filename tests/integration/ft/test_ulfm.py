"""``ft/ulfm.py``'s agreements: no other thread makes progress during one, and a result with a bit
no participant can set ends the job.

The check runs in a child process (importing ``ft.ulfm`` initializes MPI), on a stand-in
communicator whose ``Agree`` returns what the test says and whose ``Abort`` records the call. The
race runs ``tests/helpers/mpi_workers/agreement_race_worker.py`` on 3 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.mpirun_utils import start_mpirun, wait_mpirun

WORKERS = Path(__file__).resolve().parents[3] / "tests" / "helpers" / "mpi_workers"
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
# The bare run stops at the first round with a wrong value: here it came after 500 to 21,500
# agreements (eight runs); it gives up after BARE_AGREEMENTS. The fixed run makes FIXED_AGREEMENTS
# (about 30 s here), which the bare watch did not get through once without a wrong value.
BARE_AGREEMENTS = 60_000
FIXED_AGREEMENTS = 20_000
# About 1.5 ms per agreement on this machine with the busy processes; three times that under load.
RACE_TIMEOUT_S = 3 * 0.0015 * BARE_AGREEMENTS + 60.0

_CHILD = """
import json, sys
from nanotron_recover.ft import ulfm

class Comm:
    def __init__(self, result):
        self.result, self.contributed, self.aborted = result, None, None
    def Agree(self, value):
        self.contributed = value
        return self.result
    def Abort(self, code):
        self.aborted = code

out = {}
for name, result, mine in json.loads(sys.argv[1]):
    comm = Comm(result)
    out[name] = [ulfm.agree(comm, mine, name), comm.contributed, comm.aborted]
print(json.dumps(out))
"""


def _run(cases: list) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(cases)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_agree_passes_valid_results_and_ends_the_job_on_bits_no_rank_set():
    results, stderr = _run(
        [
            ["step", 0x1FFD, 0x1FFF],  # an AND of contributions: within this rank's bits
            ["commit", 0, 1],  # another rank contributed 0
            ["garbage", -0x47505FA8, 0x1FFF],  # seen in a campaign
            ["high bit", 0x37838AD8, 1],
            ["not mine", 0x3, 0x1],  # a bit this rank did not set
        ]
    )
    assert results["step"] == [0x1FFD, 0x1FFF, None]
    assert results["commit"] == [0, 1, None]
    assert [results[k][2] for k in ("garbage", "high bit", "not mine")] == [86, 86, 86], results
    assert "the garbage agreement returned -0x47505fa8, which no rank can have contributed" in stderr
    assert "the high bit agreement returned 0x37838ad8" in stderr


def _race(mode: str, agreements: int, *extra: str) -> list[dict]:
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--with-ft", "ulfm", "--bind-to", "none"]
    cmd += ["--mca", "coll", "^han,cuda", "--mca", "btl", "tcp,self", "-n", "3", sys.executable]
    cmd += [str(WORKERS / "agreement_race_worker.py"), mode, "--agreements", str(agreements), *extra]
    cmd += ["--hog-s", str(RACE_TIMEOUT_S)]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    log = wait_mpirun(start_mpirun(cmd, env), RACE_TIMEOUT_S)
    ranks = [json.loads(line[line.index("{") :]) for line in log.splitlines() if '"wrong"' in line]
    assert len(ranks) == 3, log[-4000:]
    return ranks


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="mpirun (Open MPI with ULFM) not available")
def test_an_agreement_with_another_thread_making_progress_returns_wrong_values_unless_kept_out():
    """Open MPI 5.0.x's agreement returns values no rank contributed when another thread of the
    process makes MPI progress during it (``ulfm.agreement``): the failure watch, polling without
    its side of the lock, makes agreements go wrong; with it, every agreement gets its value. If
    the first assertion fails, Open MPI no longer has the race and the lock can go."""
    bare = _race("bare", BARE_AGREEMENTS, "--until-wrong")
    assert sum(r["wrong"] for r in bare) >= 1, bare
    fixed = _race("fixed", FIXED_AGREEMENTS)
    assert [(r["ran"], r["wrong"]) for r in fixed] == [(FIXED_AGREEMENTS, 0)] * 3, fixed
